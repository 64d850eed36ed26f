import atexit
import os
import shutil
import tempfile

# Each test process gets its own persistent compilation cache (tests that exercise the cache set
# their own): concurrent workers must not read each other's half-written entries, and results
# must not depend on what earlier runs left in the user's cache. Eager executables are stored there
# too, so it is removed when the process ends.
if "TORCHNEURON_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="torchneuron-test-cache-")
    os.environ["TORCHNEURON_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron


@pytest.fixture(autouse=True)
def _fresh_metrics():
    torchneuron.metrics.reset()
    yield


@pytest.fixture(params=["plain", "adaptive"])
def both_eager_modes(request, monkeypatch):
    """Run the test in plain eager mode and again in adaptive eager mode (parity in both; regions
    compile as soon as they repeat, so the fused path runs too)."""
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)
    with torchneuron.eager_mode(request.param):
        yield request.param


@pytest.fixture
def strict_fallback():
    """Any CPU fallback inside the test is an error."""
    old = torchneuron.config.fallback
    torchneuron.config.fallback = "error"
    yield
    torchneuron.config.fallback = old


# An op with only a CPU kernel, no lowering and no decomposition: exercises the CPU fallback no
# matter how many real ops gain lowerings.
_lib = torch.library.Library("torchneuron_test", "DEF")
_lib.define("cpu_only(Tensor x, int bins) -> Tensor")
_lib.define("cpu_only_(Tensor(a!) x) -> Tensor(a!)")
_lib.impl("cpu_only", lambda x, bins: torch.histc(x, bins=bins, min=0, max=bins), "CPU")
_lib.impl("cpu_only_", lambda x: x.mul_(2).add_(1), "CPU")
cpu_only = torch.ops.torchneuron_test.cpu_only
cpu_only_ = torch.ops.torchneuron_test.cpu_only_


def assert_same(neuron_tensor, cpu_tensor, **tol):
    assert neuron_tensor.device.type == "neuron", neuron_tensor.device
    torch.testing.assert_close(neuron_tensor.cpu(), cpu_tensor, **tol)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test (its compiles are the test's own)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
