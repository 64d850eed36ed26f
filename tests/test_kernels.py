"""Custom kernels (torchneuron.kernel): JAX functions as PyTorch custom ops on neuron and CPU.

CPU PyTorch is the oracle: each kernel is checked against the same computation written with
PyTorch ops, on CPU tensors (the host path) and on neuron tensors (the eager executable path).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl
from torch._library.custom_ops import CustomOpDef

import torchneuron
from torchneuron.eager import kernel as kernel_module
from torchneuron.kernels import KernelError

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ("cpu", "neuron")


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = sys.modules.get(name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


# -- kernels used below -----------------------------------------------------------------------------
@torchneuron.kernel("tn_test::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, s: torch.types.Number) -> None:
    return x * s


@torchneuron.kernel("tn_test::add_into", mutates_args=("acc",))
def add_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    new = acc + x
    return new, new.sum()          # the new value of acc, then the declared result


@torchneuron.kernel("tn_test::moments")
def moments(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(dim)
    return mean, ((x - jnp.expand_dims(mean, dim)) ** 2).mean(dim)


@torchneuron.kernel("tn_test::chunks")
def chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(jnp.split(x, n))


@torchneuron.kernel("tn_test::affine")
def affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           alpha: torch.types.Number = 1.0, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = alpha * (x @ weight)
    if bias is not None:
        y = y + bias
    return y if out_dtype is None else y.astype(out_dtype)


@torchneuron.kernel("tn_test::scaled")
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@torchneuron.kernel("tn_test::ste_round", backward=lambda x, grad: (grad,))
def ste_round(x: torch.Tensor) -> torch.Tensor:
    # Straight-through estimator: jax.vjp would give zero gradients; backward= passes them through.
    return jnp.round(x)


@torchneuron.kernel("tn_test::iota")
def iota(n: int, device: torch.device, step: torch.types.Number = 1) -> torch.Tensor:
    return jnp.arange(n, dtype=jnp.float32) * step


def _square_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...] + 1.0


@torchneuron.kernel("tn_test::pallas_square")
def pallas_square(x: torch.Tensor) -> torch.Tensor:
    return pl.pallas_call(_square_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _rms_ref(x, w, eps=1e-6):
    return _example("kernel_rms_norm").reference(x, w, eps)


def _leaf(t, device):
    return t.detach().to(device).requires_grad_()


# -- the op itself ----------------------------------------------------------------------------------
def test_schema_is_what_custom_op_infers_and_the_op_is_real():
    rms = _example("kernel_rms_norm").rms_norm
    assert isinstance(rms, CustomOpDef)
    assert rms._schema == torch.library.infer_schema(rms.jax_fn, mutates_args=())
    assert str(torch.ops.examples.rms_norm.default._schema) == \
        "examples::rms_norm(Tensor x, Tensor weight, float eps=9.9999999999999995e-07) -> Tensor"
    assert str(torch.ops.tn_test.scale_.default._schema) == "tn_test::scale_(Tensor(a0!) x, Scalar s) -> ()"
    assert str(torch.ops.tn_test.affine.default._schema) == (
        "tn_test::affine(Tensor x, Tensor weight, Tensor? bias=None, Scalar alpha=1., *, "
        "ScalarType? out_dtype=None) -> Tensor")
    x = torch.randn(3, 8)
    w = torch.randn(8)
    torch.testing.assert_close(torch.ops.examples.rms_norm(x, w), rms(x, w))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """PyTorch's own custom-op checks: schema, fake kernel vs real kernel, autograd registration,
    AOT dispatch (torch.compile's tracing) -- on both devices."""
    rms = _example("kernel_rms_norm").rms_norm
    # autograd_registration_check only knows CPU/CUDA/XPU devices.
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic") if device == "neuron" else None
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    kw = {} if utils is None else {"test_utils": utils}
    cases = [(rms, (x, w)), (scale_, (x.detach().clone(), 2.0))]
    if device == "cpu":     # the same machinery on both devices: the rest once is enough
        cases += [(moments, (x,)), (affine, (x, torch.randn(8, 3), torch.randn(3), 0.5))]
    for op, args in cases:
        result = torch.library.opcheck(op, args, **kw)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_values_and_gradients_match_pytorch(device):
    rms = _example("kernel_rms_norm").rms_norm
    torch.manual_seed(0)
    x, w = torch.randn(4, 16, 32), torch.randn(32)
    xd, wd = _leaf(x, device), _leaf(w, device)
    out = rms(xd, wd, 1e-5)
    assert out.device.type == device
    (out * out).sum().backward()
    xr, wr = _leaf(x, "cpu"), _leaf(w, "cpu")
    ref = _rms_ref(xr, wr, 1e-5)
    (ref * ref).sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wd.grad.cpu(), wr.grad, rtol=1e-4, atol=1e-3)
    # bfloat16 activations: statistics in float32, result in bfloat16, as the reference.
    xb = x.to(torch.bfloat16)
    got = rms(xb.to(device), w.to(device))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), _rms_ref(xb, w), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_only_for_inputs_that_need_them(device):
    x, w, b = torch.randn(5, 4), torch.randn(4, 3), torch.randn(3)
    wd = _leaf(w, device)
    out = affine(x.to(device), wd, b.to(device), 2.0)
    out.sum().backward()
    wr = _leaf(w, "cpu")
    (2.0 * (x @ wr) + b).sum().backward()
    torch.testing.assert_close(wd.grad.cpu(), wr.grad)
    # dtype arguments reach the body as JAX dtypes; Optional tensors as None.
    half = affine(x.to(device), w.to(device), out_dtype=torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.cpu(), (x @ w).half(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_function_is_used(device):
    x = torch.tensor([0.2, 1.7, -2.6])
    xd = _leaf(x, device)
    y = ste_round(xd)
    (y * torch.tensor([1.0, 2.0, 3.0], device=device)).sum().backward()
    assert y.cpu().tolist() == [0.0, 2.0, -3.0]
    assert xd.grad.cpu().tolist() == [1.0, 2.0, 3.0]     # jax.vjp of round would give zeros


@pytest.mark.parametrize("device", DEVICES)
def test_mutating_kernel_updates_in_place(device):
    x = torch.arange(6.0, device=device).reshape(2, 3)
    version = x._version
    scale_(x, 2.0)
    scale_(x[1], 10)               # a view: the write lands in the base's storage
    assert x.cpu().tolist() == [[0.0, 2.0, 4.0], [60.0, 80.0, 100.0]]
    assert x._version == version + 2            # one bump per call, as for any in-place op
    acc = torch.zeros(3, device=device)
    total = add_into(acc, torch.ones(3, device=device))
    total = add_into(acc, torch.ones(3, device=device))
    assert acc.cpu().tolist() == [2.0, 2.0, 2.0] and total.item() == 6.0


@pytest.mark.parametrize("device", DEVICES)
def test_multiple_and_list_outputs(device):
    x = torch.randn(4, 6)
    mean, var = moments(x.to(device), 0)
    torch.testing.assert_close(mean.cpu(), x.mean(0))
    torch.testing.assert_close(var.cpu(), x.var(0, unbiased=False))
    parts = chunks(x.reshape(-1).to(device), 3)
    assert isinstance(parts, list) and len(parts) == 3
    for got, want in zip(parts, x.reshape(-1).chunk(3)):
        torch.testing.assert_close(got.cpu(), want)
    # gradients through one of several outputs
    xd = _leaf(x, device)
    moments(xd, 1)[1].sum().backward()
    xr = _leaf(x, "cpu")
    xr.var(1, unbiased=False).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_without_tensor_arguments_runs_on_its_device_argument(device):
    out = iota(4, torch.device(device), 0.5)
    assert out.device.type == device and out.cpu().tolist() == [0.0, 0.5, 1.0, 1.5]


def test_fake_kernel_from_eval_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 6, dtype=torch.bfloat16, device="neuron")
        mean, var = moments(x, 0)
        parts = chunks(torch.empty(12, device="neuron"), 4)
    assert mean.shape == (6,) and mean.dtype == torch.bfloat16 and mean.device.type == "neuron"
    assert [p.shape for p in parts] == [(3,)] * 4
    meta = torch.ops.tn_test.affine(torch.empty(2, 5, device="meta"), torch.empty(5, 7, device="meta"))
    assert meta.shape == (2, 7) and meta.device.type == "meta"


# -- the executable cache -----------------------------------------------------------------------------
def test_runtime_scalars_compile_once_static_floats_per_value():
    x = torch.randn(8, device="neuron")
    torchneuron.metrics.reset()
    for s in (1.5, 2.5, -3.0):
        y = x.clone()
        scale_(y, s)                                    # Scalar: a runtime input
        torch.testing.assert_close(y.cpu(), x.cpu() * s)
    assert torchneuron.metrics()["custom_kernel_compiles"]["tn_test::scale_"] == 1
    for f in (1.5, 2.5):
        torch.testing.assert_close(scaled(x, f).cpu(), x.cpu() * f)   # float: compiled in
    assert torchneuron.metrics()["custom_kernel_compiles"]["tn_test::scaled"] == 2
    scaled(x, 1.5)
    m = torchneuron.metrics()
    assert m["custom_kernel_compiles"]["tn_test::scaled"] == 2
    assert m["custom_kernel_calls"] == {"tn_test::scale_": 3, "tn_test::scaled": 3}
    assert m["op_calls"]["tn_test::scaled"] == 3     # and counted as eager op calls


def test_cache_keys_are_those_of_builtin_ops(monkeypatch):
    """Same inputs, same executables: a custom kernel compiles exactly as often as a built-in op
    on a sequence of layouts (rows of a matrix, a transposed view, a new shape, a new dtype).
    With static shapes: config.shapes="bucketed" buckets built-in ops, not custom kernels (their
    bodies have no masking rules)."""
    monkeypatch.setattr(torchneuron.config, "shapes", "static")
    base = torch.randn(4, 6, device="neuron")
    inputs = [base[0], base[1], base[2], base.t()[0], base.t(), torch.randn(6, device="neuron"),
              torch.randn(3, device="neuron"), torch.randn(6, device="neuron").half()]
    counts = {}
    kernel_module.clear_cache()        # nothing compiled by earlier tests
    for name, fn in (("builtin", torch.abs), ("kernel", pallas_square)):
        before = torchneuron.metrics()["executables_compiled"]
        for t in inputs:
            fn(t)
        counts[name] = torchneuron.metrics()["executables_compiled"] - before
    assert counts["kernel"] == counts["builtin"] > 1, counts
    for t in inputs:
        torch.testing.assert_close(pallas_square(t).cpu(), t.cpu() * t.cpu() + 1)


# -- Pallas -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_pallas_kernel_runs_in_interpret_mode_on_cpu_platform(device):
    x = torch.randn(8, 128)
    torch.testing.assert_close(pallas_square(x.to(device)).cpu(), x * x + 1)
    # Pallas has no reverse-mode rule: differentiating without backward= says what to do.
    with pytest.raises(KernelError, match=r"(?s)tn_test::pallas_square.*backward="):
        pallas_square(_leaf(x, device)).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_example_matches_sdpa(device):
    fa = _example("kernel_flash_attention")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    scale = 1 / math.sqrt(8)
    qd, kd, vd = (_leaf(t, device) for t in (q, k, v))
    out = fa.flash_attention(qd, kd, vd, scale, 8, 16)
    (out * out).sum().backward()
    qr, kr, vr = (_leaf(t, "cpu") for t in (q, k, v))
    ref = fa.reference(qr, kr, vr, scale)
    (ref * ref).sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    for got, want in ((qd, qr), (kd, kr), (vd, vr)):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)


