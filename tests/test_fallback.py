"""Ops without a lowering: decomposition first, else CPU fallback (counted, warned once), or an error."""

import sys
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


def test_torchneuron_warnings_point_at_the_users_line(monkeypatch):
    """The fallback and float64 warnings name the line of the user's code that called the op, not
    a line of torch (torch._ops) or of torchneuron's wrapper of torch.zeros (runtime/pinned.py)."""
    from torchneuron.runtime import dtypes

    monkeypatch.setattr(fallback, "_warned", set())
    monkeypatch.setattr(dtypes, "_warned_float64", set())
    n = torch.tensor([0.5, 1.5]).to("neuron")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line_fallback = sys._getframe().f_lineno + 1
        _no_lowering_op(n)
        line_float64 = sys._getframe().f_lineno + 1
        torch.zeros(2, dtype=torch.float64, device="neuron")
    where = {("fallback" if "not lowered" in str(w.message) else "float64"): (w.filename, w.lineno)
             for w in caught if "torchneuron:" in str(w.message)}
    # The fallback runs inside _no_lowering_op (this file's helper): its line is the user's line.
    assert where["fallback"][0] == __file__ and where["fallback"][1] in (line_fallback, _no_lowering_op.__code__.co_firstlineno + 1)
    assert where["float64"] == (__file__, line_float64)


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
