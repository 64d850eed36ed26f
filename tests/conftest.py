import pytest
import torch

import torchneuron


@pytest.fixture(autouse=True)
def _fresh_metrics():
    torchneuron.metrics.reset()
    yield


@pytest.fixture
def strict_fallback():
    """Any CPU fallback inside the test is an error."""
    old = torchneuron.config.fallback
    torchneuron.config.fallback = "error"
    yield
    torchneuron.config.fallback = old


def assert_same(neuron_tensor, cpu_tensor, **tol):
    assert neuron_tensor.device.type == "neuron", neuron_tensor.device
    torch.testing.assert_close(neuron_tensor.cpu(), cpu_tensor, **tol)
