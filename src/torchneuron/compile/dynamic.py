"""Bucketed dynamic dimensions (``config.shapes = "bucketed"``): one executable per shape bucket.

A graph Dynamo traced symbolically reaches AOTAutograd with its symbolic shapes, so the ATen graphs
it hands the compilers have SymInt placeholders and nodes whose ``meta["val"]`` shapes are
expressions of the symbols (``s0``, ``s0*s1``, ``s0 - 1``). ``BucketedProgram`` compiles such a
graph once per **bucket** of its symbols:

* every symbol's true value is read from the call's inputs and rounded up to its bucket
  (``bucket_for``: powers of two from 16 by default, or the listed sizes of
  ``config.shape_buckets`` / ``options={"buckets": ...}``);
* each input is padded with zeros to its shape evaluated at the buckets (a small per-shape pad
  executable, counted in ``metrics.extra["bucketed_pad_compiles"]``), and the true symbol values
  are runtime inputs of the graph's executable (traced integer scalars);
* every node is evaluated on padded arrays with the invariant "along each padded dim the first
  true-size elements are exact, the rest is don't-care"; the ops whose result depends on the padded
  extent are made exact by masking (``RULES`` here, the JAX functions in ``ops/dynamic.py``), the
  elementwise ops pass through; a dim merging several dynamic dims (``[b, t, c] -> [b*t, c]``) is
  laid out as their padded box (``ops.dynamic.Factors``), so reshapes between such shapes stay
  plain reshapes, and the ops that read positions along it see it compacted (``positional``);
* outputs are cut back to their true shapes (a small per-shape slice executable), SymInt outputs
  are computed on the host from the true symbol values.

A graph with an op that has no rule yet is not run wrongly: it compiles per concrete shape, as
``config.shapes = "static"`` does (counted in ``metrics.extra["bucketed_fallbacks"]`` and
``metrics.recompiles``, one warning naming the op).
"""

from __future__ import annotations

import operator
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import sympy
import torch
from jax import lax
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._sympy.functions import FloorDiv, Mod

from ..config import config
from ..metrics import metrics
from ..ops import checks, precision
from ..ops import dynamic as dyn
from ..ops.signature import cast, registry_name, signature_for
from ..runtime import deferred, inputs, layout, memory, rng, sites
from ..runtime.device import current_device, device_mismatch_error
from ..runtime.dtypes import device_dtype, jax_dtype
from ..runtime.inputs import Inputs, StableStorages
from . import cache, executables
from .errors import NodeFailure, meta_of
from .graph import unboxed
from .interpreter import _apply, _lookup

_records = memory.allocator.records
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_AS_STRIDED = torch.ops.aten.as_strided.default.redispatch

_NOOPS = frozenset({
    "_assert_tensor_metadata.default", "_assert_scalar.default", "_functional_assert_async.msg",
    "_assert_async.default", "_assert_async.msg", "sym_constrain_range_for_size.default",
    "sym_constrain_range.default", "_print.default",
})
_CONVERT = torch.ops.prims.convert_element_type.default
# Ops symbolic decompositions leave in graphs, lowered as the op they alias.
_ALIASES = {"true_divide.Tensor": torch.ops.aten.div.Tensor}
_SYM_OPS = frozenset({"sym_size.int", "sym_numel.default", "sym_stride.int", "sym_storage_offset.default"})
_SYM_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
                            operator.neg, torch.sym_max, torch.sym_min, torch.sym_sum})

# Ops exact on padded arrays as they are (besides those tagged pointwise): views and layout, and
# factories whose symbolic sizes are filled up to the bucket.
_PASS = frozenset({
    "permute.default", "transpose.int", "t.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "expand.default", "clone.default", "_to_copy.default", "alias.default",
    "detach.default", "lift_fresh_copy.default", "contiguous.default", "triu.default", "tril.default",
    "scalar_tensor.default", "full.default", "ones.default", "zeros.default", "empty.memory_format",
    "full_like.default", "zeros_like.default", "ones_like.default", "empty_like.default",
    "new_zeros.default", "new_ones.default", "new_full.default", "new_empty.default",
    "empty_strided.default", "copy.default", "copy_.default", "fill.Scalar", "fill_.Scalar", "fill.Tensor", "fill_.Tensor",
    "zero.default", "zero_.default", "cumsum.default", "cumprod.default", "_unsafe_view.default", "view.default", "reshape.default",
})


# Random ops whose every element is drawn on its own: the pad draws don't-care values.
_RANDOM_ELEMENTWISE = frozenset({
    "native_dropout.default", "rand_like.default", "randn_like.default", "rand.default", "randn.default",
    "bernoulli.p", "bernoulli.default", "uniform.default", "normal.Tensor_float", "normal.float_Tensor",
})
_PASS = _PASS | _RANDOM_ELEMENTWISE

# Ops exact on a merged dim laid out as its padded box (``Factors``): they act on each position
# alone, or mask through ``valid_mask``. Other ops see such dims compacted to a prefix.
_AGNOSTIC = frozenset({
    "permute.default", "transpose.int", "t.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "expand.default", "clone.default", "_to_copy.default", "alias.default",
    "detach.default", "lift_fresh_copy.default", "contiguous.default", "scalar_tensor.default",
    "full.default", "ones.default", "zeros.default", "empty.memory_format", "full_like.default",
    "zeros_like.default", "ones_like.default", "empty_like.default", "new_zeros.default",
    "new_ones.default", "new_full.default", "new_empty.default", "copy.default", "copy_.default", "fill.Scalar",
    "fill_.Scalar", "fill.Tensor", "fill_.Tensor", "zero.default", "zero_.default", "view.default", "_unsafe_view.default", "reshape.default",
    "sum.dim_IntList", "sum.default", "nansum.default", "mean.dim", "mean.default", "amax.default",
    "max.default", "amin.default", "min.default", "prod.dim_int", "prod.default", "any.dim", "any.dims",
    "any.default", "all.dim", "all.dims", "all.default", "logsumexp.default", "var.correction",
    "var_mean.correction", "std.correction",
    "mm.default", "bmm.default", "addmm.default", "baddbmm.default", "dot.default", "mv.default",
    "_softmax.default", "_log_softmax.default", "_softmax_backward_data.default",
    "_log_softmax_backward_data.default", "native_layer_norm.default", "native_layer_norm_backward.default",
    "embedding.default", "embedding_dense_backward.default", "nll_loss_forward.default",
    "nll_loss_backward.default", "split.Tensor", "split_with_sizes.default",
}) | _RANDOM_ELEMENTWISE

# Ops whose rule reads dynamic sizes passed as plain int arguments (not lists of sizes).
_SIZE_ARGS_HANDLED = frozenset({"slice.Tensor", "select.int", "arange.default", "arange.start",
                                "arange.start_step"})


class NoRule(Exception):
    """A node of a symbolic graph that the bucketed path cannot evaluate exactly."""

    def __init__(self, op, why):
        super().__init__(f"{op}: {why}")
        self.op, self.why = op, why


# -- buckets ---------------------------------------------------------------------------------------
def parse_buckets(spec) -> tuple:
    """``"pow2"`` (powers of two from 16), ``"pow2:<min>"``, or an increasing list of sizes."""
    if spec is None or spec == "" or spec == "pow2":
        return ("pow2", 16)
    if isinstance(spec, str) and spec.startswith("pow2:"):
        return ("pow2", int(spec[5:]))
    sizes = spec.split(",") if isinstance(spec, str) else list(spec)
    sizes = tuple(sorted(int(s) for s in sizes))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"torchneuron: shape buckets must be positive sizes, got {spec!r}")
    return ("list", sizes)


def _ladder_text(buckets):
    """The ladder in force as the advisor shows it: its sizes, or "pow2 from N"."""
    kind, arg = buckets
    return list(arg) if kind == "list" else f"pow2 from {arg}"


def bucket_for(value: int, buckets, what: str = "a dynamic dim") -> int:
    kind, arg = buckets
    if kind == "pow2":
        size = arg
        while size < value:
            size *= 2
        return size
    for size in arg:
        if size >= value:
            return size
    raise ValueError(
        f"torchneuron: {what} has size {value}, above the largest shape bucket {arg[-1]} "
        f"(buckets {list(arg)}); add a larger bucket to config.shape_buckets "
        f"(TORCHNEURON_SHAPE_BUCKETS) or torch.compile(options={{'buckets': [...]}}), or use 'pow2'")


