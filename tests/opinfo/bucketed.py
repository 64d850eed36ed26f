"""The OpInfo sweep at padded sizes: every sample compiled with ``config.shapes = "bucketed"``.

Each sample's call is wrapped in a function of its arguments and compiled with
``torch.compile(fn, backend="neuron")``; every dim of size >= 2 of every neuron tensor argument is
``torch._dynamo.mark_dynamic`` (so Dynamo traces it symbolically from the first call and the neuron
backend runs the graph at its shape bucket: OpInfo's sizes, 2 to 20 mostly, are padded to 16 or 32).
The results are compared with CPU eager on the same sample, with the tolerances of the eager sweep
(``harness.py``). A sample ends as one of ``STATUSES``:

* ``native``          -- matched; every graph ran bucketed (padded), no op ran on CPU;
* ``fallback``        -- matched, but some ATen op ran on CPU, or a graph ran eagerly because an op
  in it has no lowering (``metrics.graph_fallbacks``);
* ``static-fallback`` -- matched, but a graph had an op without a dynamic-shape rule and was
  compiled at its exact shapes instead (``metrics()["extra"]["bucketed_fallback: <op> (<why>)"]``,
  the ops are named in the detail): correct, and not a test of padded execution;
* ``graph-break``     -- matched, but Dynamo broke the graph (the reasons in the detail): part of
  the sample ran eagerly;
* ``dynamo``          -- Dynamo (or AOTAutograd's tracing) refused the sample: a data-dependent
  output shape, a guard on a data-dependent value, a constraint on a marked dim that the program
  specialises (the reason in the detail); nothing ran on neuron's bucketed path;
* ``unpadded``        -- matched, but no graph ran at padded sizes (no dim of size >= 2, or Dynamo
  specialised every marked dim): no test of the dynamic rules;
* ``expected``        -- failed, and ``expectations.py`` names the failure;
* ``fail``            -- a mismatch with CPU, or an error raised by neuron (a bucketed graph's
  lowering, a rule, the runtime).
* ``cpu_error``       -- CPU rejects the sample and so does the compiled neuron call (not counted).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import traceback

import torch
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_flatten, tree_map

import torchneuron
from torchneuron.metrics import metrics

from . import expectations
from . import harness as h

STATUSES = ("native", "fallback", "static-fallback", "graph-break", "dynamo", "unpadded", "expected", "fail")
_FALLBACK_PREFIX = "bucketed_fallback: "


@contextlib.contextmanager
def bucketed_mode():
    """``config.shapes = "bucketed"`` (default pow2 ladder), and graphs with an op that has no
    lowering run eagerly (counted as CPU fallbacks, as in the eager sweep) instead of raising."""
    cfg = torchneuron.config
    saved = (cfg.shapes, cfg.shape_buckets, cfg.compile_fallback)
    cfg.shapes, cfg.shape_buckets, cfg.compile_fallback = "bucketed", "pow2", "eager"
    # Dynamo logs each refusal (a specialised marked dim, a data-dependent guard) at length; the
    # sweep records them as statuses instead.
    loggers = [logging.getLogger(n) for n in ("torch._guards", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        cfg.shapes, cfg.shape_buckets, cfg.compile_fallback = saved
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def mark_dynamic(structure, strict=True) -> int:
    """Mark every dim of size >= 2 of every neuron tensor in ``structure`` dynamic; how many."""
    n = 0
    mark = torch._dynamo.mark_dynamic if strict else torch._dynamo.maybe_mark_dynamic
    for t in tree_flatten(structure)[0]:
        if isinstance(t, torch.Tensor) and t.device.type == h.DEVICE and t.layout == torch.strided:
            for d, s in enumerate(t.shape):
                if s >= 2:
                    mark(t, d)
                    n += 1
    return n


def _unmark(structure):
    for t in tree_flatten(structure)[0]:
        if isinstance(t, torch.Tensor) and hasattr(t, "_dynamo_dynamic_indices"):
            del t._dynamo_dynamic_indices


class _Watch:
    """What the bucketed path did between enter and exit: the graphs compiled at padded sizes, the
    bucketed fallbacks (op and reason), the graphs run eagerly, and Dynamo's graph breaks."""

    def __enter__(self):
        self.extra = dict(metrics.extra)
        self.graph_fallbacks = dict(metrics.graph_fallbacks)
        self.breaks = dict(counters["graph_break"])
        return self

    def __exit__(self, *exc):
        extra = metrics.extra
        self.bucketed = extra.get("bucketed_graph_compiles", 0) - self.extra.get("bucketed_graph_compiles", 0)
        self.static = tuple(sorted(k[len(_FALLBACK_PREFIX):] for k, v in extra.items()
                                   if k.startswith(_FALLBACK_PREFIX) and v > self.extra.get(k, 0)))
        self.eager_graphs = tuple(sorted(f"graph ran eagerly: {k}" for k, v in metrics.graph_fallbacks.items()
                                         if v > self.graph_fallbacks.get(k, 0)))
        self.graph_breaks = tuple(sorted(k for k, v in counters["graph_break"].items()
                                         if v > self.breaks.get(k, 0)))
        return False