# -- adaptive eager ---------------------------------------------------------------------------------
def test_adaptive_eager_fuses_the_kernel_into_the_region(monkeypatch):
    from torchneuron.eager import adaptive

    rms = _example("kernel_rms_norm").rms_norm
    x = torch.randn(4, 8)
    w = torch.randn(8)
    xd, wd = x.to("neuron"), _leaf(w, "neuron")
    adaptive.wait_for_compiles()
    adaptive.clear_region_cache()
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)   # compile once repeated
    torchneuron.metrics.reset()
    with torchneuron.eager_mode("adaptive"):
        for i in range(3):
            wd.grad = None
            loss = (rms(xd * 2, wd) + 1).relu().sum()
            loss.backward()
            value = loss.item()
            grad = wd.grad.cpu()
            if i == 1:
                adaptive.wait_for_compiles()   # the region, seen twice, compiled in the background
    m = torchneuron.metrics()
    wr = _leaf(w, "cpu")
    ref = (_rms_ref(x * 2, wr) + 1).relu().sum()
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, wr.grad, rtol=1e-4, atol=1e-4)
    assert m["custom_kernel_calls"] == {"examples::rms_norm": 3, "examples::rms_norm_backward": 3}
    # The kernels were recorded into one region per step (cut where the backward ends). The first
    # two occurrences ran op by op (the kernel's own executable, compiled once), the third inside
    # the region's fused executable: one compile of its own plus one per region containing it.
    assert m["regions_flushed"] == 3 and m["region_compiles"] == 1 and m["region_cache_hits"] == 1
    assert m["custom_kernel_compiles"]["examples::rms_norm"] <= 1 + m["region_compiles"]
    assert m["custom_kernel_compiles"]["examples::rms_norm"] >= m["region_compiles"]


