"""Fused op pairs of compiled graphs (compile/fusions.py): gradients equal CPU PyTorch's, and the
pair really is planned as one step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401 - registers the neuron device
from torchneuron.compile import fusions, graph

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def planned(monkeypatch):
    """Every Fusions a GraphProgram planned in the test."""
    seen = []

    class Recording(fusions.Fusions):
        def __init__(self, *args):
            super().__init__(*args)
            seen.append(self)

    monkeypatch.setattr(graph, "Fusions", Recording)
    return seen


def _fused_ops(seen):
    return [sig.name for f in seen for sig, _ in f.steps.values()]


CASES = {
    "mean": dict(shape=(37, 53), kwargs={}),
    "sum": dict(shape=(37, 53), kwargs={"reduction": "sum"}),
    "none": dict(shape=(37, 53), kwargs={"reduction": "none"}),
    "weight_ignore": dict(shape=(37, 53), kwargs={"weight": "w", "ignore_index": 3}),
    "all_ignored_rows_some": dict(shape=(9, 11), kwargs={"ignore_index": -100, "ignore_some": True}),
    "segmentation_4d": dict(shape=(3, 7, 5, 6), kwargs={"weight": "w"}),
    "unbatched": dict(shape=(29,), kwargs={}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cross_entropy_backward_is_one_fused_step_and_equals_cpu(case, planned):
    spec = CASES[case]
    shape, kwargs = spec["shape"], dict(spec["kwargs"])
    g = torch.Generator().manual_seed(7)
    classes = shape[1] if len(shape) > 1 else shape[0]
    logits = torch.randn(shape, generator=g) * 3
    target_shape = (shape[0], *shape[2:]) if len(shape) > 1 else ()
    target = torch.randint(0, classes, target_shape, generator=g)
    if kwargs.pop("ignore_some", False):
        target[::3] = -100
    if kwargs.get("ignore_index") == 3:
        target[target % 4 == 0] = 3
    if kwargs.get("weight") == "w":
        kwargs["weight"] = torch.rand(classes, generator=g) + 0.5

    def loss_fn(x, t, **kw):
        loss = F.cross_entropy(x, t, **kw)
        return loss.sum() * 1.5 if loss.ndim else loss * 1.5   # a grad_output other than 1

    ref = logits.clone().requires_grad_()
    loss_fn(ref, target, **kwargs).backward()

    dev_kwargs = {k: v.to("neuron") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    x = logits.to("neuron").requires_grad_()
    loss = torch.compile(loss_fn, backend="neuron")(x, target.to("neuron"), **dev_kwargs)
    loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), loss_fn(logits, target, **kwargs), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.cpu(), ref.grad, rtol=1e-5, atol=1e-7)
    assert _fused_ops(planned) == ["torchneuron::log_softmax_nll_backward"]


def _compiled_grad(logits, target):
    torch._dynamo.reset()
    x = logits.to("neuron").requires_grad_()
    torch.compile(F.cross_entropy, backend="neuron")(x, target.to("neuron")).backward()
    return x.grad.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gradient_is_the_unfused_one_element_for_element(dtype, planned, monkeypatch):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(24, 40, generator=g) * 2).to(dtype)
    target = torch.randint(0, 40, (24,), generator=g)
    fused = _compiled_grad(logits, target)
    assert _fused_ops(planned) == ["torchneuron::log_softmax_nll_backward"]

    class Unfused(fusions.Fusions):
        def __init__(self, *args):
            super().__init__(*args)
            self.steps, self.skipped = {}, set()

    monkeypatch.setattr(graph, "Fusions", Unfused)
    assert torch.equal(fused, _compiled_grad(logits, target))
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, target).backward()
    # bfloat16: the log-softmax output the backward reads is rounded to bfloat16 (one unit in the
    # last place at -3 is 1.6%), fused or not.
    torch.testing.assert_close(fused, ref.grad, **({} if dtype == torch.float32 else dict(rtol=4e-2, atol=1e-3)))


def test_nll_gradient_used_elsewhere_is_not_fused(planned):
    """The NLL gradient feeds more than the log-softmax backward: nothing to fuse, still exact."""
    g = torch.Generator().manual_seed(2)
    logits, target = torch.randn(8, 10, generator=g), torch.randint(0, 10, (8,), generator=g)

    def fn(lp, t):   # lp: log-probabilities used twice, so its gradient has two contributions
        return F.nll_loss(lp, t) + (lp.exp() * 0.25).sum()

    ref = logits.clone().requires_grad_()
    fn(F.log_softmax(ref, 1), target).backward()
    x = logits.to("neuron").requires_grad_()
    torch.compile(lambda z, t: fn(F.log_softmax(z, 1), t), backend="neuron")(x, target.to("neuron")).backward()
    torch.testing.assert_close(x.grad.cpu(), ref.grad, rtol=1e-5, atol=1e-7)
    assert _fused_ops(planned) == []


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_fused_op_runs_eagerly_as_the_pair(device):
    """The op's own kernel is the pair (a graph that falls back to eager runs it)."""
    g = torch.Generator().manual_seed(3)
    lp = F.log_softmax(torch.randn(6, 9, generator=g), 1)
    target = torch.randint(0, 9, (6,), generator=g)
    total = torch.tensor(6.0)
    grad = torch.tensor(0.5)
    want = torch.ops.aten._log_softmax_backward_data(
        torch.ops.aten.nll_loss_backward(grad, lp, target, None, 1, -100, total), lp, 1, torch.float32)
    got = fusions.CROSS_ENTROPY_BACKWARD(grad.to(device), lp.to(device), target.to(device), None, 1, -100,
                                         total.to(device), lp.to(device), 1, torch.float32)
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["t", "transpose", "permute", "t_used_twice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_of_a_transposed_operand_is_fused_and_equals_cpu(how, dtype, planned):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(37, 23, generator=g).to(dtype)
    b = torch.randn(37, 11, generator=g).to(dtype)

    def fn(a, b):
        at = {"t": lambda: a.t(), "transpose": lambda: a.transpose(0, 1), "permute": lambda: a.permute(1, 0),
              "t_used_twice": lambda: a.t()}[how]()
        out = torch.mm(at, b)
        return (out, at * 2) if how == "t_used_twice" else out

    got = torch.compile(fn, backend="neuron")(a.to("neuron"), b.to("neuron"))
    want = fn(a, b)
    for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        torch.testing.assert_close(x.cpu(), y, **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))
    assert "torchneuron::mm_transposed_self" in _fused_ops(planned)