# -- symbolic expressions --------------------------------------------------------------------------
def expr_of(v):
    """The sympy expression of a SymInt or int (an Integer for a static size)."""
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return sympy.Integer(int(v))


def evaluate(expr, values):
    """``expr`` with the symbols' values (Python ints or traced scalars)."""
    if isinstance(expr, sympy.Integer | int):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return values[expr]
    args = [evaluate(a, values) for a in expr.args]
    if isinstance(expr, sympy.Add):
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if isinstance(expr, sympy.Mul):
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if isinstance(expr, FloorDiv):
        return args[0] // args[1]
    if isinstance(expr, Mod):
        return args[0] % args[1]
    if isinstance(expr, sympy.Pow) and isinstance(expr.args[1], sympy.Integer) and int(expr.args[1]) >= 0:
        return args[0] ** int(expr.args[1])
    if type(expr).__name__ == "Max":
        out = args[0]
        for a in args[1:]:
            out = jnp.maximum(out, a) if not isinstance(out, int) or not isinstance(a, int) else max(out, a)
        return out
    if type(expr).__name__ == "Min":
        out = args[0]
        for a in args[1:]:
            out = jnp.minimum(out, a) if not isinstance(out, int) or not isinstance(a, int) else min(out, a)
        return out
    raise NoRule("sym", f"the size expression {expr} ({type(expr).__name__}) is not supported")


def factors(expr, order) -> list:
    """``expr`` as its row-major factors: symbolic factors outer (in the symbols' binding
    ``order``), one static factor innermost (omitted when 1); a static size is ``[n]``."""
    if _is_static(expr):
        return [sympy.Integer(int(expr))]
    parts = sympy.Mul.make_args(sympy.factor(expr)) if isinstance(expr, sympy.Add | sympy.Mul) else (expr,)
    static, symbolic = 1, []
    for part in parts:
        if isinstance(part, sympy.Integer):
            static *= int(part)
        elif isinstance(part, sympy.Pow) and isinstance(part.args[1], sympy.Integer) and int(part.args[1]) > 1:
            symbolic.extend([part.args[0]] * int(part.args[1]))
        else:
            symbolic.append(part)
    if static < 0:
        return [expr]
    symbolic.sort(key=lambda f: min((order.get(x, len(order)) for x in f.free_symbols), default=0))
    return symbolic + ([sympy.Integer(static)] if static != 1 else [])


def compound(expr, order) -> bool:
    """A size that merges two or more dynamic sizes: laid out as their padded box (``Factors``)."""
    return not _is_static(expr) and sum(1 for f in factors(expr, order) if not _is_static(f)) >= 2


def _shape_exprs(t):
    return tuple(expr_of(s) for s in t.shape)


def _row_major(val) -> bool:
    """Whether a fake tensor's symbolic strides are the row-major ones of its sizes."""
    acc = sympy.Integer(1)
    for size, stride in zip(reversed(val.shape), reversed(val.stride())):
        size = expr_of(size)
        if size != 1 and sympy.expand(expr_of(stride) - acc) != 0:
            return False
        acc = acc * size
    return True


def contiguous_tail(sizes, strides) -> int:
    """How many trailing dims of a view are laid out row-major (sizes of 1 fit any stride)."""
    k, acc = 0, 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != acc:
            break
        acc *= size
        k += 1
    return k


def _is_static(expr) -> bool:
    return isinstance(expr, sympy.Integer | int)


