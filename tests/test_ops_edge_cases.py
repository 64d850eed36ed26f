"""Corner cases the complete OpInfo sweep found, each checked against CPU PyTorch.

The sweep (``python -m tools.coverage``) covers them too, but only in its full run; these
are the regressions in a form CI runs every time.
"""

import pytest
import torch

import torchneuron

DEV = "neuron"


def same(cpu, neuron, **tol):
    torch.testing.assert_close(neuron.cpu(), cpu, **tol)


# -- determinants: ATen factors A^T for a C-contiguous A, and the backward relies on it ----------
@pytest.mark.parametrize("layout", ["contiguous", "column-major", "batched"])
@pytest.mark.parametrize("fn", [torch.linalg.det, lambda a: torch.linalg.slogdet(a)[1], torch.logdet])
def test_determinant_gradients_match_cpu_for_every_layout(layout, fn):
    torch.manual_seed(0)
    a = torch.randn(3, 5, 5) if layout == "batched" else torch.randn(5, 5)
    a = a @ a.mT + torch.eye(5)   # positive determinant, so logdet is finite
    if layout == "column-major":
        a = a.mT.contiguous().mT
    x = a.clone().requires_grad_()
    fn(x).sum().backward()
    y = a.to(DEV).requires_grad_()
    fn(y).sum().backward()
    same(x.grad, y.grad, atol=1e-4, rtol=1e-4)


def test_compiled_determinant_gradient_matches_cpu():
    torch.manual_seed(1)
    a = torch.randn(4, 4)
    x = a.clone().requires_grad_()
    torch.linalg.det(x).backward()
    y = a.to(DEV).requires_grad_()
    torch.compile(torch.linalg.det, backend="neuron")(y).backward()
    same(x.grad, y.grad, atol=1e-5, rtol=1e-4)


# -- 0-d tensors with a dim argument -------------------------------------------------------------
@pytest.mark.parametrize("op", [
    lambda t: torch.softmax(t, 0), lambda t: torch.log_softmax(t, 0), lambda t: torch.prod(t, 0),
    lambda t: torch.prod(t, 0, keepdim=True), lambda t: torch.aminmax(t, dim=0)[1],
    lambda t: torch.softmax(t, 0, dtype=torch.float32),
])
def test_zero_dim_reductions_over_dim_0(op):
    t = torch.tensor(1.5)
    same(op(t), op(t.to(DEV)))


@pytest.mark.filterwarnings("ignore:The reduce argument")
def test_legacy_scatter_reduce_on_a_zero_dim_tensor():
    t, idx = torch.tensor(2.0), torch.tensor(0)
    for reduce in ("add", "multiply"):
        same(t.scatter(0, idx, torch.tensor(3.0), reduce=reduce),
             t.to(DEV).scatter(0, idx.to(DEV), torch.tensor(3.0).to(DEV), reduce=reduce))
        same(t.scatter(0, idx, 2.5, reduce=reduce), t.to(DEV).scatter(0, idx.to(DEV), 2.5, reduce=reduce))


# -- empty batches -------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [
    lambda t: torch.nn.functional.group_norm(t, 2),
    lambda t: torch.nn.functional.avg_pool2d(t, (1, 2)),
    lambda t: torch.nn.functional.max_pool2d(t, (1, 2)),
])
def test_ops_on_an_empty_batch_keep_their_shape(op):
    t = torch.randn(0, 4, 3, 6)
    out = op(t.to(DEV))
    assert out.device.type == DEV and out.shape == op(t).shape


def test_gather_and_scatter_add_with_an_empty_index_of_another_rank():
    src = torch.randn(5)
    idx = torch.zeros(2, 0, dtype=torch.int64)
    same(torch.gather(src, 0, idx), torch.gather(src.to(DEV), 0, idx.to(DEV)))
    x = src.clone().requires_grad_()
    torch.gather(x, 0, idx).sum().backward()
    y = src.to(DEV).requires_grad_()
    torch.gather(y, 0, idx.to(DEV)).sum().backward()
    same(x.grad, y.grad)


