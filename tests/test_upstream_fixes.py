"""Defects PyTorch's own upstream tests found on neuron (tools/upstream.py), each checked
against CPU PyTorch."""

import pytest
import torch


def _error(fn, device):
    try:
        fn(device)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


# TestCommon.test_dtypes_multinomial: neuron sampled from integer, bool and complex "probabilities"
# and returned zero or too-few samples where CPU raises.
@pytest.mark.parametrize("case", [
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.int64, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.uint8, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.bool, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.complex64, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, device=d), 0),
    lambda d: torch.multinomial(torch.ones(3, device=d), 4),
    lambda d: torch.multinomial(torch.ones(2, 0, device=d), 1),
    lambda d: torch.multinomial(torch.ones(2, 2, 3, device=d), 1),
], ids=["int64", "uint8", "bool", "complex64", "zero-samples", "more-than-categories",
        "no-categories", "3-d"])
def test_multinomial_rejects_what_cpu_rejects(case):
    expected = _error(case, "cpu")
    assert expected is not None
    assert _error(case, "neuron") == expected


def test_multinomial_valid_arguments_still_sample():
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    out = torch.multinomial(probs.to("neuron"), 2).cpu()
    assert out.dtype == torch.int64 and out.shape == (2, 2)
    assert set(out[0].tolist()) == {1, 3}          # without replacement: both non-zero categories
    with_replacement = torch.multinomial(probs.to("neuron"), 5, replacement=True).cpu()
    assert with_replacement.shape == (2, 5) and (with_replacement[1] == 0).all()
    half = torch.multinomial(probs.to(torch.float16).to("neuron"), 1).cpu()
    assert half.dtype == torch.int64 and half[1].item() == 0


# TestCommon.test_dtypes_nn_functional_huber_loss: integer losses ran on neuron where ATen's
# floating-point kernels raise NotImplementedError.
@pytest.mark.parametrize("loss", [torch.nn.functional.huber_loss, torch.nn.functional.smooth_l1_loss])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_floating_only_losses_reject_integers_like_cpu(loss, dtype):
    a, b = torch.arange(6).reshape(2, 3).to(dtype), torch.full((2, 3), 2, dtype=dtype)
    with pytest.raises(NotImplementedError, match="not implemented for"):
        loss(a, b)
    with pytest.raises(NotImplementedError, match=r"not implemented for '(Long|Int|Byte)'"):
        loss(a.to("neuron"), b.to("neuron"))


@pytest.mark.parametrize("loss", [torch.nn.functional.huber_loss, torch.nn.functional.smooth_l1_loss])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floating_only_losses_still_match_cpu(loss, dtype):
    a = torch.arange(6.0).reshape(2, 3).to(dtype)
    b = torch.full((2, 3), 2.0, dtype=dtype)
    for reduction in ("mean", "none"):
        got = loss(a.to("neuron"), b.to("neuron"), reduction=reduction)
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu(), loss(a, b, reduction=reduction))


# TestPoolingNNDeviceType.test_FractionalMaxPool3d_zero_out_size (and any unbatched input): ATen
# takes (1, C, nd) random samples for an unbatched input and ignores sample rows past the batch;
# neuron failed to compile both.
@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("case", ["unbatched", "unbatched-empty-output", "extra-sample-rows"])
def test_fractional_max_pool_samples_like_cpu(nd, case):
    gen = torch.Generator().manual_seed(nd)
    fn = torch.nn.functional.fractional_max_pool2d if nd == 2 else torch.nn.functional.fractional_max_pool3d
    spatial, kernel = (9, 7, 8)[:nd], (2, 3, 2)[:nd]
    output = (0,) + (3,) * (nd - 1) if case == "unbatched-empty-output" else (4, 3, 3)[:nd]
    shape = (3, *spatial) if case.startswith("unbatched") else (2, 3, *spatial)
    x = torch.randn(shape, generator=gen, requires_grad=True)
    samples = torch.rand(1 if case.startswith("unbatched") else 5, 3, nd, generator=gen)
    expected, expected_idx = fn(x, kernel, output_size=output, _random_samples=samples, return_indices=True)
    xn = x.detach().to("neuron").requires_grad_()
    got, got_idx = fn(xn, kernel, output_size=output, _random_samples=samples.to("neuron"), return_indices=True)
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(got_idx.cpu(), expected_idx)
    if expected.numel():
        grad = torch.randn(expected.shape, generator=gen)
        expected.backward(grad)
        got.backward(grad.to("neuron"))
        torch.testing.assert_close(xn.grad.cpu(), x.grad)


def test_fractional_max_pool_too_few_sample_rows_raises_cpus_error():
    x, samples = torch.rand(2, 3, 8, 8, 8), torch.rand(1, 3, 3)
    with pytest.raises(RuntimeError, match="no less then input batch size"):
        torch.nn.functional.fractional_max_pool3d(x, 2, output_size=3, _random_samples=samples)
    with pytest.raises(RuntimeError, match="no less then input batch size"):
        torch.nn.functional.fractional_max_pool3d(x.to("neuron"), 2, output_size=3,
                                                  _random_samples=samples.to("neuron"))


def test_fractional_max_pool3d_reads_samples_in_atens_order():
    """Found by comparing the pooling file's inputs on CPU: ATen's 3-D kernel takes samples
    (T, H, W) where the 2-D one takes (W, H); neuron read 3-D samples as (W, H, T), giving wrong
    windows whenever the dims differ."""
    gen = torch.Generator().manual_seed(0)
    x, samples = torch.randn(2, 3, 9, 7, 8, generator=gen), torch.rand(2, 3, 3, generator=gen)
    expected, expected_idx = torch.nn.functional.fractional_max_pool3d(
        x, (2, 3, 2), output_size=(4, 3, 3), _random_samples=samples, return_indices=True)
    got, got_idx = torch.nn.functional.fractional_max_pool3d(
        x.to("neuron"), (2, 3, 2), output_size=(4, 3, 3), _random_samples=samples.to("neuron"),
        return_indices=True)
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(got_idx.cpu(), expected_idx)


