"""Choosing the PJRT platform and what its client starts with: ``jax_platforms`` set before JAX starts
a backend, the platform read when the device starts (not at import), one device per torchrun rank,
the GPU allocator settings, and the plugin in the executable fingerprint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import torchneuron
from torchneuron.config import Config
from torchneuron.runtime import executable_store, pjrt, startup


def _run(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter (JAX starts its backends once per process); its last
    stdout line is JSON."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHNEURON_PLATFORM", "TORCHNEURON_VISIBLE", "TORCHNEURON_GPU_",
                                    "JAX_PLATFORMS", "LOCAL_RANK", "XLA_PYTHON_CLIENT"))}
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cpu_platform_initialises_only_cpu():
    out = _run("""
        import json, torch, jax
        from jax._src import xla_bridge
        before = list(xla_bridge._backends)
        (torch.ones(3, device="neuron") + 1).cpu()
        print(json.dumps({"before": before, "platforms": jax.config.jax_platforms,
                          "backends": list(xla_bridge._backends)}))
    """, TORCHNEURON_PLATFORM="cpu")
    # Importing torch (and torchneuron with it) starts no backend; the first op starts only cpu.
    assert out == {"before": [], "platforms": "cpu", "backends": ["cpu"]}


def test_platform_is_read_when_the_device_starts():
    out = _run("""
        import json, os, torch, torchneuron
        imported = torchneuron.config.platform
        os.environ["TORCHNEURON_PLATFORM"] = "cpu"   # after `import torch`, before the first op
        (torch.ones(2, device="neuron") * 2).cpu()
        print(json.dumps({"imported": imported, "started": torchneuron.config.platform}))
    """, TORCHNEURON_PLATFORM="nonesuch")
    assert out == {"imported": "nonesuch", "started": "cpu"}


def test_platform_assigned_in_code_wins_over_its_variable():
    out = _run("""
        import json, os, torch, torchneuron
        torchneuron.config.platform = "cpu"
        os.environ["TORCHNEURON_PLATFORM"] = "nonesuch"
        (torch.ones(2, device="neuron") * 2).cpu()
        print(json.dumps({"started": torchneuron.config.platform}))
    """)
    assert out == {"started": "cpu"}


def test_missing_plugin_is_an_error_and_jax_stays_usable():
    out = _run("""
        import json, torch, jax
        try:
            torch.ones(2, device="neuron")
            error = ""
        except RuntimeError as err:
            error = str(err)
        print(json.dumps({"error": error, "available": torch.neuron.is_available(),
                          "platforms": jax.config.jax_platforms,
                          "jax_still_works": float(jax.numpy.ones(2).sum())}))
    """, TORCHNEURON_PLATFORM="nonesuch")
    assert "TORCHNEURON_PLATFORM='nonesuch'" in out["error"] and "TORCHNEURON_PLATFORM=cpu" in out["error"]
    assert out["available"] is False
    # The failed start left JAX's own choice of platforms in place.
    assert out["platforms"] is None and out["jax_still_works"] == 2.0


def test_users_jax_platforms_is_kept():
    out = _run("""
        import json, torch, jax
        (torch.ones(2, device="neuron") + 1).cpu()
        print(json.dumps({"platforms": jax.config.jax_platforms}))
    """, JAX_PLATFORMS="cpu")
    assert out == {"platforms": "cpu"}


def test_allocator_variables_are_set_while_the_client_starts():
    # The CPU factory stands in for the GPU plugin: it records what the process environment held
    # when the client was created. LOCAL_RANK on the CPU platform keeps every device visible.
    out = _run("""
        import json, os, torch
        from jax._src import xla_bridge
        seen = {}
        registration = xla_bridge._backend_factories["cpu"]
        factory = registration.factory
        def recording(*args, **kwargs):
            seen.update({k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                        "XLA_PYTHON_CLIENT_MEM_FRACTION")})
            return factory(*args, **kwargs)
        registration.factory = recording
        (torch.ones(2, device="neuron:1") + 1).cpu()
        after = {k: os.environ.get(k) for k in seen}
        print(json.dumps({"seen": seen, "after": after, "count": torch.neuron.device_count()}))
    """, TORCHNEURON_GPU_PREALLOCATE="0", TORCHNEURON_GPU_MEMORY_FRACTION="0.4", LOCAL_RANK="1",
        XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert out["seen"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}
    # Restored once the client started: processes the program starts see the user's environment.
    assert out["after"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    assert out["count"] == 2


def test_cuda_rank_sees_only_its_device():
    # No GPU here: what prepare() tells JAX for the CUDA platform is read before any backend starts,
    # then the start is abandoned (the options go back to what they were).
    out = _run("""
        import json, jax, torchneuron
        from torchneuron.runtime import startup
        torchneuron.config.platform = "cuda"
        seen = {}
        try:
            with startup.prepare() as platform:
                seen = {"platform": platform, "platforms": jax.config.jax_platforms,
                        "visible": jax.config.values["jax_cuda_visible_devices"]}
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        seen["after"] = [jax.config.jax_platforms, jax.config.values["jax_cuda_visible_devices"]]
        print(json.dumps(seen))
    """, LOCAL_RANK="3")
    assert out == {"platform": "cuda", "platforms": "cuda,cpu", "visible": "3", "after": [None, "all"]}


@pytest.mark.parametrize("setting, platform, environ, expected", [
    ("auto", "cuda", {"LOCAL_RANK": "1"}, 1),
    ("auto", "neuron", {"LOCAL_RANK": "2"}, 2),
    ("auto", "cuda", {}, None),                                            # not under torchrun
    ("auto", "cuda", {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "5"}, None),   # the user chose already
    ("auto", "cpu", {"LOCAL_RANK": "1"}, None),                            # forced CPU devices: all
    ("auto", "tpu", {"LOCAL_RANK": "1"}, None),
    ("all", "cuda", {"LOCAL_RANK": "1"}, None),
    ("local_rank", "cuda", {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, 1),
    ("2", "rocm", {}, 2),
])
def test_visible_device(setting, platform, environ, expected):
    assert startup.visible_device(setting, platform, environ) == expected


@pytest.mark.parametrize("setting, platform, environ, words", [
    ("local_rank", "cuda", {}, ["LOCAL_RANK", "torchrun", "TORCHNEURON_VISIBLE_DEVICE=all"]),
    ("local_rank", "cpu", {"LOCAL_RANK": "0"}, ["'cpu'", "TORCHNEURON_VISIBLE_DEVICE=all"]),
    ("local_rank", "cuda", {"LOCAL_RANK": "x"}, ["LOCAL_RANK='x'"]),
])
def test_visible_device_refusals_name_the_way_out(setting, platform, environ, words):
    with pytest.raises(RuntimeError) as err:
        startup.visible_device(setting, platform, environ)
    assert all(w in str(err.value) for w in words), err.value


def test_jax_platforms_for_each_platform():
    assert startup.jax_platforms("cpu") == "cpu"
    assert startup.jax_platforms("cuda") == "cuda,cpu"
    assert startup.jax_platforms("gpu") == "cuda,cpu"    # JAX's "gpu" would also demand rocm
    assert startup.jax_platforms("neuron") == "neuron,cpu"


def test_allocator_environment():
    assert startup.allocator_environment("auto", "auto", {}) == {}
    assert startup.allocator_environment(True, 0.9, {}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    # jaxlib refuses both fraction variables at once: the user's newer name takes the value.
    assert startup.allocator_environment("auto", 0.5, {"XLA_CLIENT_MEM_FRACTION": "0.2"}) == {
        "XLA_CLIENT_MEM_FRACTION": "0.5"}


def test_start_settings_parse():
    cfg = Config.from_env({"TORCHNEURON_VISIBLE_DEVICE": " Local_Rank ", "TORCHNEURON_GPU_PREALLOCATE": "off",
                           "TORCHNEURON_GPU_MEMORY_FRACTION": "0.25"})
    assert (cfg.visible_device, cfg.gpu_preallocate, cfg.gpu_memory_fraction) == ("local_rank", False, 0.25)
    cfg = Config.from_env({"TORCHNEURON_GPU_PREALLOCATE": "auto", "TORCHNEURON_GPU_MEMORY_FRACTION": "AUTO",
                           "TORCHNEURON_VISIBLE_DEVICE": "1"})
    assert (cfg.visible_device, cfg.gpu_preallocate, cfg.gpu_memory_fraction) == ("1", "auto", "auto")
    cfg.visible_device = 0
    assert cfg.visible_device == "0"


@pytest.mark.parametrize("variable, raw, words", [
    ("TORCHNEURON_GPU_MEMORY_FRACTION", "1.5", ["config.gpu_memory_fraction", "(0, 1]"]),
    ("TORCHNEURON_GPU_MEMORY_FRACTION", "0", ["(0, 1]"]),
    ("TORCHNEURON_GPU_MEMORY_FRACTION", "most", ["TORCHNEURON_GPU_MEMORY_FRACTION='most'", "'auto'"]),
    ("TORCHNEURON_GPU_PREALLOCATE", "maybe", ["TORCHNEURON_GPU_PREALLOCATE='maybe'", "auto"]),
    ("TORCHNEURON_VISIBLE_DEVICE", "first", ["'local_rank'", "device index"]),
])
def test_start_settings_refuse_bad_values(variable, raw, words):
    with pytest.raises(ValueError) as err:
        Config.from_env({variable: raw})
    assert all(w in str(err.value) for w in words), err.value


def test_start_settings_refuse_bad_types():
    cfg = Config()
    with pytest.raises(TypeError, match="gpu_preallocate"):
        cfg.gpu_preallocate = "yes"
    with pytest.raises(TypeError, match="gpu_memory_fraction"):
        cfg.gpu_memory_fraction = True


def test_kernels_follow_the_platform_the_device_started_on():
    # The kernel table is built at `import torch`; LAPACK-only lowerings (eig) must become the CPU
    # fallback on a platform without LAPACK. Simulated here: the table is told the device is on tpu.
    out = _run("""
        import json, warnings, torch, torchneuron
        from torchneuron.eager import registration
        x = torch.randn(3, 3).to("neuron")
        torch.linalg.eig(x)
        lowered = torchneuron.metrics()["fallbacks"].get("linalg_eig", 0)
        registration.follow_started_platform("tpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.linalg.eig(x)
        print(json.dumps({"lowered": lowered, "fallback": torchneuron.metrics()["fallbacks"].get("linalg_eig", 0),
                          "in_table": "linalg_eig.default" in registration.KERNELS}))
    """)
    assert out == {"lowered": 0, "fallback": 1, "in_table": False}


def test_fingerprint_names_the_plugin():
    details = executable_store.fingerprint_details()["platform"]
    assert details["pjrt"] == pjrt.platform_version() != ""
    assert "plugins" in details and "driver" in details
    assert torchneuron.config.platform == "cpu" and details["plugins"] == {}


def test_plugin_version_change_invalidates_the_store(monkeypatch):
    here = executable_store.fingerprint_details.__wrapped__()
    monkeypatch.setattr(executable_store, "_plugin_versions", lambda platform: {"jax-cuda13-plugin": "0.11.3"})
    there = executable_store.fingerprint_details.__wrapped__()
    found = executable_store.fingerprint_differences(there, here)
    assert found == ["plugins {'jax-cuda13-plugin': '0.11.3'} in the cache, {} here"]
