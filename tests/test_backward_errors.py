"""Errors inside backward on neuron. torch.compile graphs whose backward needs a data-dependent output shape (a value written through
a bool mask, index_fill with a tensor value): AOTAutograd's joint trace cannot build them, and must
fall back to eager as on CPU -- not abort the process inside autograd's engine."""

import pytest
import torch

import torchneuron
from torchneuron.metrics import metrics


def _masked_write(x, m, s):
    y = x * 1
    y[m] = s
    return y


def _index_put(x, m, v):
    return torch.index_put(x, (m,), v)


def _index_fill(x, idx, s):
    return x.index_fill(1, idx, s)


def _inputs(case):
    torch.manual_seed(0)
    x = torch.randn(5, 7)
    m = torch.rand(5, 7) > 0.5
    if case is _masked_write:
        return x, m, torch.tensor(1.5)
    if case is _index_put:
        return x, m, torch.randn(int(m.sum()))
    return x, torch.tensor([0, 2, 2]), torch.tensor(-0.5)


@pytest.mark.parametrize("shapes", ["static", "bucketed"])
@pytest.mark.parametrize("case", [_masked_write, _index_put, _index_fill])
def test_data_dependent_backward_runs_eagerly_with_cpu_gradients(case, shapes, monkeypatch):
    monkeypatch.setattr(torchneuron.config, "shapes", shapes)
    torch._dynamo.reset()
    cpu = [a.clone().requires_grad_(a.is_floating_point()) for a in _inputs(case)]
    case(*cpu).pow(2).sum().backward()
    dev = [a.to("neuron").requires_grad_(a.is_floating_point()) for a in _inputs(case)]
    before = sum(metrics.graph_fallbacks.values())
    with pytest.warns(UserWarning, match="backward needs an output shape that depends on data"):
        out = torch.compile(case, backend="neuron", dynamic=shapes == "bucketed")(*dev)
    out.pow(2).sum().backward()
    assert sum(metrics.graph_fallbacks.values()) > before   # Dynamo may retry the frame once
    torch.testing.assert_close(out.cpu(), case(*[a.detach() for a in cpu]))
    for c, d in zip(cpu, dev):
        if c.requires_grad:
            torch.testing.assert_close(d.grad.cpu(), c.grad)


def test_without_grad_the_masked_write_stays_compiled():
    torch._dynamo.reset()
    x, m, s = (a.to("neuron") for a in _inputs(_masked_write))
    before = sum(metrics.graph_fallbacks.values())
    out = torch.compile(_masked_write, backend="neuron")(x, m, s)
    assert sum(metrics.graph_fallbacks.values()) == before
    torch.testing.assert_close(out.cpu(), _masked_write(x.cpu(), m.cpu(), s.cpu()))


class _RaiseInMul(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode (as tensor subclasses such as DTensor have) whose op fails inside backward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor:
            raise ValueError("mul refused by the mode")
        return func(*args, **(kwargs or {}))


def test_an_error_raised_through_torch_dispatch_inside_backward_reaches_the_caller():
    # It used to end the process: autograd's stream guard called the device guard's Python method
    # with the error pending (std::terminate, "terminate called without an active exception").
    x = torch.randn(3, device="neuron", requires_grad=True)
    y = (x * x).sum()
    with pytest.raises(ValueError, match="mul refused by the mode"), _RaiseInMul():
        y.backward()
    (x * 3).sum().backward()             # the engine is still usable
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 3.0))