# TestPoolingNNDeviceType.test_adaptive_pooling_no_suppot_input: adaptive pooling averaged and
# maxed integer tensors where ATen's kernels raise "not implemented for 'Long'".
@pytest.mark.parametrize("fn", [
    lambda x: torch.nn.functional.adaptive_avg_pool1d(x[0], 2),
    lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 2),
    lambda x: torch.nn.functional.adaptive_avg_pool3d(x[None], 2),
    lambda x: torch.nn.functional.adaptive_max_pool1d(x[0], 2),
    lambda x: torch.nn.functional.adaptive_max_pool2d(x, 2),
    lambda x: torch.nn.functional.adaptive_max_pool3d(x[None], 2),
], ids=["avg1d", "avg2d", "avg3d", "max1d", "max2d", "max3d"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_adaptive_pooling_rejects_integers_like_cpu(fn, dtype):
    x = torch.arange(256).reshape(4, 4, 4, 4).to(dtype)
    with pytest.raises(NotImplementedError, match="not implemented for"):
        fn(x)
    with pytest.raises(NotImplementedError, match=r"adaptive_(avg|max)_pool\dd(_cpu)?\" not implemented for '(Long|Byte)'"):
        fn(x.to("neuron"))
    floating = x.float()
    torch.testing.assert_close(fn(floating.to("neuron")).cpu(), fn(floating))


# TestPoolingNNDeviceType.test_FractionalMaxPool3d_zero_samples: ATen's checks of _random_samples
# (the 3-D meta kernel does not make them) reached the user as "compiling ... failed ... a
# torchneuron bug", or not at all (wrong sample width, integer input).
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("samples", [(6, 3), (1, 3, 3), (2, 3, 2), (2, 2, 3), (2, 3, 3, 1), (2, 3, 3)],
                         ids=["2-d", "too-few-rows", "width-2", "channels", "4-d", "valid"])
def test_fractional_max_pool3d_checks_samples_like_cpu(samples, dtype):
    x = torch.arange(2 * 3 * 512).reshape(2, 3, 8, 8, 8).to(dtype)
    s = torch.rand(samples, generator=torch.Generator().manual_seed(0))
    expected = _error(lambda d: torch.nn.functional.fractional_max_pool3d(
        x.to(d), 2, output_size=3, _random_samples=s.to(d)), "cpu")
    if samples == (2, 3, 3) and dtype == torch.float32:
        assert expected is None
    else:
        assert expected is not None
    try:
        torch.nn.functional.fractional_max_pool3d(x.to("neuron"), 2, output_size=3, _random_samples=s.to("neuron"))
        got = None
    except RuntimeError as err:
        assert type(err) is RuntimeError and "torchneuron bug" not in str(err)
        got = str(err).splitlines()[0]
    assert got == expected


# TestPoolingNNDeviceType.test_max_pool3d_ndhwc: an unbatched (C, D, H, W) input laid out as a
# squeezed channels_last_3d batch gets channels-last results and indices from ATen's CPU kernel;
# neuron followed PyTorch's meta kernel (contiguous).
@pytest.mark.parametrize("layout", ["squeezed-channels-last-3d", "contiguous", "batched-channels-last-3d"])
def test_max_pool3d_result_layout_matches_cpu(layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 if layout.startswith("squeezed") else 2, 4, 6, 5, 7, generator=gen)
    if "channels-last" in layout:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    if layout != "batched-channels-last-3d":
        x = x.squeeze(0) if layout.startswith("squeezed") else x[0]
    expected, expected_idx = torch.nn.functional.max_pool3d(x, 2, 2, return_indices=True)
    got, got_idx = torch.nn.functional.max_pool3d(x.to("neuron"), 2, 2, return_indices=True)
    assert (got.stride(), got_idx.stride()) == (expected.stride(), expected_idx.stride())
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(got_idx.cpu(), expected_idx)
    xn = x.to("neuron").requires_grad_()
    x = x.clone().requires_grad_()
    grad = torch.randn(expected.shape, generator=gen)
    torch.nn.functional.max_pool3d(x, 2, 2).backward(grad)
    torch.nn.functional.max_pool3d(xn, 2, 2).backward(grad.to("neuron"))
    assert xn.grad.stride() == x.grad.stride()
    torch.testing.assert_close(xn.grad.cpu(), x.grad)


def _outcome(fn, device):
    """The result (on CPU) or the first line of the error of ``fn(device)``."""
    try:
        return fn(device).cpu()
    except (RuntimeError, IndexError) as err:
        return str(err).splitlines()[0]


def _same_outcome(fn):
    expected, got = _outcome(fn, "cpu"), _outcome(fn, "neuron")
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        torch.testing.assert_close(got, expected)
    else:
        assert got == expected


# TestIndexing.test_index_copy_scalars: a 0-dim index (or source) failed to compile; index_add and
# index_reduce also skipped ATen's shape checks (the meta kernel leaves them to the CPU kernel) and
# computed, or failed to compile, where CPU raises.
_INDEX_SHAPES = [((1,), (), (1,), 0), ((1,), (), (), 0), ((), (), (1,), 0), ((), (1,), (), 0), ((), (), (), 0),
                 ((1,), (1,), (), 0), ((2, 3), (), (1, 3), 0), ((2, 3), (2,), (3, 2), 1), ((3,), (1,), (1, 2), 0),
                 ((2, 3), (2,), (2, 2), -1), ((2, 3), (2,), (2,), 1)]


@pytest.mark.parametrize("op", ["index_copy", "index_add", "index_reduce"])
@pytest.mark.parametrize("shapes", _INDEX_SHAPES, ids=[str(s) for s in _INDEX_SHAPES])
def test_index_functions_take_0_dim_indices_and_check_shapes_like_cpu(op, shapes):
    self_shape, index_shape, source_shape, dim = shapes

    def run(device):
        x = torch.full(self_shape, 2.0, device=device)
        index = torch.zeros(index_shape, dtype=torch.int64, device=device)
        source = torch.arange(3.0, 3.0 + torch.Size(source_shape).numel()).reshape(source_shape).to(device)
        if op == "index_reduce":
            return x.index_reduce(dim, index, source, "prod")
        return getattr(x, op)(dim, index, source)

    if (op, shapes) in {("index_copy", ((2, 3), (2,), (2,), 1)), ("index_add", ((2, 3), (2,), (2,), 1)),
                        ("index_copy", ((2, 3), (2,), (3, 2), 1))}:
        pytest.skip("PyTorch's meta kernel raises first, with its own text")
    _same_outcome(run)


# TestIndexing.test_index_fill: a complex fill value for a real tensor was cast (imaginary part
# dropped) where ATen refuses it.
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32, torch.complex64])
@pytest.mark.parametrize("value", [1 + 1j, 2.7, -1, "complex-tensor", "float-tensor"])
def test_index_fill_values_like_cpu(dtype, value):
    def run(device):
        v = torch.tensor(1 + 1j if value == "complex-tensor" else 2.5, device=device) \
            if isinstance(value, str) else value
        x = torch.zeros(2, 2, dtype=dtype, device=device)
        return x.index_fill_(1, torch.tensor([0], device=device), v)
    _same_outcome(run)