# -- broadcasting and dtypes ---------------------------------------------------------------------
def test_masked_scatter_broadcasts_self_to_the_mask():
    torch.manual_seed(2)
    t, mask, src = torch.randn(5), torch.rand(5, 5) > 0.5, torch.randn(5, 5)
    same(torch.masked_scatter(t, mask, src), torch.masked_scatter(t.to(DEV), mask.to(DEV), src.to(DEV)))


def test_integer_trunc_division_broadcasts():
    a, b = torch.randint(-20, 20, (5, 1)), torch.randint(1, 5, (5,))
    same(torch.div(a, b, rounding_mode="trunc"), torch.div(a.to(DEV), b.to(DEV), rounding_mode="trunc"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floor_division_follows_aten(dtype):
    torch.manual_seed(3)
    a, b = torch.randn(2000, dtype=dtype) * 50, torch.randn(2000, dtype=dtype)
    a[:3] = torch.tensor([1.0, -1.0, 0.0], dtype=dtype)
    b[:3] = torch.tensor([0.1, 0.0, -3.0], dtype=dtype)   # 1 // 0.1 is 9; -1 // 0 is -inf; -0.0
    exact = torch.floor_divide(a.double(), b.double()).to(dtype)
    for mode in ("floor", "trunc"):
        n = torch.div(a.to(DEV), b.to(DEV), rounding_mode=mode).cpu()
        ref = torch.div(a.double(), b.double(), rounding_mode=mode).to(dtype)
        # bfloat16: the quotient is computed in float32 and rounded once (CPU rounds it to
        # bfloat16 before flooring, which can be off by one); float32 matches CPU exactly.
        same(torch.div(a, b, rounding_mode=mode) if dtype == torch.float32 else ref, n, equal_nan=True)
    same(exact, torch.floor_divide(a.to(DEV), b.to(DEV)), equal_nan=True)
    assert torch.floor_divide(a.to(DEV), b.to(DEV)).cpu()[2].signbit()


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_exact_quotients_of_broadcast_operands_stay_exact(mode):
    # XLA would divide by a broadcast operand through its reciprocal: 5.125 / 5.125 -> 0.99999994.
    torch.manual_seed(7)
    b = torch.randn(50, 40)
    a = b.expand(3, 50, 40).contiguous()
    same(torch.div(a, b, rounding_mode=mode), torch.div(a.to(DEV), b.to(DEV), rounding_mode=mode))


def test_index_add_on_bool_is_a_logical_or():
    t = torch.tensor([[True, False], [False, False]])
    src = torch.tensor([[False, True], [True, False]])
    idx = torch.tensor([1, 0])
    for alpha in (True, False):
        same(t.index_add(0, idx, src, alpha=alpha), t.to(DEV).index_add(0, idx.to(DEV), src.to(DEV), alpha=alpha))


@pytest.mark.parametrize("args", [(0.0, -8.000001, -4.0), (1.0, 5.000001, 2.0), (-0.9, 2.1, 2.0), (10, 0, -3)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_arange_into_integers_truncates_its_arguments_first(args, dtype):
    same(torch.arange(*args, dtype=dtype), torch.arange(*args, dtype=dtype, device=DEV))


def test_batch_norm_without_running_stats():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 4)
    same(torch.nn.functional.batch_norm(x, None, None, training=True),
         torch.nn.functional.batch_norm(x.to(DEV), None, None, training=True), atol=1e-5, rtol=1e-5)


# -- half precision: one rounding, as ATen's opmath kernels -----------------------------------------
def _closer_or_within_an_ulp(cpu, neuron, exact):
    """neuron is no further from the float64 result than CPU, or within one bfloat16 ulp of it."""
    allowed = torch.maximum((cpu.double() - exact).abs(), torch.finfo(cpu.dtype).eps * exact.abs())
    assert bool(((neuron.cpu().double() - exact).abs() <= allowed).all())


def test_foreach_addcmul_keeps_its_scalars_in_float32():
    torch.manual_seed(5)
    xs = [torch.randn(17, 17, dtype=torch.bfloat16) for _ in range(3)]
    scalars = [0.8169093525900684, 0.5132484593952417, 0.0350984390]
    cpu = torch._foreach_addcmul(xs, xs, xs, scalars)
    neuron = torch._foreach_addcmul(*[[x.to(DEV) for x in xs]] * 3, scalars)
    exact = torch._foreach_addcmul(*[[x.double() for x in xs]] * 3, scalars)
    for c, n, e in zip(cpu, neuron, exact):
        _closer_or_within_an_ulp(c, n, e)


@pytest.mark.parametrize("op", [
    lambda t, dt: torch.cumsum(t, 1, dtype=dt),
    lambda t, dt: torch.sum(t, 1, dtype=dt),
    lambda t, dt: torch.nn.functional.conv2d(t, t[:4, :1, :3, :3].to(dt), groups=4, padding=1),
])
def test_half_precision_accumulates_in_float32(op):
    torch.manual_seed(6)
    t = torch.randn(4, 4, 6, 6, dtype=torch.bfloat16)
    exact = op(t.double(), torch.float64)
    _closer_or_within_an_ulp(op(t, torch.bfloat16), op(t.to(DEV), torch.bfloat16), exact.double())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_gcd_and_lcm_run_natively_and_wrap_as_aten(dtype):
    torch.manual_seed(8)
    low = 0 if dtype == torch.uint8 else -100
    a, b = torch.randint(low, 100, (500,), dtype=dtype), torch.randint(low, 100, (500,), dtype=dtype)
    a[:3], b[:2] = 0, 0                       # gcd(0, 0) = 0 = lcm(0, 0)
    before = dict(torchneuron.metrics.fallbacks)
    for fn in (torch.gcd, torch.lcm):         # int8 lcm overflows: computed wide, wrapped when stored
        same(fn(a, b), fn(a.to(DEV), b.to(DEV)))
    assert dict(torchneuron.metrics.fallbacks) == before


@pytest.mark.filterwarnings("ignore:torchneuron")
@pytest.mark.parametrize("weights", [None, torch.float32, torch.int32])
@pytest.mark.parametrize("minlength", [0, 12])
def test_bincount_runs_on_neuron(weights, minlength):
    torch.manual_seed(9)
    x = torch.randint(0, 8, (40,))
    w = None if weights is None else torch.randint(0, 5, (40,)).to(weights)
    before = dict(torchneuron.metrics.fallbacks)
    out = torch.bincount(x.to(DEV), None if w is None else w.to(DEV), minlength)
    assert dict(torchneuron.metrics.fallbacks) == before and out.device.type == DEV
    ref = torch.bincount(x, w, minlength)
    same(ref.to(out.dtype), out)   # float64 results are float32 on neuron (the dtype policy)
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(torch.tensor([3, -1], device=DEV))


def test_an_identically_zero_gradient_stays_on_neuron():
    # sgn's gradient for real inputs is an _efficientzerotensor.
    x = torch.randn(3, 4).to(DEV).requires_grad_()
    before = dict(torchneuron.metrics.fallbacks)
    (torch.sgn(x) * 2).sum().backward()
    assert dict(torchneuron.metrics.fallbacks) == before
    same(torch.zeros(3, 4), x.grad)


# Eval-mode batch norm saves no statistics: CPU returns save_mean/save_invstd of shape (0,), the
# meta kernels (which eager planning followed) say (C,); _native_batch_norm_legit_no_training
# failed to compile at all (its lowering gave (0,) against the meta kernel's (C,)).
_BN_EVAL = {
    "native_batch_norm": lambda x, w, b, rm, rv, train: torch.ops.aten.native_batch_norm(x, w, b, rm, rv, train, 0.1, 1e-5),
    "_native_batch_norm_legit": lambda x, w, b, rm, rv, train: torch.ops.aten._native_batch_norm_legit(
        x, w, b, rm, rv, train, 0.1, 1e-5),
    "_native_batch_norm_legit_no_training": lambda x, w, b, rm, rv, train: (
        torch.ops.aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)),
    "_batch_norm_no_update": lambda x, w, b, rm, rv, train: (
        torch.ops.aten._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5)),
}


@pytest.mark.parametrize("mode", ["plain", "adaptive"])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("op", list(_BN_EVAL))
def test_batch_norm_saved_statistics_have_cpus_shapes(op, train, mode):
    if train and op.endswith(("no_training", "no_update")):
        pytest.skip("no training form")
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 4, generator=g), torch.rand(3, generator=g), torch.rand(3, generator=g),
            torch.rand(3, generator=g), torch.rand(3, generator=g) + 0.5]
    on = [a.to("neuron") for a in args]
    expected = _BN_EVAL[op](*args, train)
    with torchneuron.eager_mode(mode):
        got = _BN_EVAL[op](*on, train)
        torch.neuron.synchronize()
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    for a, b in zip(on[3:], args[3:]):   # the running statistics (updated in training only)
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)


