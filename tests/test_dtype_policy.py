"""Dtype support and the float64 policy (run as float32 by default, warn once per op)."""

import warnings

import pytest
import torch

import torchneuron

from conftest import assert_same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_dtypes_compute(dtype):
    c = torch.randn(8, 8).to(dtype)
    n = c.to("neuron")
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else {}
    assert_same((n @ n).relu() + 1, (c @ c).relu() + 1, **tol)
    assert_same(n.sum(0), c.sum(0), **tol)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_integer_dtypes_compute(dtype):
    c = torch.arange(-6, 6).to(dtype).reshape(3, 4)
    n = c.to("neuron")
    for f in (lambda x: x + 3, lambda x: x * x, lambda x: x // 2, lambda x: x % 3, lambda x: x.sum(1),
              lambda x: x.max(0).values, lambda x: x > 2, lambda x: x / 2):
        assert_same(f(n), f(c))


def test_int64_stays_int64():
    big = torch.tensor([2 ** 40, -(2 ** 41)], dtype=torch.int64)
    n = big.to("neuron") * 3
    assert n.dtype == torch.int64 and n.cpu().tolist() == (big * 3).tolist()


def test_bool_and_complex():
    c = torch.tensor([True, False, True])
    assert_same(c.to("neuron") & ~c.to("neuron"), c & ~c)
    z = torch.randn(4, dtype=torch.complex64)
    assert_same(z.to("neuron") * z.to("neuron"), z * z)


@pytest.mark.parametrize("op", [torch.abs, torch.angle, torch.sgn, torch.linalg.vector_norm,
                                lambda t: torch.linalg.eig(t.real.reshape(2, 2))[1].abs()])
def test_complex_to_real_ops_use_both_parts(op):
    """abs/angle of a complex tensor return real tensors computed from real *and* imaginary parts."""
    torch.manual_seed(0)
    z = torch.complex(torch.randn(4), torch.randn(4))
    assert_same(op(z.to("neuron")), op(z), rtol=1e-5, atol=1e-5)


def test_float64_downcast_warns_once_per_op_and_counts():
    torchneuron.metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.ones(3, dtype=torch.float64).to("neuron")
        y = torch.ones(3, dtype=torch.float64).to("neuron")
    assert x.dtype == torch.float32 and y.dtype == torch.float32
    msgs = [str(w.message) for w in caught if "float64" in str(w.message)]
    assert len(msgs) <= 1  # once per op, not per call
    assert torchneuron.metrics()["float64_downcasts"]
    assert torch.equal(x.cpu(), torch.ones(3))


def test_float64_error_setting(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "float64", "error")
    with pytest.raises(TypeError, match="TORCHNEURON_FLOAT64"):
        torch.ones(3, dtype=torch.float64).to("neuron")


def test_float64_keep_setting(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "float64", "keep")
    x = torch.tensor([1 / 3], dtype=torch.float64)
    n = x.to("neuron")
    assert n.dtype == torch.float64
    assert (n * 3).cpu().item() == (x * 3).item()


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="not supported on the neuron device"):
        torch.ones(2, dtype=torch.float8_e4m3fn).to("neuron")


def test_autocast_runs_matmuls_in_low_precision_and_keeps_gradients_float32():
    torch.manual_seed(0)
    a = torch.randn(8, 8)
    w = torch.randn(8, 8, requires_grad=True)
    wn = w.detach().to("neuron").requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(a, w)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out = torch.nn.functional.linear(a.to("neuron"), wn)
        assert torch.exp(out).dtype == torch.float32  # float32-policy ops run in float32
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_same(out, ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    ref.float().sum().backward()
    assert wn.grad.dtype == torch.float32
    assert_same(wn.grad, w.grad, rtol=2e-2, atol=5e-2)