# TestCommon.test_dtypes_*: lowerings computed dtypes ATen's CPU kernels refuse ("abs_cpu" not
# implemented for 'Bool', complex clamp, bool matmul, integer gelu...). Eager kernels now consult
# the table of CPU's refusals (ops/data/cpu_dtype_refusals.json) when they plan an executable.
_REFUSED = {
    "abs-bool": lambda d: torch.abs(torch.ones(3, dtype=torch.bool, device=d)),
    "abs_-bool": lambda d: torch.ones(3, dtype=torch.bool, device=d).abs_(),
    "abs-out-bool": lambda d: torch.abs(torch.ones(3, dtype=torch.bool, device=d),
                                        out=torch.empty(3, dtype=torch.bool, device=d)),
    "gelu-int64": lambda d: torch.nn.functional.gelu(torch.arange(4, device=d)),
    "clamp_max-complex": lambda d: torch.clamp_max(torch.ones(2, dtype=torch.complex64, device=d),
                                                   torch.ones(2, dtype=torch.complex64, device=d)),
    "mm-bool": lambda d: torch.ones(2, 2, dtype=torch.bool, device=d) @ torch.ones(2, 2, dtype=torch.bool, device=d),
    "lerp-int64": lambda d: torch.lerp(torch.arange(3, device=d), torch.arange(3, device=d), 0.5),
    "maximum-complex": lambda d: torch.maximum(torch.ones(2, dtype=torch.complex64, device=d),
                                               torch.ones(2, dtype=torch.complex64, device=d)),
    "sort-complex": lambda d: torch.sort(torch.ones(3, dtype=torch.complex64, device=d)),
    "softmax-int64": lambda d: torch.softmax(torch.arange(3, device=d), 0),
    "std-int64": lambda d: torch.std(torch.arange(3, device=d)),
    "topk-bool": lambda d: torch.topk(torch.ones(3, dtype=torch.bool, device=d), 2),
    "hypot-int64": lambda d: torch.hypot(torch.arange(3, device=d), torch.arange(3, device=d)),
    "frac-int64": lambda d: torch.frac(torch.arange(3, device=d)),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_dtypes_cpu_refuses_are_refused_with_cpus_error(case):
    fn = _REFUSED[case]
    with pytest.raises((RuntimeError, NotImplementedError)) as cpu:
        fn("cpu")
    with pytest.raises(type(cpu.value)) as neuron:
        fn("neuron")
    assert type(neuron.value) is type(cpu.value)
    assert str(neuron.value).splitlines()[0] == str(cpu.value).splitlines()[0]
    assert "[torchneuron] in aten::" in str(neuron.value)


@pytest.mark.parametrize("fn", [
    lambda d: torch.abs(torch.arange(-3, 3, device=d)),
    lambda d: torch.nn.functional.gelu(torch.linspace(-2, 2, 5, device=d)),
    lambda d: torch.clamp_max(torch.arange(5.0, device=d), torch.full((5,), 2.0, device=d)),
    lambda d: torch.ones(2, 2, device=d) @ torch.ones(2, 2, device=d),
    lambda d: torch.lerp(torch.tensor([0.0, 1.0, 2.0], device=d), torch.ones(3, device=d), 0.5),
    lambda d: torch.sort(torch.tensor([3, 1, 2], device=d)).values,
    lambda d: torch.ones(3, dtype=torch.bool, device=d) & torch.zeros(3, dtype=torch.bool, device=d),
], ids=["abs-int64", "gelu-float", "clamp_max-float", "mm-float", "lerp-float", "sort-int64", "and-bool"])
def test_dtypes_cpu_accepts_still_run(fn):
    torch.testing.assert_close(fn("neuron").cpu(), fn("cpu"))


def test_dtype_refusals_are_checked_once_per_executable(monkeypatch):
    """The check runs when a cache entry is planned, never on a cached call."""
    from torchneuron.ops import cpu_dtypes
    calls = []
    real = cpu_dtypes.check
    monkeypatch.setattr(cpu_dtypes, "check", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    x = torch.arange(7.0, device="neuron")[1:]          # a shape no other test uses
    for _ in range(3):
        torch.nn.functional.hardswish(x)
    assert calls.count("aten::hardswish") == 1


def test_dtype_refusals_table_matches_the_pinned_torch():
    """Regenerate with ``python -m tools.cpu_dtypes`` when torch changes."""
    from torchneuron.ops import cpu_dtypes
    cpu_dtype_refusals = cpu_dtypes.load_table()
    assert cpu_dtype_refusals.torch_version == torch.__version__
    assert len(cpu_dtype_refusals.refusals) > 500


@pytest.mark.slow
def test_dtypes_refused_on_cpu_are_refused_on_neuron_for_every_opinfo():
    """The sweep behind the table (minutes): every OpInfo's first samples in every dtype CPU's
    kernels refuse must be refused on neuron too."""
    import warnings

    from torch.testing._internal.common_dtype import all_types_and_complex_and
    from torch.testing._internal.common_methods_invocations import op_db
    dtypes = set(all_types_and_complex_and(torch.bool, torch.half, torch.bfloat16)) - {torch.float64,
                                                                                        torch.complex128}
    missed = []
    warnings.simplefilter("ignore")
    for op in op_db:
        if op.name.startswith(("sparse", "nn.functional.multi_head")) or "rand" in op.name \
                or op.name in ("uniform", "normal", "bernoulli", "empty", "empty_like"):
            continue
        for dtype in sorted(dtypes - set(op.supported_dtypes("cpu")), key=str):
            try:
                sample = next(iter(op.sample_inputs("cpu", dtype)))
                op(sample.input, *sample.args, **sample.kwargs)
                continue          # CPU runs it after all
            except StopIteration:
                continue
            except Exception as err:  # noqa: BLE001
                if "not implemented for" not in str(err):
                    continue
            s = sample.transform(lambda t: t.to("neuron") if isinstance(t, torch.Tensor) else t)
            try:
                op(s.input, *s.args, **s.kwargs)
                missed.append(f"{op.name}:{dtype}")
            except Exception:  # noqa: BLE001
                pass
    assert not missed, missed


# TestIndexing.test_byte_tensor_assignment: indexing with a uint8 mask warns on CPU (ATen's
# deprecation); neuron was silent.
@pytest.mark.parametrize("how", ["get", "set"])
def test_uint8_mask_indexing_warns_like_cpu(how):
    import warnings

    def run(device):
        x = torch.arange(16.0, device=device).view(4, 4)
        mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "get":
                x = x[mask]
            else:
                x[mask] = torch.tensor([3.0, 4.0, 5.0, 6.0], device=device)
        return x.cpu(), [str(w.message).split(" (Triggered")[0] for w in caught if "uint8" in str(w.message)]

    expected, expected_warnings = run("cpu")
    got, got_warnings = run("neuron")
    torch.testing.assert_close(got, expected)
    assert got_warnings == expected_warnings and len(expected_warnings) == 1


# TestMathBits.test_neg_conj_view_*: a tensor with both the neg and the conj bit lost its sign in
# every kernel that reads lazy math bits (clone, copy_, conversions, mm...): materialising it
# conjugated the stored values and dropped the negation.
_MATH_VIEWS = {"neg-conj": lambda z: torch._neg_view(z).conj(), "conj-neg": lambda z: torch._neg_view(z.conj()),
               "conj": torch.conj, "neg": torch._neg_view}
_MATH_READS = {"resolve_neg": lambda v: v.resolve_neg(), "resolve_conj": lambda v: v.resolve_conj(),
               "clone": torch.clone, "to-bfloat16": lambda v: v.to(torch.bfloat16),
               "copy_": lambda v: torch.empty_like(v).copy_(v), "silu": torch.nn.functional.silu,
               "mm": lambda v: v.reshape(2, 2) @ v.reshape(2, 2), "add": lambda v: v + 1}


@pytest.mark.parametrize("read", list(_MATH_READS))
@pytest.mark.parametrize("view", list(_MATH_VIEWS))
def test_neg_and_conj_views_read_like_cpu(view, read):
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j, 0.25 - 4j], dtype=torch.complex64)
    expected = _MATH_READS[read](_MATH_VIEWS[view](z))
    got = _MATH_READS[read](_MATH_VIEWS[view](z.to("neuron")))
    torch.testing.assert_close(got.cpu().resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg())