# -- the program -----------------------------------------------------------------------------------
class BucketedProgram:
    """A symbolic ATen graph compiled once per bucket of its symbols (boxed call, like GraphProgram)."""

    allow_inplace = False   # graphs with in-place updates compile per shape

    def __init__(self, gm, kind, *, fallback="error", name="graph", dump_dir=None, buckets=None,
                 exact_first=False):
        self.gm, self.kind, self.fallback, self.name, self.dump_dir = gm, kind, fallback, name, dump_dir
        self._boxed_call = True
        self.buckets = parse_buckets(buckets if buckets is not None else config.shape_buckets)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.executables: dict = {}
        # With exact_first (dynamic=True: every dim symbolic whether it varies or not), a symbol is
        # compiled at its exact size until it is seen with a second one; otherwise (automatic
        # dynamic, mark_dynamic: the dim has varied or was said to) it is bucketed from the start.
        self.first_values: dict = {}   # symbol -> its first size
        self.varied: set = set()       # symbols bucketed
        self._lock = threading.Lock()
        self.static = None           # the per-shape fallback, when the graph has no rule somewhere
        self.device_checks = config.device_checks
        try:
            self._plan()
        except NoRule as err:
            self._fall_back(err)
        if not exact_first and self.static is None:
            self.varied = set(self.symbols)

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self):
        self.symbols = []       # the bound symbols, in binding order
        self.binders = []       # (placeholder index, None | dim, symbol)
        self.where = {}         # symbol -> the input and dim it is read from (for messages)
        self.dim_names = {}     # symbol -> its name in metrics.dynamic_sizes (graph, input, dim)
        bound = set()

        def bind(size, i, d, where):
            e = expr_of(size)
            if isinstance(e, sympy.Symbol) and e not in bound:
                bound.add(e)
                self.symbols.append(e)
                self.binders.append((i, d, e))
                self.where[e] = where.format(e=e)
                self.dim_names[e] = f"{self.name}: {self.where[e]}"   # the advisor's name of the dim

        for i, ph in enumerate(self.placeholders):
            v = ph.meta.get("val")
            if isinstance(v, torch.SymInt):
                bind(v, i, None, f"the dynamic size {{e}} (input {ph.name})")
            elif isinstance(v, torch.Tensor):
                if v.device.type != "neuron" and (v.device.type != "cpu" or _free_symbols(v)):
                    raise NoRule("input", f"a {v.device.type} tensor input" +
                                 (" with dynamic sizes" if v.device.type == "cpu" else ""))
                for d, s in enumerate(v.shape):
                    bind(s, i, d, f"dim {d} of input {ph.name} (symbol {{e}})")
            elif isinstance(v, torch.SymFloat | torch.SymBool):
                raise NoRule("input", "a SymFloat/SymBool input")
        self.order = {e: k for k, e in enumerate(self.symbols)}
        # Per placeholder, for the call: None (not a tensor), "cpu" (a CPU tensor of static shape, a
        # scale constant: uploaded by the call, counted) or "neuron"; and its size expressions if a
        # size is dynamic (read as a padded box), else None.
        self.input_kinds, self.input_exprs = [], []
        for ph in self.placeholders:
            v = ph.meta.get("val")
            tensor = isinstance(v, torch.Tensor)
            exprs = _shape_exprs(v) if tensor else ()
            self.input_kinds.append(None if not tensor else "cpu" if v.device.type == "cpu" else "neuron")
            self.input_exprs.append(None if all(_is_static(e) for e in exprs) else exprs)
        self.stable = StableStorages(self.placeholders)
        self._sizes_memo = {}
        self.positional = set()
        self.steps = []
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op != "call_function":
                raise NoRule(str(node.target), f"FX node kind {node.op!r}")
            target = node.target
            val = node.meta.get("val")
            for e in _free_symbols(val):
                if e not in bound:
                    raise NoRule(_op_name(node), f"the symbol {e} is not a graph input's size")
            for e in _size_exprs(val):
                if not _grows(e):
                    # Evaluated at the buckets, such a size could be smaller than the true one.
                    raise NoRule(_op_name(node), f"the size {e} does not grow with its symbols")
            if target is operator.getitem:
                self.steps.append((node, "getitem", None, None))
                continue
            if target in _SYM_FUNCTIONS or (isinstance(target, torch._ops.OpOverload)
                                             and registry_name(target) in _SYM_OPS):
                if not isinstance(val, torch.SymInt | int):
                    raise NoRule(_op_name(node), "a symbolic value that is not an integer")
                self.steps.append((node, "sym", None, None))
                continue
            if target is _CONVERT:
                # Some decompositions of symbolic graphs cast with the prim itself.
                self.steps.append((node, "convert", None, None))
                continue
            if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
                raise NoRule(str(target), "only ATen operators have dynamic rules")
            name = registry_name(target)
            if name in _NOOPS:
                continue
            if name in _ALIASES:
                target = _ALIASES[name]
                name = registry_name(target)
            sig = signature_for(target, config.platform)
            if sig is None:
                raise NoRule(name, "the op has no neuron lowering")
            if sig.mutated and not self.allow_inplace:
                raise NoRule(name, "in-place updates are not bucketed yet")
            if sig.lowering.random and name not in _RANDOM_ELEMENTWISE:
                raise NoRule(name, "random ops other than elementwise ones are not bucketed yet")
            if name not in _SIZE_ARGS_HANDLED:
                for i in sig.static:
                    v = sig.bind(node.args, node.kwargs, missing=None)[i]
                    if isinstance(v, torch.fx.Node) and _free_symbols(v.meta.get("val")):
                        raise NoRule(name, f"a dynamic size as its argument {sig.arg_names[i]!r}")
            rule = _rule_for(name, target, node)
            if not (name in _AGNOSTIC or torch.Tag.pointwise in target.tags) and _touches_compound(node, self.order):
                self.positional.add(node)
            self.steps.append((node, "op", sig, rule))
        for out in _flat(self.output_node.args[0]):
            if isinstance(out, torch.fx.Node) and isinstance(out.meta.get("val"), torch.SymFloat | torch.SymBool):
                raise NoRule("output", "a SymFloat/SymBool output")
        self.random = any(sig is not None and sig.lowering.random for _, _, sig, _ in self.steps)
        # PyTorch's float32 precision settings the matmuls and convolutions are traced with (key part).
        self.precision_readers = precision.readers(sig.lowering.precision for _, _, sig, _ in self.steps
                                                   if sig is not None)
        self._plan_outputs()

    def _fall_back(self, err: NoRule):
        from .backend import static_aten_program  # the static path lives beside the backend
        reason = f"{err.op} ({err.why})"
        metrics.extra["bucketed_fallbacks"] += 1
        metrics.extra[f"bucketed_fallback: {reason}"] += 1
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"torchneuron: config.shapes='bucketed': {err.op} has no dynamic-shape rule "
                          f"({err.why}); this {self.kind} graph compiles once per concrete shape, as with "
                          "config.shapes='static'", stacklevel=3)
        self.static = static_aten_program(self.gm, self.kind, self.fallback, self.name, self.dump_dir)

    # -- calling -----------------------------------------------------------------------------------
    def __call__(self, *args):
        args = unboxed(args)
        if self.static is not None:
            return self.static(args)
        values = {}
        for i, d, e in self.binders:
            a = args[i]
            values[e] = int(a) if d is None else int(a.shape[d])
        sizes_seen = metrics.dynamic_sizes
        for e in self.symbols:
            # exact_first: a symbol keeps its exact size until it is seen with a second one (with
            # dynamic=True a batch that is always 2 must not run padded to a bucket).
            v = values[e]
            if e not in self.varied and self.first_values.setdefault(e, v) != v:
                self.varied.add(e)
            sizes_seen[self.dim_names[e]][v] += 1   # for the bucket advisor
        at = self._at_sizes(values)
        ins, specs = self._inputs(args, at.boxes)
        device_index = ins.device_index
        # What decides the program: the buckets, every input's spec and the sizes of the storages
        # it reads (runtime/inputs.py); true sizes, strides and view offsets are runtime inputs.
        # A size not yet varied is compiled in as a constant (no mask, no gather on it): marked in
        # the key, so a bucket of the same size does not take its executable.
        key = (at.bucket_key, tuple(specs), tuple(ins.storages), *precision.settings(self.precision_readers))
        sym_inputs = list(at.sizes)
        if self.random:
            gen = rng.generator(device_index if device_index is not None else current_device())
            sym_inputs[len(self.symbols):len(self.symbols)] = gen.next_key_inputs()
        exe = self.executables.get(key)
        if exe is None:
            with self._lock:
                exe = self.executables.get(key)
                if exe is None:
                    try:
                        exe = self._compile(key, at.buckets, specs, ins, sym_inputs, at.exact)
                    except NoRule as err:
                        self._fall_back(err)
                        return self.static(args)
                    self.executables[key] = exe
        results = exe["call"](*ins.bufs, *ins.runtime, *sym_inputs)
        return self._finish(exe, results, args, values, at.layouts, device_index)

    def _at_sizes(self, values):
        """What a call at these true sizes needs besides its inputs, computed once per distinct set of
        sizes (sympy evaluation costs more than the executable of a small graph): the buckets, the
        key's part for them, each dynamic input's box size, the output layouts and the runtime
        vectors of the true sizes and layouts."""
        exact = frozenset(e for e in self.symbols if e not in self.varied)
        memo_key = (tuple(values[e] for e in self.symbols), exact)
        at = self._sizes_memo.get(memo_key)
        if at is not None:
            return at
        buckets = {e: values[e] if e in exact else bucket_for(values[e], self.buckets, self.where[e])
                   for e in self.symbols}
        layouts = self._output_layouts(values)
        at = _AtSizes(
            buckets=buckets, exact=exact,
            bucket_key=tuple((buckets[e], e in exact) for e in self.symbols),
            boxes=[None if exprs is None else int(np.prod([_padded(e, buckets) for e in exprs]))
                   for exprs in self.input_exprs],
            layouts=layouts,
            sizes=tuple([np.asarray(values[e], np.int64) for e in self.symbols] +
                        [np.asarray((*sizes, *strides), np.int64) for sizes, strides in layouts]))
        if len(self._sizes_memo) >= 512:
            self._sizes_memo.clear()
        self._sizes_memo[memo_key] = at
        return at

    def _inputs(self, args, boxes):
        """The inputs collected as every graph collects them (``runtime/inputs.py``) and a spec per
        placeholder: inputs with dynamic sizes are read from their storages as padded boxes (of
        ``boxes[i]`` elements), with their strides and offset as one runtime vector."""
        ins = Inputs()
        specs = [None] * len(args)
        stable = self.stable
        first = stable.collect(ins, args, _neuron_only)
        if first is None:
            rest = range(len(args))
        else:
            rest = stable.others
            for i, spec in zip(stable.positions, first):
                specs[i] = ("graph", spec)
        graph_arg = ins.graph_arg
        kinds = self.input_kinds
        for i in rest:
            kind, a, box = kinds[i], args[i], boxes[i]
            if kind is None:
                continue
            if box is None:
                if kind == "neuron" and a.device.type != "neuron":
                    _refuse_device(a)
                specs[i] = ("graph", graph_arg(a))
            else:
                if a.device.type != "neuron":
                    _refuse_device(a)
                specs[i] = ("box", box_input(ins, a, box), a.dtype, contiguous_tail(a.shape, a.stride()))
        return ins, specs

    def _output_layouts(self, values):
        """(sizes, strides) of each output the program writes, at this call's true sizes."""
        layouts = []
        for kind, what in self.output_kinds:
            if kind == "array":
                val = what[0].meta["val"]
                sizes = tuple(int(evaluate(e, values)) for e in _shape_exprs(val))
                strides = tuple(int(evaluate(expr_of(s), values)) for s in val.stride())
                if not layout.is_dense(sizes, strides):
                    strides = memory.contiguous_strides(sizes)
                layouts.append((sizes, strides))
        return layouts

    def _split(self, exprs, values, buckets):
        """(true, padded) sizes of a shape with its compound dims split into their factors: how
        an input is padded into (an output cut out of) the padded box."""
        true, padded = [], []
        for e in exprs:
            fs = factors(e, self.order) if compound(e, self.order) else [e]
            true.extend(int(evaluate(f, values)) for f in fs)
            padded.extend(_padded(f, buckets) for f in fs)
        return tuple(true), tuple(padded)

    def _compile(self, key, buckets, specs, ins, sym_inputs, exact=frozenset()):
        if self.executables:
            metrics.recompiles[f"{self.kind} graph: a new shape bucket (config.shapes='bucketed')"] += 1
        for e in self.symbols:   # for the bucket advisor: compiles per bucket, and the ladder
            if e not in exact:   # a size compiled in before it varied is no bucket of the ladder
                metrics.bucket_compiles[self.dim_names[e]][buckets[e]] += 1
            metrics.dynamic_ladders[self.dim_names[e]] = _ladder_text(self.buckets)
        tracer = _Trace(self, buckets, specs, len(ins.bufs), len(ins.runtime), exact)
        tracer.__name__ = f"neuron_bucketed_{self.kind}"
        try:
            lowered, compiled, _ = executables.compile_traced(tracer, ins.bufs, [*ins.runtime, *sym_inputs])
        except NodeFailure as failure:
            if isinstance(failure.error, NoRule):
                raise failure.error from None
            raise NoRule(_op_name(failure.node), f"{type(failure.error).__name__}: {failure.error}") from None
        if self.dump_dir:   # one dump per bucket (torchneuron.export writes them into its artifacts)
            tag = "_".join(f"{e}-{'exact' if e in exact else ''}{buckets[e]}" for e in self.symbols)
            cache.dump(f"{self.name}_{tag}", self.gm, lowered, specs, self.dump_dir)
        metrics.extra["bucketed_graph_compiles"] += 1
        return {"call": compiled, "checks": tracer.checks}

    def _finish(self, exe, results, args, values, layouts, device_index):
        dev = device_index if device_index is not None else current_device()
        results = list(results)
        if exe["checks"]:
            outcome = results[len(layouts)]
            if self.device_checks == "sync":
                deferred.check_now(outcome, exe["checks"])
            else:
                deferred.defer(outcome, exe["checks"], sites.place(__import__("sys")._getframe()))
        final = []
        for kind, what in self.output_kinds:
            if kind == "array":
                node, j = what
                sizes, strides = layouts[j]
                dtype = device_dtype(node.meta["val"].dtype, self.name)   # the float64 policy, as static graphs
                final.append(memory.new_boxed_tensor(results[j], dtype, dev, sizes, strides))
            elif kind == "input":
                final.append(args[what])
            elif kind == "view":
                i, sizes, strides, offset = what
                final.append(_AS_STRIDED(_CPU_KEYS, args[i], [int(evaluate(e, values)) for e in sizes],
                                         [int(evaluate(e, values)) for e in strides], int(evaluate(offset, values))))
            elif kind == "sym":
                final.append(int(evaluate(what, values)))
            else:
                final.append(what)
        return final

    def _plan_outputs(self):
        """What each output is: a new array the program writes, an input, a view of one (a real
        alias, as GraphProgram returns it), a size computed on the host, or a constant."""
        kinds, n = [], 0
        self.out_row_major = []     # per written output: laid out row-major at every size
        ph_index = {ph: i for i, ph in enumerate(self.placeholders)}
        ph_storage = {}
        for i, ph in enumerate(self.placeholders):
            v = ph.meta.get("val")
            if isinstance(v, torch.Tensor):
                ph_storage.setdefault(StorageWeakRef(v.untyped_storage()), i)
        for out in _flat(self.output_node.args[0]):
            val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
            src = ph_storage.get(StorageWeakRef(val.untyped_storage())) if isinstance(val, torch.Tensor) else None
            if not isinstance(out, torch.fx.Node):
                kinds.append(("const", out))
            elif out in ph_index and isinstance(val, torch.Tensor):
                kinds.append(("input", ph_index[out]))
            elif src is not None and self.placeholders[src].meta["val"].dtype == val.dtype:
                kinds.append(("view", (src, _shape_exprs(val), tuple(expr_of(x) for x in val.stride()),
                                       expr_of(val.storage_offset()))))
            elif isinstance(val, torch.Tensor):
                kinds.append(("array", (out, n)))
                self.out_row_major.append(_row_major(val))
                n += 1
            else:
                kinds.append(("sym", expr_of(val)) if isinstance(val, torch.SymInt | int) else ("const", val))
        self.output_kinds = kinds