# -- torch.compile ----------------------------------------------------------------------------------
def _compiled_counts():
    from torch._dynamo.utils import counters
    m = torchneuron.metrics()
    return counters["stats"]["unique_graphs"], m["graphs_compiled"], sum(m["graph_breaks"].values())


def test_compile_lowers_kernels_into_the_graph_executable():
    from torch._dynamo.utils import counters
    rms = _example("kernel_rms_norm").rms_norm

    def f(x, w):
        y = rms(x * 2, w).relu()
        mean, var = moments(y)
        return (pallas_square(y.detach()) * mean[:, None]).sum() + var.sum()   # Pallas: no gradient

    torch._dynamo.reset()
    counters.clear()
    x, w = torch.randn(4, 8), torch.randn(8)
    xd, wd = _leaf(x, "neuron"), _leaf(w, "neuron")
    torchneuron.metrics.reset()
    out = torch.compile(f, backend="neuron", fullgraph=True)(xd, wd)
    out.backward()
    # One Dynamo graph, no break; its forward and backward each one neuron executable.
    assert _compiled_counts() == (1, 2, 0)
    m = torchneuron.metrics()
    assert m["custom_kernel_calls"] == {"examples::rms_norm": 1, "tn_test::moments": 1, "tn_test::pallas_square": 1,
                                        "examples::rms_norm_backward": 1, "tn_test::moments_backward": 1}
    assert not any("::" in op for op in m["op_calls"])       # nothing ran as an eager kernel
    assert m["custom_kernel_compiles"]["examples::rms_norm"] == 1
    wr = _leaf(w, "cpu")
    y = _rms_ref(x * 2, wr).relu()
    yd = y.detach()
    ref = ((yd * yd + 1) * y.mean(-1)[:, None]).sum() + y.var(-1, unbiased=False).sum()
    ref.backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(wd.grad.cpu(), wr.grad, rtol=1e-4, atol=1e-4)