# The out= forms of the products read their inputs' lazy bits too: torch.mm(a.conj(), b, out=o)
# wrote a @ b. vdot did not conjugate its first argument at all (it was lowered as dot): the
# OpInfo sweep's samples are real.
_OUT_PRODUCTS = {
    "mm": lambda a, b, c, o: torch.mm(a, b, out=o),
    "matmul": lambda a, b, c, o: torch.matmul(a, b, out=o),
    "addmm": lambda a, b, c, o: torch.addmm(c, a, b, out=o),
    "bmm": lambda a, b, c, o: torch.bmm(a[None], b[None], out=o[None]),
    "baddbmm": lambda a, b, c, o: torch.baddbmm(c[None], a[None], b[None], out=o[None]),
    "dot": lambda a, b, c, o: torch.dot(a[0], b[0], out=o[0, 0]),
    "vdot": lambda a, b, c, o: torch.vdot(a[0], b[0], out=o[0, 0]),
}


@pytest.mark.parametrize("view", ["conj", "neg", "neg-conj"])
@pytest.mark.parametrize("op", list(_OUT_PRODUCTS))
def test_out_products_read_lazy_conj_and_neg_like_cpu(op, view):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(3, 3, dtype=torch.complex64, generator=g) for _ in range(3))

    def run(device):
        o = torch.zeros(3, 3, dtype=torch.complex64, device=device)
        make = _MATH_VIEWS[view]
        _OUT_PRODUCTS[op](make(a.to(device)), b.to(device), make(c.to(device)), o)
        return o.cpu()

    torch.testing.assert_close(run("neuron"), run("cpu"))


def test_vdot_conjugates_its_first_argument_like_cpu():
    a = torch.tensor([1 + 2j, 3 - 1j, -0.5j], dtype=torch.complex64)
    b = torch.tensor([2 - 1j, 0.5 + 1j, 4 + 0j], dtype=torch.complex64)
    torch.testing.assert_close(torch.vdot(a.to("neuron"), b.to("neuron")).cpu(), torch.vdot(a, b))
    graph = torch.compile(torch.vdot, backend="neuron")
    torch.testing.assert_close(graph(a.to("neuron"), b.to("neuron")).cpu(), torch.vdot(a, b))


# TestCompositeCompliance.test_cow_input_*: torch._lazy_clone raised ATen's "Expected storage !=
# nullptr" for any neuron tensor (copy-on-write cannot share a DLPack storage); it now copies.
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset-view"])
def test_lazy_clone_copies_like_cpu(layout):
    base = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), requires_grad=False)

    def make(device):
        x = base.to(device)
        return x.t() if layout == "transposed" else x[1:, 2:] if layout == "offset-view" else x

    for device in ("cpu", "neuron"):
        x = make(device)
        y = torch._lazy_clone(x)
        assert y.shape == x.shape and y.stride() == x.stride()
        torch.testing.assert_close(y.cpu(), make("cpu"))
        y.add_(1)   # the clone is independent: the source keeps its values
        torch.testing.assert_close(x.cpu(), make("cpu"))
    x = base.to("neuron").requires_grad_()
    torch._lazy_clone(x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.ones_like(base))


# TestTorchDeviceType.test_storage: a slice of an UntypedStorage (a storage that starts inside
# another) said the storage "has been freed"; it is not supported, and the error says so.
def test_storage_slice_is_refused_with_a_way_out():
    cpu = torch.arange(15, dtype=torch.int8)
    storage = cpu.to("neuron").untyped_storage()
    assert list(storage.cpu()[2:4]) == list(cpu.untyped_storage()[2:4])
    with pytest.raises(RuntimeError, match=r"slice of another storage .*storage\.cpu\(\)"):
        list(storage[2:3])


# TestTensorCreation.test_logspace: an out= view with as many elements as the result keeps its shape
# and is filled in its element order (ATen resizes only when the element count differs); neuron
# followed PyTorch's Python reference, which resized the view and wrote past it into its base.
@pytest.mark.parametrize("fn", [
    lambda o: torch.linspace(0, 3, 4, out=o),
    lambda o: torch.logspace(0, 3, 4, base=2, out=o),
    lambda o: torch.arange(4, out=o),
    lambda o: torch.arange(1, 5, 1, out=o),
], ids=["linspace", "logspace", "arange", "arange-start"])
def test_factory_out_view_keeps_its_shape_like_cpu(fn):
    cpu = torch.zeros(2, 3)
    neuron = cpu.to("neuron")
    expected = fn(cpu.narrow(1, 1, 2))
    got = fn(neuron.narrow(1, 1, 2))
    assert got.shape == expected.shape
    torch.testing.assert_close(neuron.cpu(), cpu)


# resize_ growing a non-contiguous view read it with view(-1) (which fails) and kept only its
# elements; PyTorch keeps the whole old storage as the new one's prefix.
def test_resize_grows_a_strided_view_like_cpu():
    cpu = torch.arange(6.0).reshape(2, 3).narrow(1, 1, 2)
    neuron = torch.arange(6.0).reshape(2, 3).to("neuron").narrow(1, 1, 2)
    cpu.resize_(7)
    neuron.resize_(7)
    torch.testing.assert_close(neuron[:5].cpu(), cpu[:5])


# TestConvolutionNNDeviceType.test_conv_backend_empty_*: an input without channels makes a result
# without channels on CPU (ATen's empty backend); the lowering gave the weight's channels and failed.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 0, 7, 8, 9), (0, 0, 7, 8, 9), (2, 0, 7, 8)])
def test_convolution_without_input_channels_like_cpu(shape, bias):
    k = len(shape) - 2
    x = torch.randn(shape)
    w = torch.randn((12, 0) + (3,) * k)
    args = ([1] * k, [0] * k, [1] * k, False, [0] * k, 3)
    bias = torch.randn(12) if bias else None
    expected = torch.ops.aten.convolution(x, w, bias, *args)
    got = torch.ops.aten.convolution(x.to("neuron"), w.to("neuron"),
                                     None if bias is None else bias.to("neuron"), *args)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("shape", [(2, 0, 7, 8, 9), (0, 0, 7, 8)])