class _AtSizes:
    """What ``BucketedProgram._at_sizes`` computes for one set of true sizes."""

    __slots__ = ("buckets", "exact", "bucket_key", "boxes", "layouts", "sizes")

    def __init__(self, **fields):
        for k, v in fields.items():
            setattr(self, k, v)


def _neuron_only(a):
    if a.device.type != "neuron":
        _refuse_device(a)


def _refuse_device(a):
    raise RuntimeError(f"torchneuron: a bucketed graph got an input on {a.device}; move it to "
                       "the neuron device first")


def give_capacity(rec, box: int) -> None:
    """A storage a bucketed executable reads as a dynamic input, given a bucket's capacity if it has
    none yet (``memory.recapacity``), counted by how."""
    if not rec.boxed:
        how = memory.recapacity(rec, box)
        metrics.extra[f"bucketed_recapacity_{how}"] += 1
        if how == "device":   # a small program compiled for this size
            metrics.extra["bucketed_pad_compiles"] += 1


def box_input(ins, a, box: int) -> tuple:
    """The part of a bucketed executable's key for a neuron tensor ``a`` with dynamic sizes, read from
    its storage as a padded box of ``box`` elements: its slot. Its offset and strides are the next
    runtime input. A storage whose size is not a bucket's capacity gets one first (the box's size,
    or more: ``memory.recapacity``, counted), so the buffer sizes in keys stay bounded."""
    rec = memory.record_of(a)
    if ins.device_index is None:
        ins.device_index = rec.device_index
    elif rec.device_index != ins.device_index:
        raise device_mismatch_error(a, ins.device_index)
    give_capacity(rec, box)
    addr = memory.storage_address(a)
    slot = ins.slots.get(addr)
    if slot is None:
        slot = ins._add_storage(addr, rec, memory.empty_buffer(rec))
    else:
        ins.bufs[slot] = memory.empty_buffer(rec)
        ins.storages[slot] = (rec.numel, rec.dtype)
    ins.runtime.append(np.asarray((a.storage_offset(), *a.stride()), np.int64))
    return slot


_warned: set = set()