def test_adaptive_eager_produces_outputs_without_elements():
    """A new output without elements has data_ptr() 0: adaptive eager filed it under 0, never gave
    its storage a buffer, and the next synchronize failed on the pending placeholder."""
    x, r = torch.ones(2, 3, 4, device=DEV), torch.ones(3, device=DEV)
    with torchneuron.eager_mode("adaptive"):
        empty = torch.empty(0, device=DEV) + 1
        reserve = torch.ops.aten._batch_norm_with_update(x, r, r, r.clone(), r.clone(), 0.1, 1e-5)[3]
        torch.neuron.synchronize()
    assert empty.cpu().shape == (0,) and reserve.cpu().shape == (0,)


def test_matrix_exp_is_as_accurate_as_cpus_float32():
    """JAX's Padé expm and ATen's Taylor expm differ elementwise by float32 rounding amplified by
    scaling and squaring (docs/reliability.md); against the float64 result, normwise, neuron is
    as close as CPU's float32 kernel."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 5, 5, generator=g) * 3
    truth = torch.linalg.matrix_exp(a.double())
    cpu = torch.linalg.matrix_exp(a)
    got = torch.linalg.matrix_exp(a.to(DEV)).cpu()
    for i in range(a.shape[0]):
        scale = truth[i].norm()
        err_neuron = ((got[i].double() - truth[i]).norm() / scale).item()
        err_cpu = ((cpu[i].double() - truth[i]).norm() / scale).item()
        assert err_neuron < max(10 * err_cpu, 1e-5), (i, err_neuron, err_cpu)


def test_embedding_max_norm_renormalises_rows_in_eager_and_compiled_graphs():
    """nn.Embedding(max_norm=...) calls embedding_renorm_ (eager) / embedding_renorm (graphs): the
    rows looked up are scaled to max_norm in place, as on CPU (graphs failed to lower it)."""
    import copy
    import warnings

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Embedding(20, 6, max_norm=1.0), torch.nn.Linear(6, 2))
    eager = copy.deepcopy(cpu).to("neuron")
    compiled_module = copy.deepcopy(cpu).to("neuron")
    compiled = torch.compile(compiled_module, backend="neuron")
    for ids in (torch.tensor([[1, 3, 3, 7], [0, 1, 19, 5]]), torch.tensor([[2, 4, 4, 9], [11, 12, 2, 0]])):
        ref = cpu(ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got_eager, got_compiled = eager(ids.to("neuron")), compiled(ids.to("neuron"))
        torch.testing.assert_close(got_eager.cpu(), ref)
        torch.testing.assert_close(got_compiled.cpu(), ref)
        torch.testing.assert_close(eager[0].weight.detach().cpu(), cpu[0].weight.detach())
        torch.testing.assert_close(compiled_module[0].weight.detach().cpu(), cpu[0].weight.detach())
    assert not torchneuron.metrics()["fallbacks"]


def test_subnormals_are_flushed_to_zero_as_cpu_with_flush_denormal():
    # XLA:CPU runs with flush-to-zero / denormals-are-zero (docs/reliability.md): float32 values
    # under 1.18e-38 read and come out as zero, as CPU PyTorch under torch.set_flush_denormal(True).
    x = torch.tensor([1e-39, -3e-40, 1e-30, 2.0])
    w = torch.full((4, 4), 1e-39)
    out = (x.to("neuron") * 1.5).cpu()
    mm = (w.to("neuron") @ torch.eye(4).to("neuron")).cpu()
    default = x * 1.5
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        flushed, flushed_mm = x * 1.5, w @ torch.eye(4)
    finally:
        torch.set_flush_denormal(False)
    torch.testing.assert_close(out, flushed, rtol=0, atol=0)
    torch.testing.assert_close(mm, flushed_mm, rtol=0, atol=0)
    assert out[0] == 0 and default[0] != 0 and out[2] == default[2]