def test_linear_weight_gradients_use_the_fused_mm_and_match_cpu(planned):
    torch.manual_seed(5)
    cpu = torch.nn.Sequential(torch.nn.Linear(19, 33), torch.nn.GELU(), torch.nn.Linear(33, 7))
    with torch.device("neuron"):
        dev = torch.nn.Sequential(torch.nn.Linear(19, 33), torch.nn.GELU(), torch.nn.Linear(33, 7))
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(45, 19)
    cpu(x).square().mean().backward()
    torch.compile(dev, backend="neuron")(x.to("neuron")).square().mean().backward()
    for p, q in zip(dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
    # grad_h.t() @ x (33 x 19: a wider than b) is fused; grad_out.t() @ h (7 x 33) runs as traced
    assert _fused_ops(planned).count("torchneuron::mm_transposed_self") == 1


@pytest.mark.parametrize("m, n", [(11, 23), (16, 16)])
def test_mm_of_a_transposed_operand_narrower_than_the_other_is_not_fused(m, n, planned):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(37, m, generator=g), torch.randn(37, n, generator=g)
    got = torch.compile(lambda a, b: torch.mm(a.t(), b), backend="neuron")(a.to("neuron"), b.to("neuron"))
    torch.testing.assert_close(got.cpu(), a.t() @ b)
    assert "torchneuron::mm_transposed_self" not in _fused_ops(planned)


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_fused_mm_runs_eagerly_as_mm_of_the_transpose(device):
    a, b = torch.randn(6, 4), torch.randn(6, 5)
    got = fusions.MM_TRANSPOSED_SELF(a.to(device), b.to(device))
    torch.testing.assert_close(got.cpu(), a.t() @ b)
