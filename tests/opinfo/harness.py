"""PyTorch's OpInfo database run on neuron, with the CPU as the oracle.

For each OpInfo entry, dtype and check ("forward" or "grad") every sample is generated on CPU,
run there, copied to neuron and run again; the two results are compared. A sample ends as one of:

* ``native``   -- matched, and ``metrics.fallbacks`` did not grow while it ran (decompositions into
  lowered ops count as native);
* ``fallback`` -- matched, but some ATen op ran on CPU (the ops are recorded);
* ``expected`` -- failed, and an entry of ``expectations.EXPECTATIONS`` says why;
* ``fail``     -- ran and mismatched, or raised where CPU did not: never silently skipped;
* ``cpu_error``-- the sample is not valid on CPU, and neuron rejects it too (not counted); one that
  CPU rejects and neuron runs is a ``fail`` (error parity).

Random ops cannot match CPU values: they are checked by shape, dtype, range, reproducibility
under ``torch.manual_seed`` (see ``RANDOM`` and ``RANDOM_WHEN``), and their distribution: a
two-sample Kolmogorov-Smirnov test of values drawn on neuron against values drawn on CPU. Ops that return uninitialised memory (``empty*``) are
checked by shape and dtype only.

``tests/opinfo/test_opinfo.py`` and ``python -m tools.coverage`` both drive this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torchneuron
from torchneuron.eager import kernel as _kernel
from torchneuron.metrics import metrics

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.testing._internal import common_methods_invocations as _cmi
    # op_db plus the _foreach_* entries, which PyTorch keeps in separate lists.
    op_db = list(_cmi.op_db) + [op for name in ("foreach_unary_op_db", "foreach_binary_op_db",
                                                "foreach_pointwise_op_db", "foreach_reduce_op_db",
                                                "foreach_other_op_db") for op in getattr(_cmi, name, [])]

from . import expectations

DEVICE = "neuron"
FORWARD_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
GRAD_DTYPES = (torch.float32,)

# Default comparison tolerances (atol, rtol). float32 follows PyTorch's own CPU-vs-accelerator
# comparison (test_compare_cpu) scaled down 10x; bfloat16 allows ~2 ulp, as results may round once
# (PyTorch CPU) or twice (XLA) from a float32 intermediate.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-4, 1e-4),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}
GRAD_TOLERANCE = (1e-4, 1e-4)


def name_of(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


OPS = {name_of(op): op for op in op_db}


@dataclasses.dataclass
class SampleResult:
    op: str
    dtype: str
    check: str
    index: int
    status: str              # native | fallback | expected | fail | cpu_error
    desc: str = ""
    detail: str = ""
    fallbacks: tuple[str, ...] = ()
    decomposed: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- random-output ops ----------------------------------------------------------------------------
def _in_range(lo, hi, *, hi_inclusive=False):
    def check(out, sample):
        t = out if isinstance(out, torch.Tensor) else out[0]
        if not t.numel() or not (t.dtype.is_floating_point or t.dtype in _INT_DTYPES):
            return None
        vals = t.float()
        bad = (vals < lo) | ((vals > hi) if hi_inclusive else (vals >= hi))
        if math.isinf(hi):
            bad = vals < lo
        return f"values outside [{lo}, {hi}{']' if hi_inclusive else ')'}" if bool(bad.any()) else None
    return check


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _finite(out, sample):
    t = out if isinstance(out, torch.Tensor) else out[0]
    if t.dtype.is_floating_point and t.numel() and not bool(torch.isfinite(t).all()):
        return "non-finite values"
    return None


def _bernoulli(out, sample):
    return None if bool(((out == 0) | (out == 1)).all()) else "values other than 0 and 1"


def _dropout(out, sample):
    # Every element is either dropped or the input scaled by 1/(1-p).
    x = sample.input.float()
    p = sample.kwargs.get("p", sample.args[0] if sample.args else 0.5)
    if not sample.kwargs.get("training", True) or p == 0:
        return None if torch.allclose(out.float(), x, equal_nan=True) else "eval-mode dropout changed its input"
    scaled = x / (1 - p) if p < 1 else torch.zeros_like(x)
    ok = (out.float() == 0) | torch.isclose(out.float(), scaled, rtol=1e-2, atol=1e-3)
    return None if bool(ok.all()) else "elements neither dropped nor scaled by 1/(1-p)"


def _alpha_dropout(out, sample):
    # Alpha dropout outputs a*x + b (kept) or a*alpha' + b (dropped): at most two affine images of x.
    return _finite(out, sample)


def _multinomial(out, sample):
    n = sample.input.shape[-1]
    if out.dtype != torch.int64:
        return f"dtype {out.dtype}, expected int64"
    if bool(((out < 0) | (out >= n)).any()):
        return "category index out of range"
    probs = sample.input.float()
    picked = probs.reshape(-1, n).gather(-1, out.reshape(probs.reshape(-1, n).shape[0], -1).cpu())
    if bool((picked == 0).any()):
        return "sampled a zero-probability category"
    replacement = sample.kwargs.get("replacement", sample.args[1] if len(sample.args) > 1 else False)
    if not replacement:
        rows = out.reshape(-1, out.shape[-1])
        if any(len(set(r.tolist())) != len(r) for r in rows):
            return "repeated category without replacement"
    return None


def _randint_like(out, sample):
    args = sample.args
    low, high = (0, args[0]) if len(args) == 1 else (args[0], args[1]) if len(args) >= 2 else (
        sample.kwargs.get("low", 0), sample.kwargs["high"])
    return _in_range(low, high)(out, sample)


def _randint(out, sample):
    # randint(high, size) or randint(low, high, size); the first positional is sample.input.
    args = [sample.input, *sample.args]
    if len(args) >= 3 or (len(args) == 2 and not isinstance(args[1], tuple | list | torch.Size)):
        low, high = args[0], args[1]
    else:
        low, high = 0, args[0]
    return _in_range(low, high)(out, sample)


def _uniform(out, sample):
    lo = sample.args[0] if sample.args else sample.kwargs.get("from", 0.0)
    hi = sample.args[1] if len(sample.args) > 1 else sample.kwargs.get("to", 1.0)
    return _in_range(lo, hi, hi_inclusive=True)(out, sample)


def _rrelu(out, sample):
    x = sample.input.float()
    lower = sample.kwargs.get("lower", sample.args[0] if sample.args else 1 / 8)
    upper = sample.kwargs.get("upper", sample.args[1] if len(sample.args) > 1 else 1 / 3)
    o = out.float()
    pos = x >= 0
    if not bool(torch.isclose(o[pos], x[pos], rtol=1e-2, atol=1e-3).all()):
        return "non-negative inputs changed"
    neg = ~pos & (x != 0)
    slope = o[neg] / x[neg]
    training = sample.kwargs.get("training", False)
    if training:
        ok = (slope >= lower - 1e-2) & (slope <= upper + 1e-2)
    else:
        ok = torch.isclose(slope, torch.full_like(slope, (lower + upper) / 2), rtol=1e-2, atol=1e-3)
    return None if bool(ok.all()) else "negative slope outside [lower, upper]"


def _positive_ints(out, sample):
    return _in_range(1, math.inf)(out, sample)


def _nonneg(out, sample):
    return _in_range(0, math.inf)(out, sample)


def _fractional_pool(out, sample):
    # Each output is the maximum of some window of the input: it must be one of the input values.
    vals = out[0] if isinstance(out, tuple) else out
    return None if bool(torch.isin(vals.float(), sample.input.float()).all()) else "output not an input value"


def _shape_only(out, sample):
    return None


# name -> property check of one output (on CPU copies). All also get shape/dtype/reproducibility.
RANDOM: dict[str, Callable] = {
    "bernoulli": _bernoulli,
    "cauchy": _shape_only,
    "exponential": _nonneg,
    "geometric": _positive_ints,
    "log_normal": _nonneg,
    "normal": _finite,
    "normal.in_place": _finite,
    "normal.number_mean": _finite,
    "uniform": _uniform,
    "rand_like": _finite,        # PyTorch's OpInfo entry named rand_like calls torch.randn_like
    "randn_like": _finite,
    "randn": _finite,
    "randint": _randint,
    "randint_like": _randint_like,
    "multinomial": _multinomial,
    "nn.functional.dropout": _dropout,
    "nn.functional.dropout2d": _finite,
    "nn.functional.dropout3d": _finite,
    "nn.functional.alpha_dropout": _alpha_dropout,
    "nn.functional.feature_alpha_dropout.with_train": _alpha_dropout,
    "nn.functional.rrelu": _rrelu,
    "nn.functional.fractional_max_pool2d": _fractional_pool,
    "nn.functional.fractional_max_pool3d": _fractional_pool,
    "svd_lowrank": _shape_only,
    "pca_lowrank": _shape_only,
}
# Entries that are random for some samples only (dropout inside): name -> predicate over the sample.
RANDOM_WHEN: dict[str, Callable] = {
    # multi_head_attention_forward(query, key, value, ..., dropout_p=args[9], ..., training=...)
    "nn.functional.multi_head_attention_forward":
        lambda s: s.kwargs.get("training", True) and len(s.args) > 9 and s.args[9] > 0,
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
}


# Random ops whose outputs are not draws from a distribution worth comparing: randomised
# algorithms whose result approximates a deterministic one (checked by shape).
NOT_DISTRIBUTIONS = {"svd_lowrank", "pca_lowrank"}
# Random ops whose output elements depend on each other (a channel dropped whole, dropout mixed by
# a matmul): compared by per-run statistics, not by pooling elements as independent draws.
DEPENDENT_DRAWS = {"nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.feature_alpha_dropout.with_train",
                   "nn.functional.multi_head_attention_forward", "nn.functional.scaled_dot_product_attention"}
# Two-sample Kolmogorov-Smirnov test of the pooled output values of DISTRIBUTION_SEEDS seeded runs on
# each side, at significance 1e-3 (c(alpha) = sqrt(-ln(alpha / 2) / 2)): an op that is right fails
# one sample in a thousand at most; ties (discrete outputs) only make the test more lenient.
DISTRIBUTION_SEEDS = 12
_KS_C = math.sqrt(-math.log(1e-3 / 2) / 2)
_KS_MIN_VALUES = 240


def _primary_values(out) -> torch.Tensor | None:
    t = out if isinstance(out, torch.Tensor) else next((v for v in tree_flatten(out)[0]
                                                          if isinstance(v, torch.Tensor)), None)
    if t is None:
        return None
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.reshape(-1).to(torch.float64)


def _ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.sort().values, b.sort().values
    xs = torch.cat([a, b])
    fa = torch.searchsorted(a, xs, right=True).double() / len(a)
    fb = torch.searchsorted(b, xs, right=True).double() / len(b)
    return float((fa - fb).abs().max())


@contextlib.contextmanager
def _seeds_not_fixed():
    def call_through(op, *args, **kwargs):
        return op(*args, **kwargs)
    saved = _cmi.wrapper_set_seed
    _cmi.wrapper_set_seed = call_through
    try:
        yield
    finally:
        _cmi.wrapper_set_seed = saved


def _same_run_statistics(pools) -> str | None:
    """For outputs whose elements are not independent draws (channel dropout, dropout mixed by an
    attention's matmul): each seeded run's mean and standard deviation, compared across runs with
    Welch's statistic at |t| <= 4.5 (about 2e-4 two-sided for 12 runs a side)."""
    for what, stat in (("mean", torch.mean), ("std", torch.std)):
        a = torch.stack([stat(v[~v.isnan()]) for v in pools["neuron"]])
        b = torch.stack([stat(v[~v.isnan()]) for v in pools["cpu"]])
        spread = math.sqrt(float(a.var()) / len(a) + float(b.var()) / len(b))
        diff = float(a.mean() - b.mean())
        if (spread == 0 and abs(diff) > 1e-6 * max(1.0, abs(float(b.mean())))) or (spread and abs(diff) / spread > 4.5):
            return (f"distribution: per-run {what} {float(a.mean()):.4g} on neuron against {float(b.mean()):.4g} on CPU "
                    f"over {len(a)} seeded runs each (Welch t {diff / spread if spread else math.inf:.1f})")
    return None


def _same_distribution(cpu_call, neuron_call, sample, dependent=False) -> str | None:
    """None when the values a random op draws on neuron and on CPU could come from one distribution
    (a two-sample KS test over seeded runs, ``DISTRIBUTION_SEEDS`` or more until both sides have
    ``_KS_MIN_VALUES`` values); else what differs. Property checks alone pass an all-zero normal()."""
    pools: dict = {"cpu": [], "neuron": []}
    seed, count = 1, 0
    # OpInfo's random entries call their op through wrapper_set_seed (seed 42 on every call): the
    # draws must follow our seeds here, so it calls through for the pools.
    with _seeds_not_fixed():
        while seed <= DISTRIBUTION_SEEDS or (count < _KS_MIN_VALUES and seed <= 8 * DISTRIBUTION_SEEDS):
            for side, call in (("cpu", cpu_call), ("neuron", neuron_call)):
                with _default_device(sample) if side == "neuron" else contextlib.nullcontext():
                    values = _primary_values(sample.output_process_fn_grad(_seeded(call, 1000 + seed)))
                if values is None or not values.numel():
                    return None
                pools[side].append(values)
            count += pools["cpu"][-1].numel()
            seed += 1
    if all(torch.equal(v, pools["cpu"][0]) for v in pools["cpu"]) and \
            all(torch.equal(v, pools["neuron"][0]) for v in pools["neuron"]):
        return None   # no draw in this sample (eval mode, p=0): the property check judged it
    if dependent:
        return _same_run_statistics(pools)
    cpu, dev = torch.cat(pools["cpu"]), torch.cat(pools["neuron"])
    nan_cpu, nan_dev = float(cpu.isnan().double().mean()), float(dev.isnan().double().mean())
    if abs(nan_cpu - nan_dev) > 0.05:
        return f"distribution: NaN share {nan_dev:.3f} on neuron, {nan_cpu:.3f} on CPU"
    cpu, dev = cpu[~cpu.isnan()], dev[~dev.isnan()]
    if not cpu.numel() or not dev.numel():
        return None
    d = _ks_statistic(cpu, dev)
    limit = _KS_C * math.sqrt((len(cpu) + len(dev)) / (len(cpu) * len(dev)))
    if d > limit:
        return (f"distribution: two-sample KS statistic {d:.3f} > {limit:.3f} (alpha 1e-3) over {len(dev)} values; "
                f"neuron mean {dev.mean():.4g} std {dev.std():.4g}, CPU mean {cpu.mean():.4g} std {cpu.std():.4g}")
    return None


def is_random(name: str, sample) -> bool:
    return name in RANDOM or (name in RANDOM_WHEN and bool(RANDOM_WHEN[name](sample)))


# Uninitialised memory: only shape and dtype mean anything.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


# -- moving samples ---------------------------------------------------------------------------------
# Entries that address their input's whole storage (as_strided with an offset): their inputs move
# with that storage, so a view keeps its offset and the memory around it, as on CPU.
WHOLE_STORAGE = {"as_strided", "as_strided.partial_views", "as_strided_scatter"}


def _with_storage(v):
    """``v`` on neuron as the same view of a copy of its whole storage."""
    storage = v.detach().untyped_storage()
    base = torch.empty(0, dtype=v.dtype).set_(storage, 0, (storage.nbytes() // v.element_size(),), (1,))
    d = base.to(DEVICE).as_strided(v.shape, v.stride(), v.storage_offset())
    return d.requires_grad_(True) if v.requires_grad else d


def _to_device(v, leaves=None, whole_storage=False):
    if isinstance(v, torch.Tensor):
        d = _with_storage(v) if whole_storage and v.layout == torch.strided else v.detach().to(DEVICE)
        if v.requires_grad:
            if not d.requires_grad:
                d.requires_grad_(True)
            if leaves is not None:
                leaves.append(d)
        return d
    if isinstance(v, torch.device) and v.type == "cpu":
        return torch.device(DEVICE)
    return v


# Positional arguments (after the input) that the op requires on CPU, as CUDA tests generate them.
CPU_ARGS = {
    "tensor_split": {0},   # tensor_indices_or_sections must be a CPU tensor
}


def _move(sample, leaves=None, name=""):
    keep = CPU_ARGS.get(name, ())

    def mv(x):
        if isinstance(x, list):
            return [mv(e) for e in x]
        if isinstance(x, tuple):
            return tuple(mv(e) for e in x)
        if isinstance(x, str) and x == "cpu":   # a device given as a string (Tensor.to("cpu", ...))
            return DEVICE
        if isinstance(x, dict):
            return {k: (DEVICE if k == "device" and x[k] in ("cpu", torch.device("cpu")) else mv(e))
                    for k, e in x.items()}
        return _to_device(x, leaves, name in WHOLE_STORAGE)
    inp = mv(sample.input)   # leaves are collected in (input, args, kwargs) order, as on CPU
    args = [a if i in keep else mv(a) for i, a in enumerate(sample.args)]
    return inp, args, mv(dict(sample.kwargs))


def _cpu_leaves(sample):
    leaves = []

    def visit(x):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            leaves.append(x)
        return x
    tree_map(visit, (sample.input, list(sample.args), dict(sample.kwargs)))
    return leaves


def _to_cpu(v):
    if isinstance(v, torch.Tensor) and v.device.type != "cpu":
        return v.detach().cpu()
    return v


# -- comparison ---------------------------------------------------------------------------------
_EQUIVALENT = {torch.float64: torch.float32, torch.complex128: torch.complex64}


def compare(actual, expected, tol=None, path="out") -> str | None:
    """None when ``actual`` (neuron results) matches ``expected`` (CPU), else what differs."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: got {type(actual).__name__}, expected a Tensor"
        if actual.device.type != DEVICE and expected.device.type == "cpu" and actual.numel():
            return f"{path}: result on {actual.device}, expected on {DEVICE}"
        a = actual.detach().cpu()
        e = expected.detach().cpu()
        if tuple(a.shape) != tuple(e.shape):
            return f"{path}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if a.dtype != e.dtype and _EQUIVALENT.get(e.dtype) != a.dtype:
            return f"{path}: dtype {a.dtype} != {e.dtype}"
        if e.is_complex() or a.is_complex():
            a, e = torch.view_as_real(a.resolve_conj()), torch.view_as_real(e.resolve_conj().to(a.dtype))
        if a.dtype != e.dtype:
            e = e.to(a.dtype)
        if a.is_floating_point():
            atol, rtol = tol or TOLERANCES.get(a.dtype, (1e-4, 1e-4))
            try:
                torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True, check_stride=False)
            except AssertionError as err:
                return f"{path}: " + _first_line(str(err))
            return None
        if not torch.equal(a, e):
            diff = (a != e).sum().item()
            return f"{path}: {diff} of {a.numel()} elements differ"
        return None
    if isinstance(expected, list | tuple):
        if not isinstance(actual, list | tuple) or len(actual) != len(expected):
            return f"{path}: got {type(actual).__name__} of {len(actual) if hasattr(actual, '__len__') else '?'}, " \
                   f"expected {len(expected)} values"
        for i, (a, e) in enumerate(zip(actual, expected)):
            msg = compare(a, e, tol, f"{path}[{i}]")
            if msg:
                return msg
        return None
    if isinstance(expected, float):
        if isinstance(actual, torch.Tensor) or not isinstance(actual, int | float):
            return f"{path}: got {actual!r}, expected {expected!r}"
        if math.isnan(expected) and math.isnan(actual):
            return None
        atol, rtol = tol or (1e-4, 1e-4)
        return None if abs(actual - expected) <= atol + rtol * abs(expected) else f"{path}: {actual} != {expected}"
    if isinstance(expected, torch.dtype | torch.device):
        return None
    if actual != expected:
        return f"{path}: {actual!r} != {expected!r}"
    return None


def _first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:4])[:300]


def describe(sample) -> str:
    def fmt(v):
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                return f"{str(v.layout).replace('torch.', '')}{list(v.shape)}"
            return f"T{list(v.shape)}" + ("" if v.is_contiguous() else "nc")
        if isinstance(v, list | tuple):
            inner = ",".join(fmt(x) for x in v[:6]) + (",..." if len(v) > 6 else "")
            return ("[" + inner + "]") if isinstance(v, list) else ("(" + inner + ")")
        if isinstance(v, torch.dtype):
            return str(v).replace("torch.", "")
        return repr(v)[:40]
    parts = [fmt(sample.input)] + [fmt(a) for a in sample.args]
    parts += [f"{k}={fmt(v)}" for k, v in sample.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


# -- running ----------------------------------------------------------------------------------------
class _FallbackWatch:
    """The ops that ran on CPU (and those decomposed) between enter and exit."""

    def __enter__(self):
        self.before = dict(metrics.fallbacks)
        self.before_decomp = dict(metrics.decompositions)
        return self

    def __exit__(self, *exc):
        self.ops = watch_ops(self)
        after = metrics.decompositions
        self.decomposed = tuple(sorted(k for k, v in after.items() if v > self.before_decomp.get(k, 0)))
        _last_decomposed[:] = self.decomposed
        return False


_last_decomposed: list = []
# (entry, dtype, check) -> how many samples OpInfo generates, whether or not ``limit`` ran them all.
sample_counts: dict[tuple[str, str, str], int] = {}


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _samples(op, dtype, requires_grad):
    with _quiet():
        return list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))


def _error(err) -> str:
    return f"{type(err).__name__}: {_first_line(str(err))}"


def _seeded(fn, seed):
    torch.manual_seed(seed)
    return fn()


def _default_device(sample):
    """A factory sample with no tensor and no device argument (``torch.arange(2)``) creates its result
    on the default device: it runs with neuron as the default, as a user's ``with torch.device("neuron")``
    block would."""
    leaves = tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))[0]
    if "device" in sample.kwargs or any(isinstance(v, torch.Tensor) for v in leaves):
        return contextlib.nullcontext()
    return torch.device(DEVICE)


def run_forward(op, sample, dtype) -> tuple[str, str, tuple]:
    """(status, detail, fallback ops) of one forward sample."""
    name = name_of(op)
    with _quiet():
        try:
            expected = _seeded(lambda: op(sample.input, *sample.args, **sample.kwargs), 0)
            expected = sample.output_process_fn_grad(expected)
        except Exception as err:  # the sample is not valid on CPU: neuron must reject it too
            return _error_parity(op, sample, name, err)
        inp, args, kwargs = _move(sample, name=name)
        with _FallbackWatch() as watch, _default_device(sample):
            try:
                actual = _seeded(lambda: op(inp, *args, **kwargs), 0)
                actual = sample.output_process_fn_grad(actual)
                if is_random(name, sample):
                    again = _seeded(lambda: sample.output_process_fn_grad(op(inp, *args, **kwargs)), 0)
            except Exception as err:
                return "fail", _error(err), watch_ops(watch)
    if name in UNINITIALISED:
        msg = _check_meta(actual, expected)
    elif is_random(name, sample):
        msg = _check_meta(actual, expected)
        if msg is None:
            msg = compare(again, actual, (0.0, 0.0), "reproducibility")
        if msg is None:
            with _quiet():
                msg = RANDOM.get(name, _finite)(tree_map(_to_cpu, actual), sample)
        if msg is None and name not in NOT_DISTRIBUTIONS:
            with _quiet():
                msg = _same_distribution(lambda: op(sample.input, *sample.args, **sample.kwargs),
                                         lambda: op(inp, *args, **kwargs), sample, name in DEPENDENT_DRAWS)
    else:
        msg = compare(actual, expected, expectations.tolerance(name, dtype, "forward"))
        if msg and dtype in _HALF and _closer_to_float64(op, sample, actual, expected):
            msg = None
    return ("fail", msg, watch.ops) if msg else ("native" if not watch.ops else "fallback", "", watch.ops)


_HALF = (torch.bfloat16, torch.float16)


def _error_parity(op, sample, name, cpu_err) -> tuple[str, str, tuple]:
    """A sample CPU rejects: ``cpu_error`` (not counted) when neuron rejects it too, whatever its
    error; ``fail`` when neuron runs it (a silent acceptance of an invalid call). Random ops and ops
    returning uninitialised memory included: what they reject does not depend on values."""
    with _quiet():
        try:
            inp, args, kwargs = _move(sample, name=name)
        except Exception:   # noqa: BLE001 - the sample cannot be moved: nothing to compare
            return "cpu_error", _error(cpu_err), ()
        with _FallbackWatch() as watch, _default_device(sample):
            try:
                out = _seeded(lambda: sample.output_process_fn_grad(op(inp, *args, **kwargs)), 0)
                tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, out)   # device checks
                if DEVICE == "neuron":
                    torch.neuron.synchronize()
            except Exception:   # noqa: BLE001 - rejected as on CPU: parity
                return "cpu_error", _error(cpu_err), ()
    return "fail", f"CPU rejects the sample ({_error(cpu_err)}) but neuron ran it", watch_ops(watch)


def _closer_to_float64(op, sample, actual, expected) -> bool:
    """Half precision: CPU's result is itself rounded (often in several places), so a neuron result
    that differs from it still passes when each element is at least as close to the float64 result
    as CPU's, or within one ulp of it (neuron computes in float32 and rounds once). Dtypes, shapes,
    integer and bool outputs must still be equal."""
    def up(v):
        return v.double() if isinstance(v, torch.Tensor) and v.dtype in _HALF else v
    kwargs = tree_map(up, dict(sample.kwargs))
    if kwargs.get("dtype") in _HALF:   # a factory's float64 result (linspace(..., dtype=bfloat16))
        kwargs["dtype"] = torch.float64
    try:
        with _quiet():
            truth = sample.output_process_fn_grad(op(tree_map(up, sample.input), *tree_map(up, list(sample.args)),
                                                     **kwargs))
    except Exception:
        return False
    flat = [tree_flatten(x)[0] for x in (actual, expected, truth)]
    if len({len(f) for f in flat}) != 1:
        return False
    for a, e, t in zip(*flat):
        if not isinstance(e, torch.Tensor):
            continue
        a, e = a.detach().cpu(), e.detach()
        if not e.is_floating_point():
            if not torch.equal(a, e):
                return False
            continue
        if a.dtype != e.dtype or not isinstance(t, torch.Tensor) or t.shape != e.shape or t.isnan().any() \
                or a.isnan().any():
            return False
        # Per element: no further from float64 than CPU, or within one ulp of it.
        allowed = torch.maximum((e.double() - t).abs().nan_to_num(float("inf")), torch.finfo(e.dtype).eps * t.abs())
        if not bool(((a.double() - t).abs() <= allowed).all()):
            return False
    return True


def watch_ops(watch):
    after = metrics.fallbacks
    return tuple(sorted(k for k, v in after.items() if v > watch.before.get(k, 0)))


def _check_meta(actual, expected) -> str | None:
    a_flat, _ = tree_flatten(actual)
    e_flat, _ = tree_flatten(expected)
    if len(a_flat) != len(e_flat):
        return f"{len(a_flat)} outputs, expected {len(e_flat)}"
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"got {type(a).__name__}, expected a Tensor"
            if tuple(a.shape) != tuple(e.shape):
                return f"shape {tuple(a.shape)} != {tuple(e.shape)}"
            if a.dtype != e.dtype and _EQUIVALENT.get(e.dtype) != a.dtype:
                return f"dtype {a.dtype} != {e.dtype}"
            if e.numel() and a.device.type != DEVICE:
                return f"result on {a.device}"
    return None


def _differentiable(out):
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad
            and (t.is_floating_point() or t.is_complex())]


def _cotangents(outs, seed):
    g = torch.Generator().manual_seed(seed)
    cots = []
    for t in outs:
        dtype = t.dtype if t.dtype != torch.complex128 else torch.complex64
        c = torch.randn(t.shape, generator=g, dtype=torch.float32)
        cots.append(c.to(dtype) if not dtype.is_complex else torch.complex(c, c).to(dtype))
    return cots


def run_grad(op, sample, dtype) -> tuple[str, str, tuple]:
    """(status, detail, fallback ops) of the gradient of one sample (vector-Jacobian product)."""
    name = name_of(op)
    variant = op.get_op()
    with _quiet():
        try:
            out = _seeded(lambda: sample.output_process_fn_grad(
                op.gradcheck_wrapper(variant, sample.input, *sample.args, **sample.kwargs)), 0)
            outs = _differentiable(out)
            leaves = _cpu_leaves(sample)
            if not outs or not leaves:
                return "cpu_error", "no differentiable outputs", ()
            cots = _cotangents(outs, 1)
            expected = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        except Exception as err:
            return "cpu_error", _error(err), ()
        dev_leaves = []
        inp, args, kwargs = _move(sample, dev_leaves, name)
        with _FallbackWatch() as watch:
            try:
                out_d = _seeded(lambda: sample.output_process_fn_grad(
                    op.gradcheck_wrapper(variant, inp, *args, **kwargs)), 0)
                outs_d = _differentiable(out_d)
                if len(outs_d) != len(outs):
                    return "fail", f"{len(outs_d)} differentiable outputs, expected {len(outs)}", watch_ops(watch)
                actual = torch.autograd.grad(outs_d, dev_leaves, [c.to(DEVICE) for c in cots],
                                             allow_unused=True)
                if is_random(name, sample):
                    out_again = _seeded(lambda: sample.output_process_fn_grad(
                        op.gradcheck_wrapper(variant, inp, *args, **kwargs)), 0)
                    again = torch.autograd.grad(_differentiable(out_again), dev_leaves,
                                                [c.to(DEVICE) for c in cots], allow_unused=True)
            except Exception as err:
                return "fail", _error(err), watch_ops(watch)
    if is_random(name, sample):
        msg = _check_meta(list(actual), [e if e is not None else None for e in expected])
        if msg is None:
            msg = compare(list(again), list(actual), (0.0, 0.0), "reproducibility")
    else:
        expected = [e if e is not None else None for e in expected]
        msg = _compare_grads(actual, expected, expectations.tolerance(name, dtype, "grad") or GRAD_TOLERANCE)
    return ("fail", msg, watch.ops) if msg else ("native" if not watch.ops else "fallback", "", watch.ops)


def _compare_grads(actual, expected, tol):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None and a is None:
            continue
        if e is None or a is None:
            # An unused input may come back as None on one side and zeros on the other.
            other = a if e is None else e
            if isinstance(other, torch.Tensor) and not bool((other.detach().cpu() == 0).all()):
                return f"grad[{i}]: None on one side, nonzero on the other"
            continue
        msg = compare(a, e, tol, f"grad[{i}]")
        if msg:
            return msg
    return None


def run(op, dtype, check, limit=None, start=0, shapes="static") -> Iterator[SampleResult]:
    """Results of every sample of ``op`` for ``dtype`` and ``check`` ("forward" or "grad").
    ``shapes="bucketed"``: each sample compiled with ``config.shapes="bucketed"`` at padded sizes
    (``bucketed.py``, which has its own statuses)."""
    name = name_of(op)
    dname = str(dtype).replace("torch.", "")
    try:
        samples = _samples(op, dtype, requires_grad=(check == "grad"))
    except Exception as err:
        yield SampleResult(name, dname, check, -1, "cpu_error", "", f"sample generation: {_error(err)}")
        return
    sample_counts[(name, dname, check)] = len(samples)
    stop = len(samples) if limit is None else min(len(samples), start + limit)
    runner = run_forward if check == "forward" else run_grad
    mode = contextlib.nullcontext()
    if shapes == "bucketed":
        from . import bucketed
        runner = bucketed.run_forward if check == "forward" else bucketed.run_grad
        mode = bucketed.bucketed_mode()
    elif shapes != "static":
        raise ValueError(f"shapes must be 'static' or 'bucketed', got {shapes!r}")
    with mode:
        yield from _run_samples(name, dname, check, dtype, samples, runner, start, stop)
    torchneuron.metrics.extra["opinfo_samples"] += stop - start


def _run_samples(name, dname, check, dtype, samples, runner, start, stop):
    op = OPS[name]
    for i in range(start, stop):
        sample = samples[i]
        _last_decomposed.clear()
        try:
            desc = describe(sample)
            status, detail, fb = runner(op, sample, dtype)
        except Exception as err:  # a harness-level error is still a failure, never a skip
            status, detail, fb = "fail", "harness: " + _error(err), ()
            if os.environ.get("TORCHNEURON_OPINFO_TRACEBACK"):
                traceback.print_exc()
        if status == "fail":
            reason = expectations.expected(name, dtype, check, sample, detail)
            if reason is not None:
                status, detail = "expected", f"{reason} [{detail}]"
        yield SampleResult(name, dname, check, i, status, desc, detail, fb, tuple(_last_decomposed))


def dtypes_for(op, check) -> list[torch.dtype]:
    if check == "grad":
        if not op.supports_autograd:
            return []
        supported = op.supported_backward_dtypes("cpu")
        return [d for d in GRAD_DTYPES if d in supported]
    supported = op.supported_dtypes("cpu")
    return [d for d in FORWARD_DTYPES if d in supported]


def clear_caches() -> None:
    """Drop compiled executables between ops (a full sweep compiles tens of thousands)."""
    _kernel.clear_cache()