class _Trace:
    """The traced function of one bucket: (storage buffers..., runtime values..., true sizes...,
    output layouts...)."""

    def __init__(self, program, buckets, specs, nbufs, nruntime, exact=frozenset()):
        self.p, self.buckets, self.specs = program, buckets, specs
        self.nbufs, self.nruntime = nbufs, nruntime
        self.exact = exact      # symbols whose size is compiled in (their bucket is their size)
        self.checks = ()

    def __call__(self, *flat):
        p = self.p
        bufs = flat[:self.nbufs]
        rt = iter(flat[self.nbufs:self.nbufs + self.nruntime])
        rest = flat[self.nbufs + self.nruntime:]
        nsym = len(p.symbols)
        self.values = {e: self.buckets[e] if e in self.exact else v for e, v in zip(p.symbols, rest[:nsym])}
        self.base_key = None
        if p.random:
            seed, offset = rest[nsym:nsym + 2]
            self.base_key = jax.random.fold_in(jax.random.key(seed), offset)
            nsym += 2
        out_layouts = rest[nsym:]
        env = {}
        for ph, spec in zip(p.placeholders, self.specs):
            v = ph.meta.get("val")
            if spec is None:
                env[ph] = self.padded_int(expr_of(v)) if isinstance(v, torch.SymInt | int) else v
            elif spec[0] == "graph":
                env[ph], _ = inputs.read(spec[1], bufs, rt)
            else:
                view = next(rt)
                env[ph] = self.read_box(bufs[spec[1]], spec[2], _shape_exprs(v), view[0],
                                        [view[1 + d] for d in range(v.dim())], tail=spec[3])
        return self.evaluate(env, out_layouts)

    def read_box(self, buf, dtype, exprs, offset, strides, tail=0):
        """The padded box of an input view with true sizes ``exprs`` (traced offset and strides;
        ``tail`` trailing dims known row-major)."""
        return dyn.box_read(layout.reinterpret(buf, jax_dtype(dtype)), self.box_dims(exprs), strides, offset,
                            tail)

    def box_dims(self, exprs):
        """Per dim of a value with sizes ``exprs``: its factors ((true, padded), ...)."""
        dims = []
        for e in exprs:
            fs = factors(e, self.p.order) if compound(e, self.p.order) else [e]
            dims.append(tuple((int(f) if _is_static(f) else evaluate(f, self.values), self.padded_int(f))
                              for f in fs))
        return dims

    def evaluate(self, env, out_layouts):
        """Every node, then each new output written into a buffer of its box's capacity laid out as
        its true tensor (``out_layouts``: runtime (*sizes, *strides) of each), then the outcome of
        the device checks."""
        found = self.run_steps(env)
        results = []
        for kind, what in self.p.output_kinds:
            if kind != "array":
                continue
            out, j = what
            exprs = _shape_exprs(out.meta["val"])
            nd = len(exprs)
            vec = out_layouts[j]
            results.append(dyn.box_write(self.result(env, out), self.box_dims(exprs), [vec[d] for d in range(nd)],
                                         [vec[nd + d] for d in range(nd)], contiguous=self.p.out_row_major[j]))
        if found:
            results.append(checks.pack(found))
        return tuple(results)

    def run_steps(self, env) -> list:
        """Evaluate every node into ``env``; the device checks they made (``self.checks`` names
        them with their ops)."""
        p = self.p
        found = []
        with checks.collecting() if p.device_checks != "off" else checks.suspended() as sink:
            for n, (node, kind, sig, rule) in enumerate(p.steps):
                self.key = jax.random.fold_in(self.base_key, n) if self.base_key is not None else None
                before = len(sink) if sink is not None else 0
                try:
                    env[node] = self.run(node, kind, sig, rule, env)
                except (NodeFailure, NoRule):
                    raise
                except Exception as err:  # noqa: BLE001 - reported with the node that failed
                    raise NodeFailure(node, err) from err
                if sink is not None and len(sink) > before:
                    found.extend((entry, sig.name) for entry in sink[before:])
        self.checks = tuple((entry[-1], op) for entry, op in found)
        return [entry for entry, _ in found]

    @staticmethod
    def result(env, out):
        """The value of output node ``out`` in its fake tensor's dtype."""
        value = env[out]
        want = jax_dtype(device_dtype(out.meta["val"].dtype, "a bucketed graph's output"))
        return value.astype(want) if value.dtype != want else value

    # -- sizes -------------------------------------------------------------------------------------
    def padded_int(self, expr) -> int:
        return _padded(expr, self.buckets)

    def lens(self, v, compact=False):
        """Per dim of node ``v``'s value: None (not padded), its true size (traced; the exact region
        is a prefix) or, for a dim merging dynamic dims, ``Factors`` (unless ``compact``: the
        value was compacted to a prefix for a positional op)."""
        val = meta_of(v)
        out = []
        for s in val.shape:
            e = expr_of(s)
            if _is_static(e):
                out.append(None)
            elif not compact and compound(e, self.p.order):
                out.append(self.factor_lens(e))
            else:
                out.append(self._true_or_none(e))
        return tuple(out)

    def _true_or_none(self, e):
        """The true size of ``e``, or None where it is its padded size (compiled-in sizes)."""
        true = evaluate(e, self.values)
        return None if isinstance(true, int) and true == self.padded_int(e) else true

    def factor_lens(self, e):
        return dyn.Factors((None if _is_static(f) else self._true_or_none(f), self.padded_int(f))
                           for f in factors(e, self.p.order))

    def split_shape(self, exprs):
        """(true sizes, padded sizes) of a shape with every compound dim split into its factors."""
        true, padded = [], []
        for e in exprs:
            fs = factors(e, self.p.order) if compound(e, self.p.order) else [e]
            true.extend(evaluate(f, self.values) for f in fs)
            padded.extend(self.padded_int(f) for f in fs)
        return true, padded

    def to_prefix(self, x, exprs):
        """``x`` with its compound dims compacted (their exact region a prefix)."""
        if not any(compound(e, self.p.order) for e in exprs):
            return x
        true_split, padded_split = self.split_shape(exprs)
        return dyn.reshape(x.reshape(padded_split), true_split, [self.true(e) for e in exprs], x.shape)

    def to_factored(self, x, exprs):
        """The inverse of ``to_prefix``."""
        if not any(compound(e, self.p.order) for e in exprs):
            return x
        true_split, padded_split = self.split_shape(exprs)
        return dyn.reshape(x, [self.true(e) for e in exprs], true_split, padded_split).reshape(x.shape)

    def true(self, expr):
        return evaluate(expr, self.values)

    def padded_meta(self, v):
        """A meta tensor like node ``v``'s fake tensor with its shape at the buckets."""
        if isinstance(v, torch.fx.Node):
            v = v.meta.get("val")
        if isinstance(v, torch.Tensor):
            sizes = [self.padded_int(expr_of(s)) for s in v.shape]
            strides = [self.padded_int(expr_of(s)) for s in v.stride()]
            return torch.empty_strided(sizes, strides, dtype=v.dtype, device="meta")
        if isinstance(v, list | tuple):
            return type(v)(self.padded_meta(x) for x in v)
        if isinstance(v, torch.SymInt):
            return self.padded_int(expr_of(v))
        return v

    # -- one node ----------------------------------------------------------------------------------
    def run(self, node, kind, sig, rule, env):
        if kind == "getitem":
            src, idx = node.args
            return env[src][idx]
        if kind == "sym":
            return self.padded_int(expr_of(node.meta["val"]))
        if kind == "convert":
            value = env[node.args[0]]
            return cast(value, device_dtype(node.meta["val"].dtype, "convert_element_type"))
        values = sig.bind(node.args, node.kwargs, missing=None)
        positional = node in self.p.positional
        call = _Call(self, node, sig, values, env, compact=positional)
        if positional:
            # An op that reads positions along a merged dim sees it compacted, and its results
            # are laid out again as the graph's other values of that size are.
            call.arrays = [self._compacted(v, a) for v, a in zip(values, call.arrays)]
        result = rule(call) if rule is not None else call.apply()
        if positional:
            result = _map_tensors(result, node.meta.get("val"),
                                  lambda r, m: self.to_factored(r, _shape_exprs(m)))
        _check_shapes(node, result, self)
        return result

    def _compacted(self, v, a):
        if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) and hasattr(a, "shape"):
            return self.to_prefix(a, _shape_exprs(v.meta["val"]))
        if isinstance(v, list | tuple) and isinstance(a, list | tuple):
            return [self._compacted(x, y) for x, y in zip(v, a)]
        return a


class _Call:
    """One op node being evaluated: its bound arguments (``values``: nodes and constants),
    ``arrays`` (the padded values the lowering receives) and helpers for the rules."""

    def __init__(self, trace, node, sig, values, env, compact=False):
        self.t, self.node, self.sig, self.values = trace, node, sig, values
        self.compact = compact
        self.arrays = [_lookup(v, env) for v in values]
        self.metas = [trace.padded_meta(v) for v in values]
        self.env = env
        # A size used as a number (x * x.shape[1]) is its true value; as a size, its bucket's.
        for i in sig.dynamic:
            v = values[i]
            if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.SymInt):
                self.arrays[i] = jnp.asarray(trace.true(expr_of(v.meta["val"])))

    def arg(self, name):
        return self.sig.index_of[name]

    def lens(self, name_or_index):
        i = self.arg(name_or_index) if isinstance(name_or_index, str) else name_or_index
        return self.t.lens(self.values[i], self.compact)

    def exprs(self, name):
        return _shape_exprs(meta_of(self.values[self.arg(name)]))

    def mask(self, name, fill, dims=None):
        i = self.arg(name)
        if self.arrays[i] is None:
            return
        self.arrays[i] = dyn.masked(self.arrays[i], self.lens(i), fill, dims)

    def apply(self):
        result, _ = _apply(self.sig, self.values, self.arrays, self.metas, self.t.padded_meta(self.node),
                           self.t.key if self.sig.lowering.random else None)
        return result


# -- the rules -------------------------------------------------------------------------------------
RULES: dict = {}


def rule(*names):
    def register(fn):
        for n in names:
            RULES[n] = fn
        return fn
    return register


def _rule_for(name, target, node):
    """The rule of one node, or raises NoRule; None runs the lowering as it is."""
    if not _has_symbolic(node):
        return None
    for a in node.all_input_nodes:
        for e in _size_exprs(a.meta.get("val")):
            if not _grows(e):
                # An input (a backward graph's tangent of a chunk's last piece: s - 4*((s + 4)//5))
                # whose size at the buckets may be below its true size: its box would lose elements.
                raise NoRule(name, f"an input of size {e}, which does not grow with its symbols")
    fn = RULES.get(name)
    if fn is not None:
        plan = getattr(fn, "plan", None)
        if plan is not None:
            plan(node)
        return fn
    if name in _PASS or torch.Tag.pointwise in target.tags:
        return None
    raise NoRule(name, "no masking rule for an op on dynamic dims yet")


def planned(check):
    """Attach a plan-time check (raises NoRule) to a rule."""
    def attach(fn):
        fn.plan = check
        return fn
    return attach


def _dims_arg(call, name, ndim):
    i = call.arg(name)
    dims = call.values[i]
    if dims is None or dims == []:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(d % max(ndim, 1) for d in dims)


def _reduction(kind):
    def run(call):
        x = call.arrays[0]
        lens = call.lens(0)
        dims = _dims_arg(call, "dim", x.ndim) if "dim" in call.sig.index_of else tuple(range(x.ndim))
        call.arrays[0] = dyn.masked(x, lens, dyn.identity(kind, x.dtype), dims)
        out = call.apply()
        if kind == "mean":
            out = dyn.rescale_mean(out, x.shape, lens, dims)
        return out
    return run