def test_compile_functionalizes_mutating_kernels():
    def g(x, y):
        z = y * 2
        scale_(z, 3.0)            # an intermediate
        scale_(x, 2.0)            # a graph input
        scale_(x[1], 5.0)         # a view of a graph input
        total = add_into(z, y)    # mutation and a result
        return z + total

    torch._dynamo.reset()
    compiled = torch.compile(g, backend="neuron", fullgraph=True)
    x, y = torch.randn(3, 4), torch.randn(4)
    xd = x.to("neuron")
    out = compiled(xd, y.to("neuron"))
    expected = g(x, y)         # the same kernels on CPU tensors, eagerly
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(xd.cpu(), x)
    assert torchneuron.metrics()["graphs_compiled"] == 1


def test_compiled_graph_follows_a_re_registered_kernel():
    def define(factor):
        @torchneuron.kernel("tn_test::times")
        def times(x: torch.Tensor) -> torch.Tensor:
            return x * factor
        return times

    define(2.0)
    x = torch.ones(3, device="neuron")
    torch._dynamo.reset()
    assert torch.compile(lambda t: torch.ops.tn_test.times(t) + 1, backend="neuron")(x).cpu().tolist() == [3.0] * 3
    define(5.0)                # the same definition run again (a notebook cell): replaces the kernel
    torch._dynamo.reset()
    assert torch.compile(lambda t: torch.ops.tn_test.times(t) + 1, backend="neuron")(x).cpu().tolist() == [6.0] * 3
    assert torch.ops.tn_test.times(x.cpu()).tolist() == [5.0] * 3