def _compiled(fn):
    """``fn(inp, args, kwargs)`` compiled by the neuron backend (a fresh Dynamo cache per sample)."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="neuron", dynamic=None)


# Exceptions that are Dynamo's or AOTAutograd's refusals of the traced program, not neuron's.
def _refusal_types():
    from torch._dynamo import exc as dexc
    from torch._subclasses import fake_tensor as ft
    from torch.fx.experimental import symbolic_shapes as ss
    types = [dexc.Unsupported, dexc.UserError, ss.ConstraintViolationError, ss.GuardOnDataDependentSymNode,
             ft.DataDependentOutputException, ft.DynamicOutputShapeException]
    for name in ("UnsupportedOperatorException",):
        if hasattr(ft, name):
            types.append(getattr(ft, name))
    return tuple(types)


def _chain(err):
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return seen


def _from_neuron(err) -> bool:
    """Raised in torchneuron's own code (a lowering, a rule, the runtime)."""
    for e in _chain(err):
        for frame in traceback.extract_tb(e.__traceback__):
            if "/torchneuron/" in frame.filename.replace("\\", "/"):
                return True
    return False


def refusal(err) -> str | None:
    """The reason Dynamo/AOTAutograd refused the program, or None when ``err`` is a failure."""
    if _from_neuron(err):
        return None
    types = _refusal_types()
    for e in _chain(err):
        if isinstance(e, types):
            return _one_line(h._error(e), 300)
    return None


def _call(compiled, inp, args, kwargs, sample, seed=0):
    return h._seeded(lambda: sample.output_process_fn_grad(compiled(inp, args, kwargs)), seed)


def _one_line(text, n=160):
    return " ".join(text.split())[:n]


def _status(watch, fallbacks, marked) -> tuple[str, str]:
    """The status of a sample that matched CPU, and what the detail says about it."""
    notes = []
    if watch.static:
        notes.append("compiled at exact shapes: " + "; ".join(watch.static))
    if watch.graph_breaks:
        notes.append("graph breaks: " + "; ".join(_one_line(b) for b in watch.graph_breaks))
    if watch.eager_graphs:
        notes.append("; ".join(watch.eager_graphs))
    detail = " | ".join(notes)
    if watch.static:
        return "static-fallback", detail
    if watch.graph_breaks:
        return "graph-break", detail
    if fallbacks or watch.eager_graphs:
        return "fallback", detail
    if not watch.bucketed:
        why = "no dim of size >= 2" if not marked else "no graph ran at padded sizes"
        return "unpadded", f"{why}" + (f" | {detail}" if detail else "")
    return "native", detail