for _kind, _names in {
    "sum": ("sum.dim_IntList", "sum.default", "nansum.default"),
    "mean": ("mean.dim", "mean.default"),
    "max": ("amax.default", "max.default"),
    "min": ("amin.default", "min.default"),
    "prod": ("prod.dim_int", "prod.default"),
    "any": ("any.dim", "any.dims", "any.default"),
    "all": ("all.dim", "all.dims", "all.default"),
    "logsumexp": ("logsumexp.default",),
}.items():
    rule(*_names)(_reduction(_kind))


def _argplan(node):
    if len(node.args) < 2 or node.args[1] is None:
        if any(not _is_static(e) for e in _shape_exprs(node.args[0].meta["val"])[1:]):
            raise NoRule(registry_name(node.target), "a flat argmax/argmin over padded inner dims")


@rule("argmax.default", "argmin.default")
@planned(_argplan)
def _arg_reduction(call):
    kind = "argmax" if call.sig.short_name.startswith("argmax") else "argmin"
    x = call.arrays[0]
    dim = call.values[1]
    dims = tuple(range(x.ndim)) if dim is None else (dim % x.ndim,)
    call.arrays[0] = dyn.masked(x, call.lens(0), dyn.identity(kind, x.dtype), dims)
    return call.apply()


def _sort_pad(dtype, descending):
    """A value the lowering's stable sort puts after every true element (ties keep the true ones
    first): NaN ascending (PyTorch sorts NaN last), the lowest value descending."""
    if descending:
        return dyn.identity("max", dtype)
    return jnp.nan if jnp.issubdtype(dtype, jnp.floating) else dyn.identity("min", dtype)


@rule("sort.default", "sort.stable", "topk.default")
def _sort(call):
    x = call.arrays[0]
    dim = call.values[call.arg("dim")]
    dim = (-1 if dim is None else dim) % x.ndim
    lens = call.lens(0)
    if lens[dim] is None:
        return call.apply()
    if "largest" in call.sig.index_of:
        descending = call.values[call.arg("largest")] in (None, True)
    else:
        descending = bool(call.values[call.arg("descending")])
    call.arrays[0] = dyn.masked(x, lens, _sort_pad(x.dtype, descending), (dim,))
    return call.apply()


@rule("var.correction", "var_mean.correction", "std.correction", "std_mean.correction")
def _var(call):
    x = call.arrays[0]
    dims = _dims_arg(call, "dim", x.ndim)
    correction = call.values[call.arg("correction")]
    if isinstance(correction, torch.fx.Node):   # a runtime scalar (eager mode)
        correction = call.arrays[call.arg("correction")]
    correction = 1 if correction is None else correction
    keepdim = bool(call.values[call.arg("keepdim")])
    v = dyn.var(x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.floating) else x,
                call.lens(0), dims, correction, keepdim)
    name = call.sig.short_name
    if name.startswith(("var_mean", "std_mean")):   # (var or std, mean)
        mean = dyn.rescale_mean(jnp.mean(dyn.masked(x, call.lens(0), 0, dims), axis=dims, keepdims=keepdim),
                                x.shape, call.lens(0), dims)
        return (jnp.sqrt(v) if name.startswith("std") else v), mean.astype(v.dtype)
    if name.startswith("std"):
        return jnp.sqrt(v)
    return v


def _contraction(a_name, a_dim, b_name, b_dim):
    def run(call):
        a, b = call.arg(a_name), call.arg(b_name)
        la, lb = call.lens(a), call.lens(b)
        da, db = a_dim % call.arrays[a].ndim, b_dim % call.arrays[b].ndim
        if la[da] is not None or lb[db] is not None:
            call.arrays[a] = dyn.masked(call.arrays[a], la, 0, (da,))
            call.arrays[b] = dyn.masked(call.arrays[b], lb, 0, (db,))
        return call.apply()
    return run


rule("mm.default")(_contraction("self", 1, "mat2", 0))
rule("bmm.default")(_contraction("self", 2, "mat2", 1))
rule("addmm.default")(_contraction("mat1", 1, "mat2", 0))
rule("baddbmm.default")(_contraction("batch1", 2, "batch2", 1))
rule("dot.default")(_contraction("self", 0, "tensor", 0))
rule("mv.default")(_contraction("self", 1, "vec", 0))
rule("addmv.default")(_contraction("mat", 1, "vec", 0))


@rule("addbmm.default")
def _addbmm(call):
    # Sums over the batch dim and contracts k: both operands' pad zeroed along both.
    call.mask("batch1", 0, (0, 2))
    call.mask("batch2", 0, (0, 1))
    return call.apply()


@rule("linalg_vector_norm.default")
def _vector_norm(call):
    # The pad of the reduced dims becomes 0, which adds nothing to a norm of order >= 0 (inf: the
    # largest |x|; 0: the count of nonzeros); for a negative order (-inf: the smallest |x|) it is
    # inf, whose |x|^ord is 0.
    x = call.arrays[0]
    order = call.values[1]
    order = 2 if order is None else order
    if isinstance(order, torch.fx.Node):
        raise NoRule("linalg_vector_norm.default", "a runtime order")
    dims = _dims_arg(call, "dim", x.ndim)
    call.mask("self", 0 if order >= 0 else jnp.inf, dims)
    return call.apply()


# Elementwise, though not tagged pointwise; the diagonal of a padded box starts with the true
# diagonal (its true length is a Min of true sizes, its padded one the same Min of buckets).
rule("log_sigmoid_forward.default", "log_sigmoid_backward.default", "diagonal.default",
     "diagonal_copy.default")(lambda call: call.apply())


@rule("_softmax.default", "_log_softmax.default")
def _softmax(call):
    x = call.arrays[0]
    dim = call.values[1] % x.ndim
    lens = call.lens(0)
    if lens[dim] is None:
        return call.apply()
    call.arrays[0] = dyn.masked(x, lens, -jnp.inf, (dim,))
    return call.apply()


@rule("_softmax_backward_data.default", "_log_softmax_backward_data.default")
def _softmax_backward(call):
    dim = call.values[2] % call.arrays[0].ndim
    if call.lens(0)[dim] is None:
        return call.apply()
    call.mask("grad_output", 0, (dim,))
    call.mask("output", 0, (dim,))
    return call.apply()


def _normalized_static(node):
    x = node.args[0 if node.target is torch.ops.aten.native_layer_norm.default else 1]
    ns = node.args[1 if node.target is torch.ops.aten.native_layer_norm.default else 2]
    exprs = _shape_exprs(x.meta["val"])
    if any(not _is_static(e) for e in exprs[len(exprs) - len(ns):]):
        raise NoRule(registry_name(node.target), "normalising over a dynamic dim")


rule("native_layer_norm.default")(planned(_normalized_static)(lambda call: call.apply()))


@rule("native_layer_norm_backward.default")
@planned(_normalized_static)
def _layer_norm_backward(call):
    # grad_weight/grad_bias sum over the (padded) leading dims: zero every input's pad.
    for name in ("grad_out", "input", "mean", "rstd"):
        call.mask(name, 0)
    return call.apply()


@rule("embedding.default")
def _embedding(call):
    call.mask("indices", 0)
    return call.apply()


def _no_freq(node):
    if len(node.args) > 4 and node.args[4]:
        raise NoRule("embedding_dense_backward.default", "scale_grad_by_freq")


@rule("embedding_dense_backward.default")
@planned(_no_freq)
def _embedding_backward(call):
    idx_lens = call.lens("indices")
    call.arrays[call.arg("indices")] = dyn.masked(call.arrays[call.arg("indices")], idx_lens, 0)
    g = call.arg("grad_output")
    glens = call.lens(g)
    call.arrays[g] = dyn.masked(call.arrays[g], glens, 0, tuple(d for d in range(len(idx_lens)) if idx_lens[d] is not None))
    return call.apply()


def _classes_static(node):
    exprs = _shape_exprs(node.args[1 if "backward" in str(node.target) else 0].meta["val"])
    if len(exprs) > 1 and not _is_static(exprs[1]):
        raise NoRule(registry_name(node.target), "a dynamic class dim")


@rule("nll_loss_forward.default", "nll_loss_backward.default")
@planned(_classes_static)
def _nll_loss(call):
    ignore = call.values[call.arg("ignore_index")]
    call.mask("target", ignore)
    call.mask("self", 0)
    if "grad_output" in call.sig.index_of and call.arrays[call.arg("grad_output")].ndim:
        call.mask("grad_output", 0)
    return call.apply()