# -- errors -------------------------------------------------------------------------------------------
@torchneuron.kernel("tn_test::bad_mutation", mutates_args=("x",))
def bad_mutation(x: torch.Tensor) -> None:
    return x.sum(0)


@torchneuron.kernel("tn_test::bad_count")
def bad_count(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x


@torchneuron.kernel("tn_test::bad_dtype_update", mutates_args=("x",))
def bad_dtype_update(x: torch.Tensor) -> None:
    return x.astype(jnp.float16)


@torchneuron.kernel("tn_test::untraceable")
def untraceable(x: torch.Tensor) -> torch.Tensor:
    return x if x.sum() > 0 else -x


@torchneuron.kernel("tn_test::needs_static")
def needs_static(x: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    return jnp.tile(x, int(reps))


@torchneuron.kernel("tn_test::torch_in_body")
def torch_in_body(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


@torchneuron.kernel("tn_test::tile")
def tile(x: torch.Tensor, reps: int) -> torch.Tensor:
    return jnp.tile(x, reps)


@torchneuron.kernel("tn_test::bad_backward", backward=lambda x, w, grad: (grad,))
def bad_backward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call, pattern", [
    (lambda d: bad_mutation(torch.ones(2, 3, device=d)),
     r"tn_test::bad_mutation returned float32\[3\] as the new value of 'x', which is float32\[2, 3\]"),
    (lambda d: bad_dtype_update(torch.ones(2, 3, device=d)),
     r"tn_test::bad_dtype_update returned float16\[2, 3\] as the new value of 'x'"),
    (lambda d: bad_count(torch.ones(2, 3, device=d)),
     r"tn_test::bad_count returned an array float32\[2, 3\]; its signature needs 2 values"),
    (lambda d: untraceable(torch.ones(2, 3, device=d)),
     r"(?s)tn_test::untraceable: TracerBoolConversionError .*inputs \(x=float32\[2, 3\]\).*jnp.where"),
    (lambda d: needs_static(torch.ones(3, device=d), torch.tensor(2, device=d)),
     r"(?s)tn_test::needs_static: ConcretizationTypeError.*declared int, float or bool.*Traced arguments "
     r"of this kernel: x, reps"),
    (lambda d: tile(torch.ones(3, device=d), torch.tensor(2)),
     r"tn_test::tile: argument 'reps' is declared int .* but got a tensor int64\[\]@cpu"),
    (lambda d: torch_in_body(torch.ones(2, device=d)),
     r"(?s)tn_test::torch_in_body: TypeError.*receives jax.Array values, not torch tensors"),
    (lambda d: bad_backward(_leaf(torch.ones(2), d), _leaf(torch.ones(2), d)).sum().backward(),
     r"tn_test::bad_backward: backward= returned 1 values; it must return one gradient per argument "
     r"of the kernel \(x, w\)"),
])
def test_bad_kernels_get_clear_errors(device, call, pattern):
    with pytest.raises(KernelError, match=pattern):
        call(device)


def test_registering_a_name_twice_is_an_error():
    def other(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(KernelError, match=r"tn_test::tile is registered twice: first by .*test_kernels.py"):
        torchneuron.kernel("tn_test::tile")(other)
    with pytest.raises(KernelError, match=r"existing operator torch.ops.aten.relu"):
        torchneuron.kernel("aten::relu")(other)
    with pytest.raises(KernelError, match="namespace::op_name"):
        torchneuron.kernel("no_namespace")(other)

    def no_device(n: int) -> torch.Tensor:
        return jnp.zeros(n)

    with pytest.raises(KernelError, match="needs a `device: torch.device` argument"):
        torchneuron.kernel("tn_test::no_device")(no_device)
    # The original is untouched.
    assert tile(torch.ones(2), 2).tolist() == [1.0] * 4


# -- save / load --------------------------------------------------------------------------------------
_LOAD_SCRIPT = """
import sys, torch, torchneuron
saved = torch.load(sys.argv[1], weights_only=False)   # imports kernel_rms_norm: registers the kernel
model, fn = saved["model"], saved["kernel"]
assert fn is torch.ops.examples.rms_norm.default or type(fn).__name__ == "JaxKernel", fn
out = model(saved["x"])
torch.testing.assert_close(out.cpu(), saved["expected"])
torch.testing.assert_close(fn(saved["x"].cpu(), model.weight.detach().cpu()), saved["expected"])
print("ok", out.device)
"""


def test_module_using_a_kernel_survives_save_and_load_in_a_new_process(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import kernel_rms_norm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model = kernel_rms_norm.RMSNorm(16).to("neuron")
    with torch.no_grad():
        model.weight.mul_(torch.linspace(0.5, 2.0, 16, device="neuron"))
    x = torch.randn(3, 16, device="neuron")
    expected = model(x).detach().cpu()
    path = tmp_path / "model.pt"
    torch.save({"model": model, "kernel": kernel_rms_norm.rms_norm, "x": x, "expected": expected}, path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), str(ROOT / "src")]))
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok neuron:0" in proc.stdout


