"""The eager executable cache keys on everything that decides an op's result, compared with CPU.

Each case runs an op twice with inputs that Python considers equal or that a cache key could miss
(``6 == 6.0``, ``0.0 == -0.0``, the default dtype, the float64 policy...), in both orders, and checks
every result against CPU PyTorch: a key that misses one of them returns the first call's program.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchneuron
from torchneuron.eager import kernel as kernel_mod

from conftest import assert_same


def compiled():
    return torchneuron.metrics()["executables_compiled"]


@pytest.fixture
def default_dtype():
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


@pytest.mark.parametrize("order", [(6.0, 6), (6, 6.0)])
def test_arange_float_and_int_end_are_different_programs(order):
    for end in order:
        got = torch.arange(end, device="neuron")
        want = torch.arange(end)
        assert got.dtype == want.dtype, (end, got.dtype)
        assert_same(got, want)


@pytest.mark.parametrize("args", [[(0, 5, 1), (0, 5, 1.0)], [(0, 5, 1.0), (0, 5, 1)],
                                  [(0, 3), (0.0, 3)], [(True, 3), (1, 3)]])
def test_arange_start_step_types_are_keyed(args):
    for a in args:
        got = torch.arange(*a, device="neuron")
        want = torch.arange(*a)
        assert got.dtype == want.dtype, (a, got.dtype)
        assert_same(got, want)


@pytest.mark.parametrize("values", [(True, 1, 1.0), (1.0, 1, True), (1, True, 1.0)])
def test_full_fill_value_type_picks_the_dtype(values):
    for v in values:
        assert_same(torch.full((3,), v, device="neuron"), torch.full((3,), v))


def test_default_dtype_decides_integer_tensor_with_float_scalar(default_dtype):
    u8 = torch.tensor([1, 2, 250], dtype=torch.uint8)
    n = u8.to("neuron")
    assert_same(n + 5.5, u8 + 5.5)
    torch.set_default_dtype(torch.bfloat16)
    got, want = n + 5.5, u8 + 5.5
    assert want.dtype == torch.bfloat16 and got.dtype == torch.bfloat16, got.dtype
    assert_same(got, want)
    torch.set_default_dtype(torch.float32)
    assert_same(n + 5.5, u8 + 5.5)


def test_default_dtype_decides_true_division_and_factories(default_dtype):
    i = torch.arange(1, 7)
    n = i.to("neuron")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float32):
        torch.set_default_dtype(dtype)
        # float64 runs as float32 on neuron (the documented policy); the rest keep their dtype.
        want_dtype = torch.float32 if dtype == torch.float64 else dtype
        got = n / 4
        assert got.dtype == want_dtype, (dtype, got.dtype)
        torch.testing.assert_close(got.cpu(), (i / 4).to(want_dtype))
        r = torch.arange(0.0, 3.0, device="neuron")
        assert r.dtype == want_dtype, (dtype, r.dtype)


def test_negative_zero_is_not_positive_zero():
    x = torch.tensor([float("nan"), 1.0])
    n = x.to("neuron")
    for nan in (0.0, -0.0, 0.0):
        got = torch.nan_to_num(n, nan=nan).cpu()
        want = torch.nan_to_num(x, nan=nan)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (nan, got)
    for value in (0.0, -0.0):   # a runtime scalar: 1 / -0.0 is -inf
        assert_same(torch.full((2,), 1.0, device="neuron") / value, torch.full((2,), 1.0) / value)


def test_nan_compiled_in_argument_hits_its_own_entry():
    n = torch.tensor([float("nan"), 2.0, float("inf")], device="neuron")
    torch.nan_to_num(n, posinf=float("nan"))
    before = compiled()
    for _ in range(3):
        got = torch.nan_to_num(n, posinf=float("nan"))
    assert compiled() == before   # NaN != NaN must not make every call a new key
    want = torch.nan_to_num(torch.tensor([float("nan"), 2.0, float("inf")]), posinf=float("nan"))
    torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_float64_policy_change_is_not_served_from_the_cache(monkeypatch):
    torch.arange(3, dtype=torch.float64, device="neuron")      # downcast: a float32 program
    monkeypatch.setattr(torchneuron.config, "float64", "keep")
    kept = torch.arange(3, dtype=torch.float64, device="neuron")
    assert kept.dtype == torch.float64
    assert_same(kept, torch.arange(3, dtype=torch.float64))
    monkeypatch.setattr(torchneuron.config, "float64", "error")
    with pytest.raises(TypeError, match="TORCHNEURON_FLOAT64"):
        torch.arange(3, dtype=torch.float64, device="neuron")


def test_autocast_decides_the_matmul_dtype():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    na, nb = a.to("neuron"), b.to("neuron")
    assert (na @ nb).dtype == torch.float32
    with torch.autocast("neuron", dtype=torch.bfloat16):
        inside = na @ nb
    assert inside.dtype == torch.bfloat16
    assert_same(inside, (a.bfloat16() @ b.bfloat16()), rtol=2e-2, atol=2e-2)
    assert (na @ nb).dtype == torch.float32


def test_deterministic_mode_changes_nothing_it_should_not():
    x = torch.zeros(5)
    idx = torch.tensor([0, 1, 1, 3])
    src = torch.ones(4)
    n = x.to("neuron")
    for flag in (False, True, False):
        torch.use_deterministic_algorithms(flag)
        try:
            got = n.index_add(0, idx.to("neuron"), src.to("neuron"))
        finally:
            torch.use_deterministic_algorithms(False)
        assert_same(got, x.index_add(0, idx, src))


def test_bool_and_int_compiled_in_scalars_differ():
    # linalg_vector_norm compiles its ord in (static_scalars): 2 and 2.0 are one norm, True is not
    # a valid ord for CPU either, so compare the valid spellings with CPU.
    x = torch.tensor([3.0, -4.0])
    n = x.to("neuron")
    for ord in (2, 2.0, 1, 1.0, math.inf):
        assert_same(torch.linalg.vector_norm(n, ord), torch.linalg.vector_norm(x, ord))


def test_clear_cache_forgets_keys_and_compile_reasons(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "cache_dir", "")   # compile again, not load from disk
    n = torch.randn(3, device="neuron")
    torch.sin(n)
    kernel_mod.clear_cache()
    torchneuron.metrics.reset()
    torch.sin(n)
    assert torchneuron.metrics()["eager_compiles"].get("new op", 0) >= 1