def test_convolution_backward_without_input_channels_like_cpu(shape):
    k = len(shape) - 2
    grads = []
    for device in ("cpu", "neuron"):
        x = torch.randn(shape, device=device, requires_grad=True)
        w = torch.ones((12, 0) + (3,) * k, device=device, requires_grad=True)
        b = torch.ones(12, device=device, requires_grad=True)
        out = torch.ops.aten.convolution(x, w, b, [1] * k, [0] * k, [1] * k, False, [0] * k, 3)
        out.sum().backward()
        grads.append([t.grad for t in (x, w, b)])
    for expected, got in zip(*grads):
        assert (expected is None) == (got is None)
        if expected is not None:
            torch.testing.assert_close(got.cpu(), expected)


# TestLinalg.test_cholesky_inverse_errors_and_warnings: PyTorch's meta kernel raises AssertionError
# for a check ATen's kernel makes with TORCH_CHECK (a RuntimeError on CPU).
def test_meta_kernel_assertions_are_runtime_errors_like_cpu():
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        torch.cholesky_inverse(torch.randn(3))
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        torch.cholesky_inverse(torch.randn(3, device="neuron"))


# TestMathBits.test_conj_view_* / test_neg_conj_view_* of in-place ops (triu_, silu_, scatter_add_):
# PyTorch runs an in-place op on a conj/neg view on a resolved copy and writes it back with copy_,
# which stored the values without conjugating/negating them (the view read back conj(result)).
@pytest.mark.parametrize("view", ["conj", "neg", "neg-conj"])
@pytest.mark.parametrize("op", ["triu_", "silu_", "add_", "copy_", "copy_-from-cpu"])
def test_inplace_ops_on_math_bit_views_like_cpu(view, op):
    def make(t):
        if view == "conj":
            return t.conj()
        return torch._neg_view(t.conj() if view == "neg-conj" else t)

    ops = {"triu_": lambda t: t.triu_(), "silu_": lambda t: torch.nn.functional.silu(t, inplace=True),
           "add_": lambda t: t.add_(1 + 2j),
           "copy_": lambda t: t.copy_(torch.full((4, 4), 1 + 2j, device=t.device)),
           "copy_-from-cpu": lambda t: t.copy_(torch.full((4, 4), 1 + 2j))}
    x = torch.randn(4, 4, dtype=torch.complex64)
    cpu, neuron = make(x.clone()), make(x.to("neuron"))
    ops[op](cpu)
    ops[op](neuron)
    assert (neuron.is_conj(), neuron.is_neg()) == (cpu.is_conj(), cpu.is_neg())
    torch.testing.assert_close(neuron.cpu().resolve_conj().resolve_neg(), cpu.resolve_conj().resolve_neg())


# test_tensor_creation_ops: random_/uniform_ ranges were not checked (from >= to drew `from`,
# to - 1 beyond a dtype's range drew inf), and normal(mean, std) accepted a negative std tensor.
@pytest.mark.parametrize("case", [
    lambda d: torch.empty(8, device=d).random_(5, 3),
    lambda d: torch.empty(8, device=d).random_(0),
    lambda d: torch.empty(8, dtype=torch.float16, device=d).random_(0, 2 ** 20),
    lambda d: torch.empty(8, dtype=torch.int8, device=d).random_(-200, 0),
    lambda d: torch.empty(8, dtype=torch.bool, device=d).random_(0, 3),
    lambda d: torch.empty(8, device=d).uniform_(1, 0),
    lambda d: torch.empty(8, device=d).uniform_(-3e38, 3e38),
    lambda d: torch.normal(torch.zeros(3, device=d), torch.tensor([1.0, -1.0, 1.0], device=d)),
    lambda d: torch.normal(0.0, torch.tensor([1.0, -1.0], device=d)),
], ids=["from-ge-to", "to-zero", "to-beyond-half", "from-beyond-int8", "to-beyond-bool",
        "uniform-reversed", "uniform-span-overflow", "normal-negative-std", "normal-float-mean"])
def test_random_ranges_rejected_as_on_cpu(case):
    expected = _error(case, "cpu")
    assert expected is not None
    assert _error(case, "neuron") == expected


def test_random_float_range_warns_as_on_cpu():
    with pytest.warns(UserWarning, match="to - 1 is out of bounds"):
        torch.empty(4, device="neuron").random_(0, 2 ** 30)


@pytest.mark.parametrize("dtype, from_, to", [
    (torch.bool, 0, None), (torch.int64, -2 ** 63, None), (torch.int64, -42, None),
    (torch.int8, -128, None), (torch.uint8, 0, 256), (torch.float16, 0, None), (torch.float32, -5, 3),
])
def test_random_draws_cover_the_range_of_each_dtype(dtype, from_, to):
    # bool and int64's full 64-bit range used to fail to compile; int64's range was cut at 2^62.
    t = torch.empty(4000, dtype=dtype, device="neuron")
    t.random_(from_, to) if (from_, to) != (0, None) else t.random_()
    got = t.cpu().to(torch.float64)
    if to is None:
        hi = {torch.bool: 1, torch.float16: 2 ** 11}.get(dtype) or torch.iinfo(dtype).max
    else:
        hi = to - 1
    assert got.min() >= from_ and got.max() <= hi
    span = hi - from_
    assert got.min() < from_ + 0.1 * span + 1 and got.max() > hi - 0.1 * span - 1


def test_random_without_arguments_is_uniform_over_booleans():
    t = torch.empty(4000, dtype=torch.bool, device="neuron").random_().cpu()
    assert 0.4 < t.float().mean() < 0.6


# linspace/logspace out= computed in float and then cast (CPU converts the ends to an integer
# out's dtype first); steps=1 with a complex start failed to compile; torch.range ran on CPU.
@pytest.mark.parametrize("case", [
    lambda d: torch.linspace(0.3, 1.9, 9, out=torch.empty(0, dtype=torch.int16, device=d)),
    lambda d: torch.logspace(0.3, 1.9, 5, out=torch.empty(0, dtype=torch.int32, device=d)),
    lambda d: torch.linspace(1 + 1j, 2 + 3j, 1, device=d),
    lambda d: torch.range(1, 2, 0.3, device=d),
    lambda d: torch.range(5, 1, -2, dtype=torch.int32, device=d),
    lambda d: torch.arange(6, out=torch.empty(2, 3, device=d)),
], ids=["linspace-int-out", "logspace-int-out", "linspace-complex-one-step",
        "range", "range-int-descending", "arange-out-keeps-shape"])
def test_factories_match_cpu(case):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, got = case("cpu"), case("neuron").cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_linspace_out_matches_linspace():
    got = torch.linspace(0.3, 1.9, 137, out=torch.empty(0, device="neuron"))
    torch.testing.assert_close(got, torch.linspace(0.3, 1.9, 137, device="neuron"), atol=0, rtol=0)
    torch.testing.assert_close(got.cpu(), torch.linspace(0.3, 1.9, 137))


def test_range_runs_on_neuron_without_fallback():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.range(0, 3, device="neuron")
    assert [str(w.message)[:24] for w in caught] == ["torch.range is deprecate"]