@rule("gather.default", "index_select.default")
def _gather(call):
    call.mask("index", 0)
    return call.apply()


@rule("index_copy.default")
def _index_copy(call):
    # A static cache's update (StaticCache: keys.index_copy_(2, positions, new_keys)) with a
    # dynamic number of positions: the pad entries of the index are don't-care, so their source
    # rows are dropped instead of written (a pad index could name a true row).
    x = call.arrays[0]
    dim = call.values[1] % x.ndim
    n = call.lens("index")[0]
    if n is None:
        return call.apply()
    if call.lens(0)[dim] is not None:   # (a cache's length compiled in is no padded dim)
        raise NoRule("index_copy.default", "copying along a padded dim of self")
    index = call.arrays[call.arg("index")].reshape(-1)
    valid = lax.iota(jnp.int32, index.shape[0]) < n
    checks.index_in_range(jnp.where(valid, index, 0), x.shape[dim],
                          "index_copy_(): " + checks.out_of_bounds(dim, x.shape[dim]), negative=False)
    where = (slice(None),) * dim + (jnp.where(valid, index, x.shape[dim]),)
    return x.at[where].set(call.arrays[call.arg("source")].astype(x.dtype), mode="drop")


@rule("index.Tensor", "_unsafe_index.Tensor")
def _index(call):
    i = call.arg("indices")
    xlens = call.lens("self")
    out = []
    for d, (idx, v) in enumerate(zip(call.arrays[i], call.values[i])):
        if idx is None:
            out.append(None)
            continue
        if idx.dtype == jnp.bool_:
            raise NoRule("index.Tensor", "boolean-mask indexing")
        idx = dyn.masked(idx, call.t.lens(v, call.compact), 0)
        if xlens[d] is not None:
            idx = dyn.wrap_negative(idx, xlens[d])
        out.append(idx)
    call.arrays[i] = out
    return call.apply()


def _arange_plan(node):
    name = registry_name(node.target)
    if name != "arange.default":
        args = list(node.args) + [node.kwargs.get("step", 1)]
        start, step = args[0], args[2] if len(args) > 2 else 1
        if isinstance(start, torch.fx.Node) or isinstance(step, torch.fx.Node):
            raise NoRule(name, "a dynamic start or step")


rule("arange.default", "arange.start", "arange.start_step")(planned(_arange_plan)(lambda call: call.apply()))


@rule("cat.default")
def _cat(call):
    tensors = [t for t in call.values[0]]
    dim = call.values[1] % call.arrays[0][0].ndim if call.values[1] is not None else 0
    out_expr = _shape_exprs(call.node.meta["val"])[dim]
    if _is_static(out_expr):
        return call.apply()
    arrays = [a for a in call.arrays[0]]
    keep = [k for k, a in enumerate(arrays) if a.ndim > 0 and not (a.ndim == 1 and a.shape[0] == 0)]
    dtype = jax_dtype(call.node.meta["val"].dtype)
    return dyn.cat([arrays[k].astype(dtype) for k in keep], [call.t.lens(tensors[k], call.compact) for k in keep], dim,
                   call.t.padded_int(out_expr))


def _split_plan(node):
    exprs = _shape_exprs(node.args[0].meta["val"])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if not _is_static(exprs[dim % len(exprs)]):
        raise NoRule(registry_name(node.target), "splitting a dynamic dim")


rule("split.Tensor", "split_with_sizes.default")(planned(_split_plan)(lambda call: call.apply()))


def _along(call):
    """(self, the op's dim, self's true sizes) of an op along one dim (slice, select)."""
    x = call.arrays[0]
    return x, call.values[1] % x.ndim, call.lens(0)


@rule("slice.Tensor")
def _slice(call):
    x, dim, lens = _along(call)
    if lens[dim] is None:
        return call.apply()
    step = call.values[4] if len(call.values) > 4 and call.values[4] is not None else 1
    if not isinstance(step, int) or step < 1:
        raise NoRule("slice.Tensor", "a dynamic step along a dynamic dim")
    start = call.values[2]
    start = 0 if start is None else start
    if isinstance(start, torch.fx.Node):
        start = call.t.true(expr_of(start.meta["val"]))
    if isinstance(start, int) and start < 0:
        start = jnp.maximum(start + lens[dim], 0)
    out_len = call.t.padded_int(_shape_exprs(call.node.meta["val"])[dim])
    if step != 1:
        # Element k of the result is x[start + k * step] (exact while k is below the true length).
        if x.shape[dim] == 0 or out_len == 0:
            return jax.lax.slice_in_dim(x, 0, 0, axis=dim) if out_len == 0 else \
                jnp.zeros(x.shape[:dim] + (out_len,) + x.shape[dim + 1:], x.dtype)
        idx = jnp.asarray(start).astype(jnp.int32) + lax.iota(jnp.int32, out_len) * step
        return jnp.take(x, jnp.clip(idx, 0, x.shape[dim] - 1), axis=dim)
    if isinstance(start, int) and start == 0:
        return jax.lax.slice_in_dim(x, 0, out_len, axis=dim)
    return dyn.slice_from(x, dim, start, out_len)


@rule("select.int")
def _select(call):
    x, dim, lens = _along(call)
    if lens[dim] is None:
        return call.apply()
    index = call.values[2]
    if isinstance(index, torch.fx.Node):
        index = call.t.true(expr_of(index.meta["val"]))
    return dyn.select(x, dim, index, lens[dim])