def _run_compiled(sample, name, fn, marked_inputs, op=None):
    """(outputs, again-outputs or None, watch, fallback ops, marked dims) of the compiled call, or
    raises. A marked dim the program specialises (Dynamo's constraint violation) is retried with
    ``maybe_mark_dynamic``, so the other dims stay dynamic."""
    inp, args, kwargs = marked_inputs
    for strict in (True, False):
        marked = mark_dynamic((inp, args, kwargs), strict)
        compiled = _compiled(fn)
        if op is not None:
            compiled = _Wrapped(op, compiled)
        with h._FallbackWatch() as fb, _Watch() as watch, h._default_device(sample):
            try:
                out = _call(compiled, inp, args, kwargs, sample)
                again = _call(compiled, inp, args, kwargs, sample) if h.is_random(name, sample) else None
            except Exception as err:
                if strict and _is_constraint(err):
                    _unmark((inp, args, kwargs))
                    continue
                raise
        return out, again, watch, fb.ops, marked
    raise AssertionError("unreachable")


def _is_constraint(err) -> bool:
    from torch.fx.experimental import symbolic_shapes as ss
    return any(isinstance(e, ss.ConstraintViolationError) or "Constraints violated" in str(e)
               for e in _chain(err))


def run_forward(op, sample, dtype) -> tuple[str, str, tuple]:
    name = h.name_of(op)
    with h._quiet():
        try:
            expected = h._seeded(lambda: op(sample.input, *sample.args, **sample.kwargs), 0)
            expected = sample.output_process_fn_grad(expected)
        except Exception as err:
            return _error_parity(op, sample, name, err)
        moved = h._move(sample, name=name)
        fn = _forward_fn(op)
        try:
            actual, again, watch, fallbacks, marked = _run_compiled(sample, name, fn, moved)
        except Exception as err:
            why = refusal(err)
            if why is not None:
                return "dynamo", why, ()
            return "fail", h._error(err), ()
    if name in h.UNINITIALISED:
        msg = h._check_meta(actual, expected)
    elif h.is_random(name, sample):
        msg = h._check_meta(actual, expected)
        if msg is None:
            msg = h.compare(again, actual, (0.0, 0.0), "reproducibility")
        if msg is None:
            with h._quiet():
                msg = h.RANDOM.get(name, h._finite)(tree_map(h._to_cpu, actual), sample)
    else:
        msg = h.compare(actual, expected, expectations.tolerance(name, dtype, "forward"))
        if msg and dtype in h._HALF and h._closer_to_float64(op, sample, actual, expected):
            msg = None
    if msg:
        return "fail", msg + _context(watch), fallbacks
    status, detail = _status(watch, fallbacks, marked)
    return status, detail, fallbacks


def _context(watch) -> str:
    """What a failing sample's graphs did (a failure on the exact-shape path is still a failure)."""
    parts = []
    if watch.static:
        parts.append("compiled at exact shapes: " + "; ".join(watch.static))
    if watch.graph_breaks:
        parts.append(f"{len(watch.graph_breaks)} graph break(s)")
    if not watch.bucketed:
        parts.append("no graph ran at padded sizes")
    return f" ({', '.join(parts)})" if parts else ""


# TORCHNEURON_OPINFO_POISON=1: inside the compiled function every floating-point tensor argument
# first goes through ``where(position < its size, x, nan)`` per dim: the identity on the true
# elements, while in the padded program the pad of every input holds NaN instead of the zeros a
# padded box is read with (a rule that forgets to mask then shows, even where zero is harmless).
def poison() -> bool:
    return bool(os.environ.get("TORCHNEURON_OPINFO_POISON"))


def _poison(t):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() == 0:
        return t
    keep = None
    for d in range(t.dim()):
        if t.shape[d] < 2:
            continue
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        m = (torch.arange(t.shape[d], device=t.device) < t.shape[d]).reshape(shape)
        keep = m if keep is None else keep & m
    return t if keep is None else torch.where(keep, t, torch.full_like(t, float("nan")))


def _poisoned(inp, args, kwargs):
    if not poison():
        return inp, args, kwargs
    return tree_map(_poison, inp), tree_map(_poison, args), tree_map(_poison, kwargs)


def _forward_fn(op):
    fn = op.op

    def sample_call(inp, args, kwargs):
        inp, args, kwargs = _poisoned(inp, args, kwargs)
        return fn(inp, *args, **kwargs)
    return sample_call


def _grad_fn(op):
    variant = op.get_op()

    def sample_call(inp, args, kwargs):
        inp, args, kwargs = _poisoned(inp, args, kwargs)
        return variant(inp, *args, **kwargs)
    return sample_call