def test_arange_out_resize_warns_with_arange_text():
    with pytest.warns(UserWarning, match="The number of elements in the out tensor of shape"):
        out = torch.arange(5, out=torch.empty(2, 3, device="neuron"))
    assert out.shape == (5,)


@pytest.mark.parametrize("case", [
    lambda d: torch.ones(2, device=d).new_empty_strided((2,), ()),
    lambda d: torch.empty_strided((2, 3), (1,), device=d),
    lambda d: torch.repeat_interleave(torch.arange(4, device=d).reshape(2, 2)),
    lambda d: torch.repeat_interleave(torch.tensor([1, 2, -1, 3], device=d)),
], ids=["new_empty_strided-dims", "empty_strided-dims", "repeat_interleave-2d", "repeat_interleave-negative"])
def test_factory_argument_errors_as_on_cpu(case):
    expected = _error(case, "cpu")
    assert expected is not None
    assert _error(case, "neuron") == expected


def test_repeat_interleave_float_repeats_raise():
    with pytest.raises(RuntimeError):
        torch.repeat_interleave(torch.arange(4.0, device="neuron"))


# test_type_promotion.test_alpha_mismatch: add/sub with a float alpha on integer tensors computed
# a truncated product where CPU raises.
@pytest.mark.parametrize("case", [
    lambda d: torch.add(torch.ones(2, dtype=torch.int64, device=d), torch.ones(2, dtype=torch.int64, device=d),
                        alpha=1.1),
    lambda d: torch.ones(2, dtype=torch.int32, device=d).sub_(1, alpha=0.5),
    lambda d: torch.add(torch.ones(2, device=d), torch.ones(2, device=d), alpha=1j),
], ids=["int-float-alpha", "int-sub_-float-alpha", "float-complex-alpha"])
def test_alpha_type_rejected_as_on_cpu(case):
    expected = _error(case, "cpu")
    assert expected is not None
    assert _error(case, "neuron") == expected


def test_alpha_of_matching_kind_still_scales():
    got = torch.add(torch.ones(2, dtype=torch.int32, device="neuron"), 3, alpha=2).cpu()
    assert got.tolist() == [7, 7] and got.dtype == torch.int32


# TestCommon.test_out_cholesky: linear-algebra out= tensors skipped the cast check (CPU does not
# replay these ops, and "no verdict" was taken as "allowed"), so a long out received a float result.
@pytest.mark.parametrize("op", [torch.linalg.cholesky, torch.linalg.inv])
def test_linalg_out_refuses_an_unsafe_cast(op):
    a = torch.eye(3, device="neuron")
    with pytest.raises(RuntimeError, match="can't be cast"):
        op(a, out=torch.empty(0, dtype=torch.int64, device="neuron"))
    out = torch.empty(0, device="neuron")
    op(a, out=out)
    torch.testing.assert_close(out.cpu(), op(torch.eye(3)))


# test_nn: hardswish's gradient at exactly +-3 used the wrong side of each boundary; hardshrink
# turned NaN into 0; the backward of an in-place leaky_relu with a negative slope ran where ATen
# refuses it.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hardswish_gradient_at_the_corners(dtype):
    for device in ("cpu", "neuron"):
        x = torch.tensor([-3.0, 3.0, -2.9, 2.9], dtype=dtype, device=device, requires_grad=True)
        torch.nn.functional.hardswish(x).sum().backward()
        if device == "cpu":
            expected = x.grad
    torch.testing.assert_close(x.grad.cpu(), expected)


def test_hardshrink_propagates_nan():
    got = torch.nn.functional.hardshrink(torch.tensor([float("nan"), 0.3, -0.7], device="neuron")).cpu()
    assert got[0].isnan() and got[1:].tolist() == [0.0, pytest.approx(-0.7)]


@pytest.mark.parametrize("inplace_op", [
    lambda t: torch.nn.functional.leaky_relu_(t, -2),
    lambda t: torch.nn.functional.rrelu_(t, -5.0, 1.0),
    # TestNNDeviceType.test_elu_inplace_with_neg_alpha: elu_backward refuses it the same way.
    lambda t: torch.nn.functional.elu_(t, alpha=-2),
    lambda t: torch.nn.functional.celu_(t, alpha=-2),
], ids=["leaky_relu_", "rrelu_", "elu_", "celu_"])
def test_inplace_leaky_relu_with_negative_slope_refuses_backward(inplace_op):
    a = torch.tensor([-1.0, 1.0], device="neuron", requires_grad=True)
    b = inplace_op(a.clone())
    with pytest.raises(RuntimeError, match="call out-of-place version"):
        b.backward(torch.ones(2, device="neuron"))
    a = torch.tensor([-2.0, 0.0, 2.0], device="neuron", requires_grad=True)
    torch.nn.functional.leaky_relu_(a.clone(), 0.0).sum().backward()
    assert a.grad.cpu().tolist() == [0.0, 0.0, 1.0]