@rule("constant_pad_nd.default")
def _constant_pad(call):
    # Per padded dim (pad lists the last dim first, (before, after) each; negative pads crop):
    # out[i] = x[i - before] where 0 <= i - before < the true size, else the value.
    x = call.arrays[0]
    lens = call.lens(0)
    pad = [int(p) for p in call.values[1]]
    value = call.values[2] if len(call.values) > 2 and call.values[2] is not None else 0
    if isinstance(value, torch.fx.Node):
        value = call.arrays[2]
    out_exprs = _shape_exprs(call.node.meta["val"])
    for k in range(len(pad) // 2):
        d = x.ndim - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        if before == 0 and after == 0:
            continue
        n_out = call.t.padded_int(out_exprs[d])
        true = x.shape[d] if lens[d] is None else jnp.asarray(lens[d]).astype(jnp.int32)
        src = lax.iota(jnp.int32, n_out) - before
        valid = (src >= 0) & (src < true)
        taken = jnp.take(x, jnp.clip(src, 0, x.shape[d] - 1), axis=d) if x.shape[d] else \
            jnp.zeros(x.shape[:d] + (n_out,) + x.shape[d + 1:], x.dtype)
        shape = [1] * x.ndim
        shape[d] = n_out
        x = jnp.where(valid.reshape(shape), taken, jnp.asarray(value, x.dtype))
    return x


def _scatter_along(call, dim, start, length, piece, step=1):
    """``self`` with ``piece`` (laid along ``dim`` from 0) written at true positions
    start, start + step, ... (``length`` of them) of ``dim``; the rest of ``self`` kept."""
    x = call.arrays[0]
    n = piece.shape[dim]
    if n == 0:
        return x
    start = jnp.asarray(start).astype(jnp.int32)
    rel = lax.iota(jnp.int32, x.shape[dim]) - start
    k = rel // step
    inside = (rel >= 0) & (rel % step == 0) & (k < jnp.asarray(length).astype(jnp.int32))
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    src = jnp.take(piece, jnp.clip(k, 0, n - 1), axis=dim)
    return jnp.where(inside.reshape(shape), src.astype(x.dtype), x)


def _true_int(call, v):
    return call.t.true(expr_of(v.meta["val"])) if isinstance(v, torch.fx.Node) else v


@rule("slice_scatter.default")
def _slice_scatter(call):
    # The backward of slicing a dynamic dim: src goes at the true offset (a negative start counts
    # from the true end), the rest of self is kept.
    x = call.arrays[0]
    dim = call.values[2] % x.ndim if call.values[2] is not None else 0
    lens = call.lens(0)
    if lens[dim] is None:
        return call.apply()
    step = _true_int(call, call.values[5]) if len(call.values) > 5 and call.values[5] is not None else 1
    if not isinstance(step, int) or step < 1:
        raise NoRule("slice_scatter.default", "a dynamic step along a dynamic dim")
    start = _true_int(call, call.values[3])
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        start = jnp.maximum(start + lens[dim], 0)
    src_len = call.lens(1)[dim]
    src_len = call.arrays[1].shape[dim] if src_len is None else src_len
    return _scatter_along(call, dim, start, src_len, call.arrays[1], step)


@rule("select_scatter.default")
def _select_scatter(call):
    x = call.arrays[0]
    dim = call.values[2] % x.ndim
    lens = call.lens(0)
    if lens[dim] is None:
        return call.apply()
    index = _true_int(call, call.values[3])
    index = jnp.where(index < 0, index + lens[dim], index) if not isinstance(index, int) or index < 0 else index
    return _scatter_along(call, dim, index, 1, jnp.expand_dims(call.arrays[1], dim))


@rule("flip.default")
def _flip(call):
    # Along a dynamic dim the true elements reversed are x[len - 1 - i]: a gather of the padded
    # array at (len - 1 - i) mod padded (the pad positions read pad elements, don't-care).
    x = call.arrays[0]
    lens = call.lens(0)
    for d in sorted({d % max(x.ndim, 1) for d in call.values[1]}):
        if lens[d] is None:
            x = jnp.flip(x, d)
            continue
        n = x.shape[d]
        idx = (jnp.asarray(lens[d]).astype(jnp.int32) - 1 - lax.iota(jnp.int32, n)) % n
        x = jnp.take(x, idx, axis=d)
    return x


@rule("view.default", "_unsafe_view.default", "reshape.default")
def _view(call):
    t = call.t
    x = call.arrays[0]
    in_exprs = _shape_exprs(meta_of(call.values[0]))
    out_exprs = _shape_exprs(call.node.meta["val"])
    padded_out = tuple(t.padded_int(e) for e in out_exprs)
    if _same_factors(in_exprs, out_exprs, t.p.order):
        # The padded box is laid out the same way on both sides: a plain reshape.
        return x.reshape(padded_out)
    x = t.to_prefix(x, in_exprs)
    y = dyn.reshape(x, [t.true(e) for e in in_exprs], [t.true(e) for e in out_exprs], padded_out)
    return t.to_factored(y, out_exprs)


def _same_factors(in_exprs, out_exprs, order) -> bool:
    """Both shapes split into the same row-major factors (adjacent static factors merged)."""
    def flat(exprs):
        out = []
        for e in exprs:
            for f in factors(e, order):
                if _is_static(f):
                    if int(f) == 1:
                        continue
                    if out and _is_static(out[-1]):
                        out[-1] = sympy.Integer(int(out[-1]) * int(f))
                        continue
                out.append(f)
        return out
    a, b = flat(in_exprs), flat(out_exprs)
    return len(a) == len(b) and all(sympy.simplify(x - y) == 0 for x, y in zip(a, b))


def _sdpa_parts(node):
    """(backward, query, key, is_causal, attn_mask) of an attention node."""
    backward = "backward" in str(node.target)
    q, k = node.args[1 if backward else 0], node.args[2 if backward else 1]
    at = 7 if backward else 4
    causal = node.args[at] if len(node.args) > at else node.kwargs.get("is_causal", False)
    return backward, q, k, causal, node.kwargs.get("attn_mask")


def _sdpa_plan(node):
    backward, q, k, causal, mask = _sdpa_parts(node)
    qe, ke = _shape_exprs(q.meta["val"]), _shape_exprs(k.meta["val"])
    same_causal = causal and qe[-2] == ke[-2]
    if backward and mask is not None:
        raise NoRule(registry_name(node.target), "the backward of attention with a mask")
    if not _is_static(ke[-2]) and not same_causal and (backward or causal):
        raise NoRule(registry_name(node.target), "causal attention over dynamic keys of another length "
                                                 "than the queries'" if causal else
                     "the backward of attention over dynamic keys without is_causal")


@rule("_scaled_dot_product_flash_attention_for_cpu.default",
      "_scaled_dot_product_flash_attention_for_cpu_backward.default")
@planned(_sdpa_plan)
def _sdpa(call):
    # Causal attention with queries and keys of one dynamic length: a true query never sees a
    # pad key; zeroing every input's pad keeps the pad rows finite (their gradients are zero).
    # Attention over dynamic keys otherwise (a decode step's growing cache, no mask or the user's):
    # pad keys are masked out.
    backward, _, _, causal, _ = _sdpa_parts(call.node)
    key_len = call.lens("key")[-2]
    if not backward and key_len is not None and not (causal and call.lens("query")[-2] is key_len):
        q = call.arrays[call.arg("query")]
        k = call.arrays[call.arg("key")]
        valid = lax.broadcasted_iota(jnp.int32, (q.shape[-2], k.shape[-2]), 1) < key_len
        i = call.arg("attn_mask")
        m = call.arrays[i]
        if m is None:
            m = valid
        elif m.dtype == jnp.bool_:
            m = m & valid
        else:
            m = jnp.where(valid, m, jnp.asarray(-jnp.inf, m.dtype))
        call.arrays[i] = m
        call.metas[i] = torch.empty(m.shape, dtype=torch.bool if m.dtype == jnp.bool_ else call.metas[
            call.arg("query")].dtype, device="meta")
    for name in ("grad_out", "query", "key", "value", "out", "logsumexp"):
        if name in call.sig.index_of:
            call.mask(name, 0)
    return call.apply()


# -- helpers ---------------------------------------------------------------------------------------
def _padded(expr, buckets) -> int:
    if _is_static(expr):
        return int(expr)
    return int(evaluate(expr, buckets))


def _free_symbols(val):
    out = set()
    if isinstance(val, torch.Tensor):
        for s in (*val.shape, *val.stride()):
            if isinstance(s, torch.SymInt):
                out |= expr_of(s).free_symbols
    elif isinstance(val, torch.SymInt):
        out |= expr_of(val).free_symbols
    elif isinstance(val, list | tuple):
        for v in val:
            out |= _free_symbols(v)
    return out


def _touches_compound(node, order) -> bool:
    for v in (node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)):
        if any(compound(e, order) for e in _size_exprs(v)):
            return True
    return False


def _map_tensors(result, meta, fn):
    if isinstance(meta, torch.Tensor) and hasattr(result, "shape"):
        return fn(result, meta)
    if isinstance(meta, list | tuple) and isinstance(result, list | tuple):
        return type(result)(_map_tensors(r, m, fn) for r, m in zip(result, meta))
    return result


def _size_exprs(val):
    if isinstance(val, torch.Tensor):
        return [expr_of(x) for x in val.shape if isinstance(x, torch.SymInt)]
    if isinstance(val, list | tuple):
        return [e for v in val for e in _size_exprs(v)]
    return []


def _grows(expr) -> bool:
    """Whether ``expr`` never decreases when a symbol grows (then its value at the buckets bounds
    its true value): sums and products of symbols with positive coefficients, floor divisions and
    maxima/minima of such."""
    if _is_static(expr) or isinstance(expr, sympy.Symbol):
        return True
    if isinstance(expr, FloorDiv):
        return _grows(expr.args[0]) and _is_static(expr.args[1]) and int(expr.args[1]) > 0
    if type(expr).__name__ in ("Max", "Min"):
        return all(_grows(a) for a in expr.args)
    for term in sympy.Add.make_args(sympy.expand(expr)):
        if not term.free_symbols:
            continue
        coeff, rest = term.as_coeff_Mul()
        if coeff <= 0 or any(not (isinstance(f, sympy.Symbol) or (isinstance(f, sympy.Pow) and f.args[1] > 0))
                             for f in sympy.Mul.make_args(rest)):
            return False
    return True


def _has_symbolic(node) -> bool:
    if _free_symbols(node.meta.get("val")):
        return True
    for a in node.all_input_nodes:
        if _free_symbols(a.meta.get("val")):
            return True
    return False


def _flat(out):
    return list(out) if isinstance(out, list | tuple) else [out]


def _op_name(node) -> str:
    t = node.target
    return registry_name(t) if isinstance(t, torch._ops.OpOverload) else str(getattr(t, "__name__", t))


def _check_shapes(node, result, trace):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and hasattr(result, "shape"):
        want = tuple(trace.padded_int(expr_of(s)) for s in val.shape)
        if tuple(result.shape) != want:
            raise NoRule(_op_name(node), f"produced shape {tuple(result.shape)} on padded inputs, "
                                         f"expected {want}")


__all__ = ["BucketedProgram", "NoRule", "RULES", "bucket_for", "parse_buckets"]
