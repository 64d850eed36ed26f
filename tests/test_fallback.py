"""Ops without a lowering: decomposition first, else CPU fallback (counted, warned once), or an error."""

import warnings

import pytest
import torch

import torchneuron
from torchneuron.eager import fallback

from conftest import cpu_only, cpu_only_


def _no_lowering_op(x):
    return cpu_only(x, 4)


def test_cpu_fallback_runs_counts_and_warns_once(monkeypatch):
    # Warn-once is per process: start from a process that has warned about nothing (another test in
    # this worker may already have run the op).
    monkeypatch.setattr(fallback, "_warned", set())
    x = torch.tensor([0.5, 1.5, 1.7, 3.2, 9.0])
    n = x.to("neuron")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r1 = _no_lowering_op(n)
        r2 = _no_lowering_op(n)
    assert r1.device.type == "neuron"
    assert torch.equal(r1.cpu(), _no_lowering_op(x)) and torch.equal(r2.cpu(), r1.cpu())
    fallback_warnings = [w for w in caught if "not lowered for neuron" in str(w.message)]
    assert len(fallback_warnings) == 1 and "torchneuron_test::cpu_only" in str(fallback_warnings[0].message)
    assert torchneuron.metrics()["fallbacks"] == {"torchneuron_test::cpu_only": 2}


def test_fallback_in_place_effects_reach_the_device_tensor():
    x = torch.tensor([[3.0, 1.0], [2.0, 5.0]])
    n = x.to("neuron")
    view = n[:, 1]
    torchneuron.config.fallback = "silent"
    try:
        returned = cpu_only_(view)
    finally:
        torchneuron.config.fallback = "warn"
    assert returned is view
    assert torch.equal(n.cpu(), torch.tensor([[3.0, 3.0], [2.0, 11.0]]))


def test_strict_mode_raises_naming_op_and_setting(strict_fallback):
    n = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError) as err:
        _no_lowering_op(n)
    msg = str(err.value)
    assert "torchneuron_test::cpu_only" in msg and "TORCHNEURON_FALLBACK" in msg and "Tensor[3]:float32" in msg


def test_decomposition_is_used_before_fallback(strict_fallback):
    # aten::hardsigmoid_backward has a lowering; aten::logit_backward has a decomposition only.
    x = torch.tensor([0.2, 0.5, 0.7], requires_grad=True)
    n = x.detach().to("neuron").requires_grad_()
    torch.logit(x).sum().backward()
    torch.logit(n).sum().backward()
    torch.testing.assert_close(n.grad.cpu(), x.grad)
    assert torchneuron.metrics()["fallbacks"] == {}
    assert "logit_backward" in torchneuron.metrics()["decompositions"]


def test_cpu_tensor_mixed_with_neuron_tensor_is_cuda_style_error():
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least "
                                           r"two devices, neuron:0 and cpu!"):
        torch.ones(3, device="neuron") + torch.ones(3)
    # A 0-dim CPU tensor is a scalar operand, as on CUDA.
    r = torch.ones(3, device="neuron") * torch.tensor(2.0)
    assert r.cpu().tolist() == [2.0, 2.0, 2.0]