# test_torch.test_deterministic_empty: with deterministic algorithms, torch.empty and friends fill
# new memory with NaN / the dtype's largest value (ATen's fill_uninitialized_memory); neuron's
# empty kernels returned zeros.
@pytest.mark.parametrize("make", [
    lambda d, dt: torch.empty(10, 9, device=d, dtype=dt),
    lambda d, dt: torch.empty_like(torch.zeros(10, 9, device=d, dtype=dt)),
    lambda d, dt: torch.empty_strided((10, 9), (1, 5), device=d, dtype=dt),
    lambda d, dt: torch.empty_permuted((2, 3, 5), (1, 0, 2), device=d, dtype=dt),
], ids=["empty", "empty_like", "empty_strided", "empty_permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int64, torch.bool])
def test_deterministic_empty_fills_like_cpu(make, dtype):
    from torch.testing._internal.common_utils import DeterministicGuard
    with DeterministicGuard(True):
        got, expected = make("neuron", dtype).cpu(), make("cpu", dtype)
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_deterministic_resize_fills_the_grown_part_like_cpu():
    from torch.testing._internal.common_utils import DeterministicGuard
    with DeterministicGuard(True):
        for dtype in (torch.float32, torch.int32):
            got = torch.ones(3, dtype=dtype, device="neuron").resize_(2, 3).cpu()
            expected = torch.ones(3, dtype=dtype).resize_(2, 3)
            torch.testing.assert_close(got, expected, equal_nan=True)


def test_masked_select_refuses_a_uint8_mask_like_cpu():
    src, mask = torch.arange(5), torch.tensor([1, 0, 1, 0, 1], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="expected BoolTensor for mask"):
        src.to("neuron").masked_select(mask.to("neuron"))
    assert src.to("neuron").masked_select(mask.bool().to("neuron")).cpu().tolist() == [0, 2, 4]


def test_inplace_elu_with_positive_alpha_backward_matches_cpu():
    grads = []
    for device in ("cpu", "neuron"):
        a = torch.tensor([-1.0, 0.5, 2.0], device=device, requires_grad=True)
        torch.nn.functional.elu_(a.clone(), alpha=0.7).sum().backward()
        grads.append(a.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


# TestNNDeviceType.test_nll_loss_byte_target_matches_long: CPU's nll_loss accepts uint8 class
# targets; PyTorch's meta kernel (a gather) refuses them, and neuron raised its error.
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss_accepts_uint8_target_as_cpu_does(reduction):
    results = []
    for device in ("cpu", "neuron"):
        x = torch.linspace(-2, 2, 40).reshape(10, 4).to(device).requires_grad_()
        target = torch.tensor([0, 3, 2, 1, 1, 0, 3, 2, 2, 1], dtype=torch.uint8, device=device)
        loss = torch.nn.functional.nll_loss(torch.log_softmax(x, -1), target, reduction=reduction)
        loss.sum().backward()
        results.append((loss.detach().cpu(), x.grad.cpu()))
    torch.testing.assert_close(results[1], results[0])


# TestNNDeviceType.test_CTCLoss_empty_target: with every target empty the extended target is one
# blank wide, and the CTC lowering's shifts by two (the s-2 transition) failed to compile.
@pytest.mark.parametrize("target_lengths", [[0, 0, 0], [0, 4, 0], [3, 5, 2]])
def test_ctc_loss_with_empty_targets_matches_cpu(target_lengths):
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.randn(12, 3, 6, generator=gen).log_softmax(2)
    targets = torch.randint(1, 6, (sum(target_lengths),), generator=gen)
    results = []
    for device in ("cpu", "neuron"):
        x = log_probs.to(device).detach().requires_grad_()
        loss = torch.nn.functional.ctc_loss(x, targets.to(device), [12, 10, 12], target_lengths, reduction="none")
        loss.sum().backward()
        results.append((loss.detach().cpu(), x.grad.cpu()))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-4)


def _singular_batch(device):
    a = torch.eye(3).repeat(5, 1, 1)
    a[3, -2, -2] = 0
    return a.to(device)


# TestLinalg.test_inv_ex_singular: the linalg *_ex ops ignored check_errors=True on neuron (info
# was right, nothing raised); ATen raises its LinAlgError (RuntimeError for lu_factor_ex).
@pytest.mark.parametrize("case", [
    lambda d: torch.linalg.inv_ex(_singular_batch(d)[3], check_errors=True),
    lambda d: torch.linalg.inv_ex(_singular_batch(d), check_errors=True),
    lambda d: torch.linalg.inv_ex(_singular_batch(d), check_errors=True,
                                  out=(torch.empty(0, device=d), torch.empty(0, dtype=torch.int32, device=d))),
    lambda d: torch.linalg.cholesky_ex(_singular_batch(d), check_errors=True),
    lambda d: torch.linalg.lu_factor_ex(_singular_batch(d), check_errors=True),
    lambda d: torch.linalg.solve_ex(_singular_batch(d), torch.ones(5, 3, device=d), check_errors=True),
], ids=["inv_ex", "inv_ex-batched", "inv_ex-out", "cholesky_ex", "lu_factor_ex", "solve_ex"])
def test_linalg_ex_check_errors_raises_as_cpu(case):
    errors = []
    for device in ("cpu", "neuron"):
        with pytest.raises(RuntimeError) as info:
            case(device)
        errors.append((type(info.value), str(info.value).splitlines()[0]))
    assert errors[1] == errors[0]


def test_linalg_ex_check_errors_on_invertible_input_returns_zero_info():
    a = torch.eye(3).repeat(2, 1, 1) * 2
    got = torch.linalg.inv_ex(a.to("neuron"), check_errors=True)
    torch.testing.assert_close(got.inverse.cpu(), torch.linalg.inv(a))
    assert got.info.cpu().tolist() == [0, 0]


# TestLinalg.test_cholesky_errors_and_warnings: XLA fills a failed Cholesky factor with NaN, and
# neuron's info named its first NaN (always order 1) where LAPACK names the first leading minor
# that is not positive-definite.
def test_cholesky_info_names_the_first_failing_leading_minor():
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(3, 5, 5, generator=gen)
    a = b @ b.mT + torch.eye(5)
    a[0, 3, 3] = -20.0       # order 4
    a[2, 1, 1] = 0.0         # order 2 (or earlier if the Schur complement says so)
    c = torch.randn(5, 5, dtype=torch.complex64, generator=gen)
    c = c @ c.mH + torch.eye(5)
    c[2, 2] = -1.0
    for m in (a, c):
        for upper in (False, True):
            expected = torch.linalg.cholesky_ex(m, upper=upper).info
            got = torch.linalg.cholesky_ex(m.to("neuron"), upper=upper).info.cpu()
            assert got.tolist() == expected.tolist()
    assert torch.linalg.cholesky_ex(a).info.tolist()[1] == 0


# TestTorchDeviceType.test_index_fill_mem_overlap and its kin: an index op writing a tensor that is
# also its index (or source) ran on neuron, where CPU refuses it; elementwise ops on the very same
# view (x.add_(x)) stay accepted, as on CPU.
_ALIASED_WRITES = {
    "index_fill_": lambda d: (lambda i: i.index_fill_(0, i, 0))(torch.tensor([0, 1, 2], device=d)),
    "index_copy_": lambda d: (lambda i: i.index_copy_(0, i, torch.tensor([5, 6, 7], device=d)))(
        torch.tensor([0, 1, 2], device=d)),
    "index_add_": lambda d: (lambda i: i.index_add_(0, i, torch.tensor([5, 6, 7], device=d)))(
        torch.tensor([0, 1, 2], device=d)),
    "scatter_": lambda d: (lambda i: i.scatter_(0, i, 1))(torch.tensor([0, 1, 2], device=d)),
    "put_": lambda d: (lambda i: i.put_(i, torch.tensor([5, 6, 7], device=d)))(torch.tensor([0, 1, 2], device=d)),
    "index_put_": lambda d: (lambda i: i.index_put_((i,), torch.tensor([5, 6, 7], device=d)))(
        torch.tensor([0, 1, 2], device=d)),
    "index_put_ values a view of self": lambda d: (lambda x: x.index_put_((torch.tensor([0, 1], device=d),), x[1:3]))(
        torch.arange(4.0, device=d)),
}


@pytest.mark.parametrize("name", list(_ALIASED_WRITES))
def test_index_ops_refuse_writing_their_own_index_or_source_like_cpu(name):
    case = _ALIASED_WRITES[name]
    expected = _error(case, "cpu")
    assert expected is not None and expected.startswith("unsupported operation")
    assert _error(case, "neuron") == expected


@pytest.mark.parametrize("op", ["add_", "mul_", "copy_"])
def test_elementwise_ops_on_the_very_same_view_still_run(op):
    x = torch.arange(1.0, 4.0)
    n = x.to("neuron")
    getattr(x, op)(x)
    getattr(n, op)(n)
    assert torch.equal(n.cpu(), x)


# TestTorchDeviceType.test_copy_mem_overlap: views of one storage have their offsets as runtime
# inputs, so x[0:9].copy_(x[9:18]) and x[0:9].copy_(x[1:10]) share an executable; the overlap
# check ran only for the first call of the key and let the overlapping one through.
@pytest.mark.parametrize("mode", ["plain", "adaptive"])
def test_overlap_is_checked_per_call_for_views_of_one_storage(mode):
    import torchneuron

    def calls(device):
        d = torch.arange(18.0, device=device)
        outcome = []
        for _ in range(3):
            for dst, src in ((slice(0, 9), slice(9, 18)), (slice(0, 9), slice(1, 10))):
                try:
                    d[dst].copy_(d[src])
                    outcome.append("ok")
                except RuntimeError as err:
                    outcome.append(str(err).splitlines()[0])
        return outcome, d.cpu()

    with torchneuron.eager_mode(mode):
        got, got_data = calls("neuron")
    expected, expected_data = calls("cpu")
    assert got == expected and "ok" in got and any(o.startswith("unsupported operation") for o in got)
    assert torch.equal(got_data, expected_data)


# TestTorchDeviceType.test_shift_mem_overlap: an in-place op without a lowering (decomposed, or run
# on CPU) works on copies of its arguments, where their aliasing is gone: neuron raised the
# decomposed op's dtype error where CPU raises the overlap first.
def test_unlowered_in_place_op_on_overlapping_views_raises_cpus_overlap_error():
    def case(device):
        x = torch.rand(3, device=device)
        x[:-1] <<= x[1:]

    expected = _error(case, "cpu")
    assert expected is not None and expected.startswith("unsupported operation")
    assert _error(case, "neuron") == expected


def test_unlowered_in_place_op_on_disjoint_views_of_one_storage_runs():
    x = torch.arange(6)
    n = x.to("neuron")
    x[:3] <<= x[3:]
    n[:3] <<= n[3:]
    assert torch.equal(n.cpu(), x)


# TestTorchDeviceType.test_scalar_check: ATen counts a 0-dim index as 1-dim, so gather/scatter of a
# 1-dim tensor take one; neuron failed to compile them.
@pytest.mark.parametrize("case", [
    lambda d: torch.gather(torch.tensor([1.0, 2.0], device=d), 0, torch.tensor(1, device=d)),
    lambda d: torch.tensor([1.0, 2.0], device=d).scatter_(0, torch.tensor(1, device=d), 5.0),
    lambda d: torch.tensor([1.0, 2.0], device=d).scatter_(0, torch.tensor(1, device=d), torch.tensor([7.0, 8.0], device=d)),
    lambda d: torch.tensor([1.0, 2.0], device=d).scatter_add_(0, torch.tensor(1, device=d), torch.tensor(5.0, device=d)),
    lambda d: torch.tensor([1.0, 2.0], device=d).scatter_reduce_(0, torch.tensor(0, device=d), torch.tensor(5.0, device=d),
                                                                "amax"),
    lambda d: torch.tensor([1.0, 2.0], device=d).scatter_(0, torch.tensor(1, device=d), torch.tensor(3.0, device=d),
                                                          reduce="multiply"),
], ids=["gather", "scatter-value", "scatter-src", "scatter_add", "scatter_reduce", "scatter-multiply"])
def test_gather_and_scatter_take_a_0_dim_index_of_a_1_dim_tensor(case):
    expected, got = case("cpu"), case("neuron")
    assert got.shape == expected.shape and torch.equal(got.cpu(), expected)


# TestTorchDeviceType.test_is_set_to: t.set_(source) ran on CPU, so t got a copy instead of
# source's storage (writes through one missed the other) and is_set_to compared host copies;
# t.set_() tried to give a neuron tensor a CPU storage.
def test_set_to_a_tensor_shares_its_storage_and_is_set_to_follows_aten():
    def run(device):
        a = torch.arange(6.0, device=device)
        c = torch.empty(0, device=device).set_(a)
        c[1] = 7.0
        t1, t2 = torch.empty(3, 4, device=device), torch.empty(3, 4, device=device)
        t3 = torch.tensor([], device=device).set_(t1)
        t4 = t3.clone().resize_(4, 3)
        e1 = torch.empty([2, 5, 0], device=device)
        flags = [t1.is_set_to(t2), t1.is_set_to(t3), t3.is_set_to(t1), t1.is_set_to(t4),
                 torch.tensor([], device=device).is_set_to(torch.tensor([], device=device)),
                 e1.is_set_to(e1.view([0])), t1.is_set_to(t1.view(4, 3))]
        b = torch.ones(3, device=device).set_()
        return a.cpu(), flags, (tuple(b.shape), b.device.type, b.untyped_storage().nbytes())

    got, expected = run("neuron"), run("cpu")
    assert torch.equal(got[0], expected[0]) and got[0][1] == 7.0
    assert got[1] == expected[1] == [False, True, True, False, False, False, False]
    assert got[2] == ((0,), "neuron", 0) and expected[2] == ((0,), "cpu", 0)


def test_set_to_a_tensor_of_another_dtype_raises_atens_error():
    def case(device):
        torch.empty(0, device=device).set_(torch.zeros(2, dtype=torch.int64, device=device))

    assert _error(case, "neuron") == _error(case, "cpu") == "Could not set tensor of type long int to a tensor of type float"


# TestTorchDeviceType.test_nondeterministic_alert_put: put/put_ without accumulation alert under
# torch.use_deterministic_algorithms(True) on CPU (and CUDA); neuron ran them silently.
@pytest.mark.parametrize("op", [torch.Tensor.put, torch.Tensor.put_], ids=["put", "put_"])
def test_put_alerts_under_deterministic_algorithms_like_cpu(op):
    def case(device):
        a = torch.randn(10, device=device)
        op(a, torch.tensor([0, 0], device=device), torch.tensor([0.0, 1.0], device=device), accumulate=False)

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        expected = _error(case, "cpu")
        assert expected is not None and "does not have a deterministic implementation" in expected
        assert _error(case, "neuron") == expected
        a = torch.zeros(3, device="neuron")
        op(a, torch.tensor([0, 0], device="neuron"), torch.tensor([1.0, 2.0], device="neuron"), accumulate=True)
    finally:
        torch.use_deterministic_algorithms(before)


# _native_batch_norm_legit.no_stats in eval mode has no running stats to use: CPU's kernel
# segfaults, and the CPU replay that judges refused calls crashed the process with it. The meta
# kernel's reason is the error now; training mode (batch statistics) matches CPU.
def test_batch_norm_without_stats_in_eval_mode_is_an_error_not_a_crash():
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    op = torch.ops.aten._native_batch_norm_legit.no_stats
    with pytest.raises(RuntimeError, match="running_mean and running_var must not be None in eval mode"):
        op(x.to("neuron"), torch.ones(3, device="neuron"), None, False, 0.1, 1e-5)
    got = op(x.to("neuron"), None, None, True, 0.1, 1e-5)
    for g, e in zip(got, op(x, None, None, True, 0.1, 1e-5)):
        torch.testing.assert_close(g.cpu(), e)
