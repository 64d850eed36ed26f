"""The neuron device is a first-class PyTorch device: torch.device, torch.accelerator, torch.neuron."""

import os
import subprocess
import sys

import pytest
import torch

import torchneuron


def test_device_strings():
    assert torch.device("neuron").type == "neuron"
    assert torch.device("neuron:0").index == 0
    assert torch.ones(2, device="neuron:0").device == torch.device("neuron:0")


def test_accelerator_api():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == torch.neuron.device_count() >= 1


def test_accelerator_synchronize_is_neuron_synchronize():
    # torch.accelerator.synchronize() ends in the device guard's synchronizeDevice, which a Python
    # backend's guard cannot override: once the accelerator was initialised (current_device_index
    # does it) PyTorch raised "Backend doesn't support synchronizing all streams on device".
    torch.accelerator.current_device_index()
    x = torch.ones(3, 4, device="neuron")
    for device in (None, 0, "neuron:0", torch.device("neuron", 0)):
        torch.accelerator.synchronize(device)
    # It waits for the device as torch.neuron.synchronize() does: a device-side error surfaces.
    x.index_select(0, torch.tensor([5], device="neuron"))
    with pytest.raises(IndexError, match="index out of range in self"):
        torch.accelerator.synchronize()
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.synchronize("cpu")


def test_accelerator_memory_functions_report_neuron_memory():
    # PyTorch's torch.accelerator memory functions ask for a CachingDeviceAllocator, which a Python
    # backend cannot register: every one of them failed with an INTERNAL ASSERT.
    x = torch.ones(1024, device="neuron")
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated() >= x.nbytes
    assert torch.accelerator.memory_reserved(0) == torch.neuron.memory_reserved(0)
    assert torch.accelerator.max_memory_allocated("neuron:0") == torch.neuron.max_memory_allocated()
    assert torch.accelerator.max_memory_reserved() >= torch.accelerator.memory_reserved()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()
    y = torch.ones(4096, device="neuron")
    del y
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.neuron.memory_allocated()
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["num_allocs"] == 0
    torch.accelerator.empty_cache()
    free, total = torch.accelerator.get_memory_info()
    assert (free, total) == torch.neuron.memory.mem_get_info()
    assert 0 <= free <= total == torch.neuron.get_device_properties().total_memory
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.memory_allocated("cpu")


def test_device_module_functions():
    m = torch.neuron
    assert m.is_available()
    assert m.current_device() == 0
    m.set_device(0)
    with m.device(0):
        assert m.current_device() == 0
    m.synchronize()
    assert "neuron" in m.get_device_name()
    props = m.get_device_properties(0)
    assert props.total_memory > 0 and props.platform == torchneuron.config.platform


def test_autoload_through_torch_backends_entry_point():
    # A fresh interpreter that only imports torch has the neuron device.
    code = "import torch; print(torch.zeros(2, device='neuron').device, torch.neuron.is_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["neuron:0", "True"]


def test_a_source_tree_without_install_still_has_the_compile_backend():
    """PYTHONPATH=src and no entry points (a machine that allows no installs): `import torchneuron`
    registers backend="neuron" with Dynamo itself."""
    code = (
        "import importlib.metadata as md\n"
        "real = md.entry_points\n"
        "md.entry_points = lambda **kw: md.EntryPoints(()) if kw.get('group') in ('torch_dynamo_backends', 'torch.backends') "
        "else real(**kw)\n"
        "import torch, torchneuron\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='neuron')\n"
        "print(f(torch.arange(3.0, device='neuron')).tolist(), torchneuron._autoloaded)\n")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[1.0, 3.0, 5.0] False"


def test_register_is_idempotent():
    torchneuron.register()
    torchneuron.register()
    assert (torch.ones(3, device="neuron") + 1).cpu().tolist() == [2.0, 2.0, 2.0]


def test_unknown_device_index_is_a_clear_error():
    bad = torch.neuron.device_count()
    with pytest.raises(RuntimeError, match=rf"invalid device index neuron:{bad}"):
        torch.zeros(2, device=f"neuron:{bad}")
    with pytest.raises(RuntimeError, match="invalid device index"):
        torch.neuron.set_device(bad)


def test_missing_platform_plugin_names_it():
    code = ("import os; os.environ['TORCHNEURON_PLATFORM']='tpu'; import torch\n"
            "try:\n    torch.zeros(1, device='neuron')\nexcept RuntimeError as e:\n    print('ERR', e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "TORCHNEURON_PLATFORM='tpu'" in out.stdout and "libtpu" in out.stdout


def test_two_devices_keep_data_where_it_was_put():
    # The CPU PJRT platform can expose several devices; each neuron:<i> must map to its own.
    code = """
import torch, torchneuron
from torchneuron.runtime import memory
assert torch.neuron.device_count() == 2
a = torch.ones(3, device="neuron:1")
b = a * 2
z = torch.arange(4, device="neuron:1")
assert b.device == z.device == torch.device("neuron:1")
for t in (a, b, z):
    assert [d.id for d in memory.record_of(t).buf.devices()] == [1]
with torch.neuron.device(1):
    assert torch.zeros(2, device="neuron").device.index == 1
try:
    a + torch.ones(3, device="neuron:0")
    raise SystemExit("mixing devices must fail")
except RuntimeError as e:
    assert "neuron:1 and neuron:0" in str(e)
c = b.to("neuron:0")
assert c.device.index == 0 and c.cpu().tolist() == [2.0, 2.0, 2.0]
assert torch.neuron.memory_allocated(1) > 0 and torch.neuron.memory_allocated(0) > 0
print("ok")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
