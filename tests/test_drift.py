"""torchneuron.locate_drift: the first module, then the first ATen op, whose neuron result leaves CPU's tolerance."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from torch import nn

import torchneuron
from torchneuron.eager import kernel

from conftest import cpu_only

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The planted drifts warn (float64 downcast, CPU fallback) once per process: not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Cancel(nn.Module):
    """Exact in float64 on CPU; float64 downcast to float32 on neuron loses x to rounding."""

    def forward(self, x):
        y = x.double() + 1e8
        return (y - 1e8).float()   # CANCEL-LINE


class Squash(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2   # TANH-LINE


class Net(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.middle = middle
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.relu(self.middle(self.inp(x))))


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(Cancel)).splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def _net(middle, seed=0):
    torch.manual_seed(seed)
    return Net(middle).to("neuron")


def test_float64_cancellation_names_module_op_and_downcast():
    model = _net(Cancel())
    x = torch.randn(3, 8)
    report = torchneuron.locate_drift(model, x.to("neuron"))
    assert report.drift
    assert report.module.name == "middle" and report.module.type == "Cancel"
    assert report.module.phase == "forward"
    op = report.op
    assert op.op == "aten.sub.Tensor"
    assert op.float64_downcast and op.cpu_output_dtypes == ["float64"] and op.output_dtypes == ["float32"]
    assert op.site["line"] == _line("CANCEL-LINE")
    assert op.difference.max_abs > 1e-3   # x's low bits are gone: a real drift, not noise
    text = str(report)
    assert "middle (Cancel)" in text and "aten.sub.Tensor" in text and "float64 was downcast" in text
    # The same model with config.float64="keep" has no drift.
    torchneuron.config.float64 = "keep"
    try:
        assert not torchneuron.locate_drift(model, x).drift
    finally:
        torchneuron.config.float64 = "downcast"


@pytest.fixture
def wrong_tanh(monkeypatch):
    """tanh's lowering made 1% wrong (and kept out of the persistent cache)."""
    k = next(k for k in kernel.Kernel.instances if k.lowering.name == "tanh.default")
    right = k.lowering.fn
    monkeypatch.setattr(k, "lowering", dataclasses.replace(k.lowering, fn=lambda *a, **kw: right(*a, **kw) * 1.01))
    monkeypatch.setattr(k, "persistent", False)
    kernel.clear_cache()
    yield
    monkeypatch.undo()
    kernel.clear_cache()


def test_mislowered_op_names_module_op_and_call_site(wrong_tanh):
    model = _net(Squash())
    x = torch.randn(4, 8)
    report = torchneuron.locate_drift(model, x)
    assert report.module.name == "middle" and report.module.type == "Squash"
    assert report.op.op == "aten.tanh.default" and report.op.index == 0
    assert not report.op.float64_downcast and not report.op.cpu_fallback
    assert report.op.site["line"] == _line("TANH-LINE")
    assert report.op.site["file"].endswith("test_drift.py")
    assert 0.005 < report.op.difference.max_rel < 0.02
    assert f"test_drift.py:{_line('TANH-LINE')}" in str(report)


def test_no_drift_forward_and_backward():
    model = _net(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)))
    before = [p.grad for p in model.parameters()]
    report = torchneuron.locate_drift(model, torch.randn(5, 8), backward=True)
    assert not report.drift and report.op is None
    assert report.modules_compared == 7   # inp, middle and its 3 children, out, the model
    assert str(report).startswith("No drift")
    assert [p.grad for p in model.parameters()] == before   # the user's grads are left alone
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())   # hooks removed


def test_backward_drift_is_located():
    # A custom autograd function whose backward is wrong on neuron only: the forward matches,
    # the gradient of the module's input drifts.
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (2.5 if g.device.type == "neuron" else 2.0)   # SCALE-BACKWARD-LINE

    class M(nn.Module):
        def forward(self, x):
            return Scale.apply(x)

    model = _net(M())
    report = torchneuron.locate_drift(model, torch.randn(3, 8), backward=True)
    assert report.module.name == "middle" and report.module.phase == "backward (input gradient)"
    # The op-level re-run runs the module's backward from CPU's output gradient: Scale.backward's mul.
    op = report.op
    assert op.op == "aten.mul.Tensor" and op.phase == "backward"
    assert op.site["line"] == _line("SCALE-BACKWARD-LINE")
    assert 0.2 < op.difference.max_rel < 0.3
    assert "middle (M)" in str(report) and "backward" in str(report)


def test_bad_arguments():
    with pytest.raises(ValueError, match="baseline"):
        torchneuron.locate_drift(_net(nn.Identity()), torch.randn(2, 8), baseline="cuda")
    with pytest.raises(ValueError, match="move it to neuron"):
        torchneuron.locate_drift(nn.Linear(2, 2), torch.randn(2, 2))


def test_tiny_llama_runs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().to("neuron")
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for backward in (False, True):
        report = torchneuron.locate_drift(model, (ids,), kwargs={"use_cache": False}, rtol=1e-4, atol=1e-4,
                                          backward=backward)
        assert report.modules_compared > 10
        assert not report.drift, str(report)
    assert all(p.grad is None for p in model.parameters())


def test_drift_inside_adaptive_region_is_marked_fused():
    with torchneuron.eager_mode("adaptive"):
        report = torchneuron.locate_drift(_net(Cancel()), torch.randn(3, 8))
    assert report.op.op == "aten.sub.Tensor" and report.op.fused and report.op.float64_downcast
    assert "adaptive fused region" in str(report)
    report = torchneuron.locate_drift(_net(Cancel()), torch.randn(3, 8))
    assert not report.op.fused   # plain eager: one executable per op


class Bins(nn.Module):
    """float64 rounding (within tolerance) moves values across a histogram edge, which a CPU
    fallback op (histc, registered by conftest with a CPU kernel only) turns into a count drift."""

    def forward(self, x):
        y = x.double() - 1e-8    # float64: just below each integer; float32: rounds back onto it
        return cpu_only(y, 4)    # BINS-LINE


def test_drift_at_a_cpu_fallback_op():
    model = Bins().to("neuron")
    x = torch.tensor([1.0, 2.0, 3.0, 0.5])
    report = torchneuron.locate_drift(model, x)
    assert report.module.type == "Bins"
    assert report.op.op == "torchneuron_test.cpu_only.default"
    # histc of a float64 tensor is float64 on CPU, float32 on neuron: downcast there too
    assert report.op.cpu_fallback and report.op.upstream_float64_downcast and report.op.float64_downcast
    assert report.op.site["line"] == _line("BINS-LINE")
    assert report.op.difference.max_abs == 1.0   # one count moved to the next bin
    assert "ran as a CPU fallback" in str(report)