class _Wrapped:
    """The compiled variant called through the entry's ``gradcheck_wrapper`` (run eagerly: Dynamo
    cannot trace some wrappers, e.g. the masked reductions' with a function argument)."""

    def __init__(self, op, compiled):
        self.wrapper, self.compiled = op.gradcheck_wrapper, compiled

        @functools.wraps(op.get_op())   # wrappers look at the op's name (masked reductions)
        def variant(x, *a, **k):
            return self.compiled(x, list(a), k)
        self.variant = variant

    def __call__(self, inp, args, kwargs):
        return self.wrapper(self.variant, inp, *args, **kwargs)


def _error_parity(op, sample, name, cpu_err) -> tuple[str, str, tuple]:
    """CPU rejects the sample: the compiled neuron call must reject it too."""
    with h._quiet():
        try:
            moved = h._move(sample, name=name)
        except Exception:  # noqa: BLE001 - the sample cannot be moved: nothing to compare
            return "cpu_error", h._error(cpu_err), ()
        try:
            out, _, watch, fallbacks, _ = _run_compiled(sample, name, _forward_fn(op), moved)
            tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, out)
            torch.neuron.synchronize()
        except Exception:  # noqa: BLE001 - rejected as on CPU: parity
            return "cpu_error", h._error(cpu_err), ()
    return "fail", f"CPU rejects the sample ({h._error(cpu_err)}) but neuron ran it", fallbacks


def run_grad(op, sample, dtype) -> tuple[str, str, tuple]:
    name = h.name_of(op)
    variant = op.get_op()
    with h._quiet():
        try:
            out = h._seeded(lambda: sample.output_process_fn_grad(
                op.gradcheck_wrapper(variant, sample.input, *sample.args, **sample.kwargs)), 0)
            outs = h._differentiable(out)
            leaves = h._cpu_leaves(sample)
            if not outs or not leaves:
                return "cpu_error", "no differentiable outputs", ()
            cots = h._cotangents(outs, 1)
            expected = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        except Exception as err:
            return "cpu_error", h._error(err), ()
        dev_leaves = []
        moved = h._move(sample, dev_leaves, name)
        fn = _grad_fn(op)
        random = h.is_random(name, sample)
        try:
            # The forward and, through AOTAutograd, the backward graph are both compiled bucketed.
            out_d, again_d, watch, fallbacks, marked = _run_compiled(sample, name, fn, moved, op)
            with _Watch() as bwatch, h._FallbackWatch() as bfb:
                outs_d = h._differentiable(out_d)
                if len(outs_d) != len(outs):
                    return "fail", f"{len(outs_d)} differentiable outputs, expected {len(outs)}", fallbacks
                dev_cots = [c.to(h.DEVICE) for c in cots]
                actual = torch.autograd.grad(outs_d, dev_leaves, dev_cots, allow_unused=True)
                again = None
                if random:
                    again = torch.autograd.grad(h._differentiable(again_d), dev_leaves, dev_cots,
                                                allow_unused=True)
        except Exception as err:
            why = refusal(err)
            if why is not None:
                return "dynamo", why, ()
            return "fail", h._error(err), ()
    _merge(watch, bwatch)
    fallbacks = tuple(sorted(set(fallbacks) | set(bfb.ops)))
    if random:
        msg = h._check_meta(list(actual), list(expected))
        if msg is None:
            msg = h.compare(list(again), list(actual), (0.0, 0.0), "reproducibility")
    else:
        msg = h._compare_grads(actual, list(expected),
                               expectations.tolerance(name, dtype, "grad") or h.GRAD_TOLERANCE)
    if msg:
        return "fail", msg + _context(watch), fallbacks
    status, detail = _status(watch, fallbacks, marked)
    return status, detail, fallbacks


def _merge(watch, more):
    watch.bucketed += more.bucketed
    watch.static = tuple(sorted(set(watch.static) | set(more.static)))
    watch.eager_graphs = tuple(sorted(set(watch.eager_graphs) | set(more.eager_graphs)))
    watch.graph_breaks = tuple(sorted(set(watch.graph_breaks) | set(more.graph_breaks)))
