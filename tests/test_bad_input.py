"""Bad input gets a clear error naming the op, shapes/dtypes and the way out; nothing crashes."""

import subprocess
import sys

import pytest
import torch

import torchneuron

from conftest import cpu_only


@pytest.mark.parametrize("fn, shapes, op", [
    (torch.matmul, [(2, 3), (2, 3)], "aten::mm"),
    (torch.add, [(2, 3), (4,)], "aten::add.Tensor"),
    (lambda a, b: a.add_(b), [(3,), (2, 3)], "aten::add_.Tensor"),
    (lambda a, b: torch.cat([a, b], 1), [(2, 3), (3, 3)], "aten::cat"),
])
def test_shape_errors_name_op_and_shapes(fn, shapes, op):
    cpu_args = [torch.ones(s) for s in shapes]
    with pytest.raises(RuntimeError):
        fn(*cpu_args)  # the same call is an error on CPU too
    with pytest.raises(RuntimeError) as err:
        fn(*[t.to("neuron") for t in cpu_args])
    msg = str(err.value)
    assert op in msg
    for s in shapes:
        assert f"Tensor{list(s)}:float32@neuron:0" in msg


def test_dtype_error_in_place():
    x = torch.ones(3, dtype=torch.int64, device="neuron")
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long") as err:
        x.add_(torch.ones(3, device="neuron") * 0.5)
    assert "Tensor[3]:int64@neuron:0" in str(err.value)


def test_mixed_devices_like_cuda():
    with pytest.raises(RuntimeError, match="found at least two devices, neuron:0 and cpu"):
        torch.mm(torch.ones(2, 2, device="neuron"), torch.ones(2, 2))


def test_invalid_device_index_and_bad_setting():
    with pytest.raises(RuntimeError, match=r"invalid device index neuron:7.*valid: 0\.\.0"):
        torch.ones(1, device="neuron:7")
    with pytest.raises(ValueError, match="TORCHNEURON_FALLBACK"):
        torchneuron.config.fallback = "sometimes"


def test_strict_fallback_error_names_op_inputs_and_setting(strict_fallback):
    with pytest.raises(RuntimeError) as err:
        cpu_only(torch.ones(5, device="neuron"), 3)
    assert "torchneuron_test::cpu_only" in str(err.value) and "Tensor[5]:float32" in str(err.value)
    assert "TORCHNEURON_FALLBACK=warn" in str(err.value)


def test_storage_constructor_does_not_crash_the_interpreter():
    code = ("import torch\ns = torch.UntypedStorage(16, device='neuron')\n"
            "t = torch.empty(0, device='neuron').set_(s).view(torch.float32).fill_(2)\n"
            "print(s.nbytes(), t.sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16", "8.0"]