# -- visibility -------------------------------------------------------------------------------------
def test_readiness_report_lists_the_custom_kernels_used(tmp_path):
    x = torch.randn(4, 8, device="neuron")
    with torchneuron.check(str(tmp_path)) as chk:
        pallas_square(x)                       # the first call site
        pallas_square(x)
        scaled(x.cpu(), 3.0)
    rows = {r["kernel"]: r for r in chk.report["custom_kernels"]}
    assert set(rows) == {"tn_test::pallas_square", "tn_test::scaled"}
    assert rows["tn_test::pallas_square"]["calls"] == 2 and rows["tn_test::scaled"]["calls"] == 1
    site = rows["tn_test::pallas_square"]["site"]
    lines = Path(__file__).read_text().splitlines()
    assert site["line"] == next(i for i, t in enumerate(lines, 1) if t.endswith("# the first call site"))
    md = (tmp_path / "report.md").read_text()
    assert "### Custom kernels" in md and "tn_test::pallas_square" in md


# -- distributed ------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kernel_in_ddp_and_fsdp2_training_matches_one_cpu_process(tmp_path):
    """Two processes on neuron tensors: DDP, then FSDP2 with the kernel's weight sharded (the
    kernel sees the all-gathered weight; its gradient is reduce-scattered back)."""
    script = ROOT / "tests" / "scripts" / "kernel_distributed.py"
    port, world = _free_port(), 2
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=480)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-6000:]}"
    result = torch.load(tmp_path / "result.pt")
    sys.path.insert(0, str(script.parent))
    try:
        import kernel_distributed
    finally:
        sys.path.remove(str(script.parent))
    ref_losses, ref_params = kernel_distributed.reference()
    for name in ("ddp", "fsdp"):
        losses, params = result[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
    assert result["sharded_norm_weight"] == (16,)       # 32 weights, half on each rank
    assert result["calls"]["examples::rms_norm"] == 2 * kernel_distributed.STEPS
    assert result["calls"]["examples::rms_norm_backward"] == 2 * kernel_distributed.STEPS
