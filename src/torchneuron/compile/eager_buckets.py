"""Bucketed dynamic dimensions in eager mode (``config.shapes = "bucketed"``): a new length reuses
each op's executable for its bucket instead of compiling one per shape.

An eager op's first shape compiles its exact executable, as always. When the same op (same
dtypes, ranks, storages and compiled-in arguments other than sizes) comes again with other sizes,
the dims (and integer arguments: ``arange(n)``, ``ones(n, n)``) that changed are **dynamic** from
then on, as Dynamo's automatic dynamic shapes decide. The op is then traced once per *bucket* of
those sizes, as a one-node symbolic ATen graph evaluated by the bucketed graph machinery
(``compile/dynamic.py``: the masking rules of ``ops/dynamic.py``): its inputs are read from their
storages as padded boxes with their true sizes, strides and offsets as runtime inputs, and its
results are written into storages of the box's capacity (``StorageRecord.boxed``), laid out as the
true tensors, so the next op reads them without a copy. Sizes, strides, views and in-place
semantics are the user's as before: only a storage's capacity is a bucket's.

What is not bucketed compiles per shape, as with ``config.shapes = "static"``, and is counted
(``metrics()["extra"]["bucketed_eager_fallback: <op> (<why>)"]``): in-place and ``out=`` ops,
random ops, 64-bit floating point, sizes of 0 or 1, ops without a rule, and adaptive eager's
recorded regions.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import sympy
import torch
from jax import lax
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .. import seams
from ..config import config
from ..metrics import metrics
from ..ops import checks
from ..ops import dynamic as dyn
from ..ops.signature import OPT_TENSOR_LIST, TENSOR_LIST, registry_name
from ..runtime import donation, inputs, layout, memory, pjrt, sites
from ..runtime.dtypes import jax_dtype
from ..runtime.executable import Executable
from ..runtime.inputs import CPU_SCALAR, EMPTY, is_view
from . import cache
from .dynamic import (
    _RANDOM_ELEMENTWISE,
    BucketedProgram,
    NoRule,
    _padded,
    _shape_exprs,
    _Trace,
    bucket_for,
    contiguous_tail,
    give_capacity,
    parse_buckets,
)

_REASON = "a new shape bucket (config.shapes='bucketed')"
# Ops that copy elements one to one, as elementwise ops do (they carry no pointwise tag).
_COPIES = frozenset({"clone.default", "_to_copy.default", "alias_copy.default"})
_LISTS = (TENSOR_LIST, OPT_TENSOR_LIST)
_WIDE = (torch.float64, torch.complex128)


class _Family:
    """The calls of one op at one user line whose sizes vary in a few positions only."""

    __slots__ = ("first", "dynamic")

    def __init__(self, first):
        self.first = first          # the sizes of the first call
        self.dynamic = frozenset()  # positions seen with another size since


def _family(families: list, numbers, free=frozenset()) -> _Family:
    """The family of a call's sizes: one whose other sizes all match, else the nearest one whose
    differing sizes all scale by one factor (a length and the dims derived from it: ``t``,
    ``b*t``), whose differing positions become dynamic, else a new one. A line that runs an op at
    unrelated shapes (``self.out(gelu(self.fc(x)))``: two weights, 256 -> 64 and 64 -> 256) gets
    one family per shape; a varying length, one family whose length dims are dynamic. Positions in
    ``free`` (storage sizes: a bucket's capacity, or a growing buffer's) may vary on their own."""
    best, best_diff = None, None
    for fam in families:
        # Sizes 0 and 1 are their own shapes (Dynamo specialises them): a decode step's one query
        # is not a prompt length.
        diff = [i for i, (a, b) in enumerate(zip(fam.first, numbers))
                if a != b and (i not in fam.dynamic or b <= 1)]
        if not diff:
            return fam
        if any(fam.first[i] <= 1 or numbers[i] <= 1 for i in diff):
            continue
        scaled = [i for i in diff if i not in free]
        if scaled:
            a0, b0 = fam.first[scaled[0]], numbers[scaled[0]]
            if any(fam.first[i] * b0 != numbers[i] * a0 for i in scaled):
                continue
        if best_diff is None or len(diff) < len(best_diff):
            best, best_diff = fam, diff
    if best is not None:
        best.dynamic = best.dynamic | frozenset(best_diff)
        return best
    fam = _Family(tuple(numbers))
    if len(families) < 64:
        families.append(fam)
    return fam


_history: dict = {}     # shape-free signature and user line -> [_Family, ...]
_programs: dict = {}    # bucket key -> compiled program
_refused: dict = {}     # (signature, dynamic positions, sharing) -> why it is not bucketed
# Exact key of a call whose storages were given a bucket's capacity -> (its executable, the
# (slot, capacity) given): the key a fresh storage (a prompt from the host, a new factory result)
# has before it grows, so a length seen before costs no planning.
_regrown: dict = {}


def clear(_setting=None) -> None:
    _history.clear()
    _programs.clear()
    _refused.clear()
    _regrown.clear()


# -- what a call's key says about sizes ---------------------------------------------------------------
def _shape_free(kernel, specs, statics, storages):
    """(signature without sizes, the sizes in order, where each size is): view specs without their
    sizes and strides, integer arguments without their values, storages without their sizes (a
    token's view of the ids that grow every decode step)."""
    numbers, where = [], []
    for slot, (numel, _) in enumerate(storages):
        numbers.append(numel)
        where.append(("storage", slot, None))
    free = []
    for j, ((_, kind), spec) in enumerate(zip(kernel.inputs, specs)):
        if kind in _LISTS and spec is not None:
            items = []
            for p, s in enumerate(spec):
                items.append(_view_free(s, ("spec", j, p), numbers, where))
            free.append(tuple(items))
        else:
            free.append(_view_free(spec, ("spec", j, None), numbers, where))
    free_statics = []
    for j, v in enumerate(statics):
        if v.__class__ is int:
            numbers.append(v)
            where.append(("static", j, None))
            free_statics.append(int)
        elif isinstance(v, tuple) and v and all(x.__class__ is int for x in v):
            for p, x in enumerate(v):
                numbers.append(x)
                where.append(("static", j, p))
            free_statics.append((int, len(v)))
        else:
            free_statics.append(v)
    return tuple(free), tuple(free_statics), numbers, where


def _view_free(spec, at, numbers, where):
    if not is_view(spec):
        return spec
    dtype, sizes, strides, offset, slot = spec
    for d, n in enumerate(sizes):
        numbers.append(n)
        where.append((*at, d))
    # Whether the innermost dim has stride 1 decides how a program reads the view (``box_read``):
    # a line that runs an op on both kinds (``q @ k.transpose(-2, -1)`` copies q and k^T) learns
    # which sizes vary for each kind apart, so k^T's head size is not taken for a length.
    return (dtype, len(sizes), slot, contiguous_tail(sizes, strides) > 0)


# -- the eager entry point ------------------------------------------------------------------------------
def bucketer(kernel, key, values, specs, ctx, plan):
    """The executable for a call that missed the exact cache: a bucketed one when sizes of this op
    varied before and it has a rule, else ``plan()`` (the exact executable, not compiled yet)."""
    known = _regrown.get(key)
    if known is not None and _regrow(known[1], ctx):
        return known[0]
    before = tuple(ctx.storages)
    exe = _bucketed(kernel, key, values, specs, ctx, plan())
    if exe.boxed and tuple(ctx.storages) != before:
        _regrown[key] = (exe, tuple((slot, numel) for slot, ((numel, _), old) in
                                    enumerate(zip(ctx.storages, before)) if numel != old[0]))
    return exe


def _regrow(grow, ctx) -> bool:
    """Give the storages of a call the capacities an earlier call with the same key got; False if
    one of them has another capacity already (the call is then planned as new)."""
    for slot, numel in grow:
        rec = memory.allocator.records[ctx.addrs[slot]]
        if rec.boxed and rec.numel != numel:
            return False
    for slot, numel in grow:
        rec = memory.allocator.records[ctx.addrs[slot]]
        if not rec.boxed:
            give_capacity(rec, numel)
        ctx.bufs[slot] = memory.empty_buffer(rec)
        ctx.storages[slot] = (rec.numel, rec.dtype)
    return True


def _bucketed(kernel, key, values, specs, ctx, planned):
    inplace = bool(planned.writes)
    if inplace and not _plain_inplace(kernel, planned, values):
        return planned
    if kernel.lowering.random and registry_name(kernel.overload) not in _RANDOM_ELEMENTWISE:
        return planned
    free_specs, free_statics, numbers, where = _shape_free(kernel, specs, key[2], key[3])
    if not numbers:
        return planned
    signature = (kernel, free_specs, free_statics, key[4], key[5], key[6])
    # Which sizes vary is learnt per user line (as Dynamo learns it per frame): one kernel serves
    # every layer's weights.
    families = _history.setdefault((signature, sites.place(sys._getframe())), [])
    dynamic = _family(families, numbers, frozenset(i for i, w in enumerate(where) if w[0] == "storage")).dynamic
    if not dynamic or any(numbers[i] <= 1 for i in dynamic):
        return planned
    # Storages whose size varies get a bucket's capacity (a power of two): keys stay bounded.
    grown = [where[i][1] for i in dynamic if where[i][0] == "storage"]
    dynamic = tuple(sorted(i for i in dynamic if where[i][0] != "storage"))
    # Dims of equal size share one symbol (as Dynamo's duck shaping): part of the key.
    distinct = list(dict.fromkeys(numbers[i] for i in dynamic))
    sharing = tuple(distinct.index(numbers[i]) for i in dynamic)
    refused_key = (signature, dynamic, sharing)
    if refused_key in _refused:
        return _fall_back(kernel, _refused[refused_key], planned)
    if any(spec is not None and spec[0] in _WIDE for spec in planned.out_specs) or \
            any(is_view(s) and s[0] in _WIDE for s in inputs.views(specs)):
        return _refuse(refused_key, kernel, "64-bit floating point", planned)
    ladder = parse_buckets(config.shape_buckets)
    try:
        buckets = tuple(bucket_for(v, ladder, f"a dynamic size of {kernel.name}") for v in distinct)
    except ValueError:
        return planned     # above the largest bucket: this shape compiles as it is
    dyn_at = {where[i]: sharing[k] for k, i in enumerate(dynamic)}
    boxes = _give_capacity(kernel, specs, dyn_at, buckets, ctx)
    for slot in grown:
        rec = memory.allocator.records[ctx.addrs[slot]]
        if not rec.boxed:
            give_capacity(rec, memory.box_capacity(rec.numel))
            ctx.bufs[slot] = memory.empty_buffer(rec)
            ctx.storages[slot] = (rec.numel, rec.dtype)
    static_numbers = tuple(n for i, n in enumerate(numbers) if i not in set(dynamic)
                           and where[i][0] != "storage")
    # Whether each view's offset is a runtime input is the program's (a view of a whole storage of
    # exactly its size reads from 0), not the family's.
    offsets = tuple(v[inputs.OFFSET] is None for v in inputs.views(specs))
    # Which layouts the program reads faster (rows, storage order): the program's too.
    tails = _layouts(kernel, specs, dyn_at)
    # Whether each result is row-major is the call's (its meta kernel on symbolic sizes may say
    # contiguous where the call keeps a permuted layout), and the program's.
    row_major = tuple(contiguous_tail(o[1], o[2]) == len(o[1]) for o in planned.out_specs if o is not None)
    bkey = (signature, dynamic, sharing, static_numbers, offsets, tails, row_major, buckets, tuple(ctx.storages))
    program = _programs.get(bkey)
    try:
        if program is None:
            program = _EagerProgram(kernel, values, specs, key[2], dyn_at, distinct, buckets, ctx, row_major)
        exe = program.executable(planned, distinct, boxes, specs, ctx)
    except NoRule as err:
        return _refuse(refused_key, kernel, f"{err.op}: {err.why}", planned)
    _programs[bkey] = program
    return exe


def _views_at(kernel, specs):
    """(position in dyn_at, view spec) of every tensor argument, in reading order."""
    for j, ((_, kind), spec) in enumerate(zip(kernel.inputs, specs)):
        listed = kind in _LISTS and spec is not None
        for p, s in enumerate(spec if listed else (spec,)):
            if is_view(s):
                yield ("spec", j, p if listed else None), s


def _layouts(kernel, specs, dyn_at) -> tuple:
    """Per view: (its row-major trailing dims that are not dynamic, whether it is row-major
    throughout, whether its innermost dim has stride 1), what decides how a program reads it
    (``box_read``)."""
    out = []
    for at, s in _views_at(kernel, specs):
        static = 0
        for d in reversed(range(len(s[1]))):
            if (*at, d) in dyn_at:
                break
            static += 1
        tail = contiguous_tail(s[1], s[2])
        out.append((min(tail, static), tail == len(s[1]), tail > 0))
    return tuple(out)


def _plain_inplace(kernel, planned, values) -> bool:
    """An in-place op this path serves: it writes only ``self`` (of the buffer's own dtype) and
    returns it."""
    if kernel.mutated != [0] or planned.out_specs or len(planned.writes) != 1:
        return False
    t = values[0]
    return isinstance(t, torch.Tensor) and memory.record_of(t).dtype is t.dtype


def _refuse(refused_key, kernel, why, planned):
    _refused[refused_key] = why
    return _fall_back(kernel, why, planned)


def _fall_back(kernel, why, planned):
    metrics.extra["bucketed_eager_fallbacks"] += 1
    metrics.extra[f"bucketed_eager_fallback: {kernel.short_name} ({why})"] += 1
    return planned


def _give_capacity(kernel, specs, dyn_at, buckets, ctx):
    """Each view with a dynamic dim: its storage given a bucket's capacity if it has none yet
    (``memory.recapacity``, counted); the view specs with a dynamic dim, in reading order."""
    boxes = []
    for at, s in _views_at(kernel, specs):
        if any((*at, d) in dyn_at for d in range(len(s[1]))):
            padded = [buckets[dyn_at[(*at, d)]] if (*at, d) in dyn_at else size for d, size in enumerate(s[1])]
            slot = s[inputs.SLOT]
            rec = memory.allocator.records[ctx.addrs[slot]]
            if not rec.boxed:
                give_capacity(rec, int(np.prod(padded)))
                ctx.bufs[slot] = memory.empty_buffer(rec)
                ctx.storages[slot] = (rec.numel, rec.dtype)
            boxes.append(s)
    return boxes


# -- one op as a symbolic graph ----------------------------------------------------------------------
class _EagerProgram:
    """One op traced for one bucket of its dynamic sizes, compiled once."""

    def __init__(self, kernel, values, specs, statics, dyn_at, distinct, buckets, ctx, row_major):
        self.kernel = kernel
        # An in-place op is traced as its functional twin where it has one (``add_`` -> ``add``),
        # else as itself; its new value of self is written back into self's storage.
        self.inplace = kernel.mutated == [0]
        target = kernel.functional if self.inplace and kernel.functional is not None else kernel.overload
        shape_env = ShapeEnv()
        self.symbols = [sympy.Symbol(f"s{k}", positive=True, integer=True) for k in range(len(distinct))]
        syms = []
        for k, v in enumerate(distinct):
            sym = shape_env.create_symbol(v, source=_source(f"s{k}"))
            if not isinstance(sym, sympy.Symbol):
                raise NoRule(kernel.short_name, f"the size {v} is specialised")
            syms.append(shape_env.create_symintnode(sym, hint=v))
        self.symbols = [s.node.expr for s in syms]
        graph = torch.fx.Graph()
        self.reads = []          # per placeholder: ("view", spec, dynamic) | ("value", spec) | ("size",)
        fake_values = list(values)
        node_values = list(values)
        mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)

        def placeholder(val, read):
            ph = graph.placeholder(f"a{len(self.reads)}")
            ph.meta["val"] = val
            self.reads.append(read)
            return ph

        with mode:
            for j, ((i, kind), spec) in enumerate(zip(kernel.inputs, specs)):
                v = values[i]
                if kind in _LISTS and spec is not None:
                    fakes, nodes = [], []
                    for p, (t, s) in enumerate(zip(v, spec)):
                        f = None if t is None else self._fake(t, s, ("spec", j, p), dyn_at, syms)
                        fakes.append(f)
                        nodes.append(None if t is None else placeholder(f, self._read(s, f)))
                    fake_values[i], node_values[i] = fakes, nodes
                    continue
                if spec is None:
                    continue
                f = self._fake(v, spec, ("spec", j, None), dyn_at, syms)
                fake_values[i] = f
                node_values[i] = placeholder(f, self._read(spec, f))
            for j, i in enumerate(kernel.static):
                v = values[i]
                if ("static", j, None) in dyn_at:
                    s = syms[dyn_at[("static", j, None)]]
                    fake_values[i] = s
                    node_values[i] = placeholder(s, ("size",))
                elif isinstance(v, list | tuple) and any(("static", j, p) in dyn_at for p in range(len(v))):
                    fakes, nodes = [], []
                    for p, x in enumerate(v):
                        if ("static", j, p) in dyn_at:
                            s = syms[dyn_at[("static", j, p)]]
                            fakes.append(s)
                            nodes.append(placeholder(s, ("size",)))
                        else:
                            fakes.append(x)
                            nodes.append(x)
                    fake_values[i], node_values[i] = fakes, nodes
            pos, kw = kernel.split_call(fake_values)
            try:
                out = target(*pos, **kw)
            except Exception as err:  # noqa: BLE001 - no symbolic meta kernel: compiled per shape
                raise NoRule(kernel.short_name, f"its meta kernel on symbolic sizes: {type(err).__name__}") from None
        pos, kw = kernel.split_call(node_values)
        node = graph.call_function(target, tuple(pos), kw)
        node.meta["val"] = out
        self.node = node
        if isinstance(out, list | tuple):
            outs = []
            for k, o in enumerate(out):
                if o is None:
                    continue
                g = graph.call_function(__import__("operator").getitem, (node, k))
                g.meta["val"] = o
                outs.append(g)
            graph.output(tuple(outs))
        else:
            graph.output((node,))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        self.program = _Planned(gm, "eager", name=kernel.short_name, buckets=config.shape_buckets)
        self.program.out_row_major = list(row_major)
        self.bucket_values = dict(zip(self.symbols, buckets))
        outs = [k for k in self.program.output_kinds if k[0] == "array"]
        if len(outs) != len(self.program.output_kinds) and not self.inplace:
            raise NoRule(kernel.short_name, "a result that aliases an input")
        self.device_index = ctx.device_index
        self.nbufs, self.nruntime = len(ctx.bufs), len(ctx.runtime)
        self.flat = self._flat_elementwise(target, out)
        self.flat_out_exprs = _shape_exprs(out) if self.flat else None
        self.compiled = None
        self.donated = ()
        self.checks = ()

    def _flat_elementwise(self, target, out) -> bool:
        """Whether the op can run on its inputs' storages as they are, with no box read or write: an
        elementwise op whose one result is row-major, each dynamic input a row-major view of the
        result's sizes (its data is in the result's element order) and every other input static
        and no wider than the result's trailing static dims (it broadcasts the same way over the
        storage's order as over the box's)."""
        elementwise = torch.Tag.pointwise in target.tags or registry_name(target) in _COPIES
        if self.inplace or not elementwise or not isinstance(out, torch.Tensor):
            return False
        if not self.program.out_row_major[0]:
            return False
        out_exprs = _shape_exprs(out)
        static_tail = 0
        for e in reversed(out_exprs):
            if not isinstance(e, sympy.Integer):
                break
            static_tail += 1
        for ph, read in zip(self.program.placeholders, self.reads):
            v = ph.meta["val"]
            if read[0] in ("scalar",):
                continue
            if read[0] == "size" or not isinstance(v, torch.Tensor):
                return False
            if read[0] == "view" and read[2]:
                spec = read[1]
                exprs = _shape_exprs(v)
                # The result's sizes, or the last of them (a [t, t] mask over [b, h, t, t] scores).
                if not exprs or exprs != out_exprs[len(out_exprs) - len(exprs):] \
                        or contiguous_tail(spec[1], spec[2]) != len(spec[1]):
                    return False
            elif v.dim() > static_tail or any(isinstance(s, torch.SymInt) for s in v.shape):
                return False
        return True

    def _fake(self, t, spec, at, dyn_at, syms):
        if spec.__class__ is type:                      # a runtime scalar
            return t if not isinstance(t, torch.Tensor) else t.item()
        if spec[0] == CPU_SCALAR:
            return torch.empty((), dtype=t.dtype, device="cpu")
        if spec[0] == EMPTY:
            return torch.empty(spec[2], dtype=spec[1], device="neuron")
        sizes = [syms[dyn_at[(*at, d)]] if (*at, d) in dyn_at else n for d, n in enumerate(spec[1])]
        return torch.empty(sizes, dtype=spec[0], device="neuron")

    @staticmethod
    def _read(spec, fake):
        if is_view(spec):
            dynamic = any(isinstance(s, torch.SymInt) for s in fake.shape)
            return ("view", spec, dynamic)
        if spec.__class__ is type:     # a scalar: a runtime input
            return ("scalar", fake)
        return ("value", spec)

    def executable(self, planned, distinct, boxes, specs, ctx):
        """The exact key's executable: this program with the call's true sizes, the strides of its
        dynamic views (``boxes``) and its output layouts bound as its last inputs."""
        extras = [np.asarray(v, np.int64) for v in distinct]
        extras.extend(np.asarray(s[inputs.STRIDES], np.int64) for s in boxes)
        for _, sizes, strides in planned.out_specs:
            extras.append(np.asarray((*sizes, *strides), np.int64))
        # On the device once: jit would otherwise copy each host array at every call (and the
        # first call must see them as every later one does, or jit compiles twice).
        extras = [memory.jax_put(v, self.device_index) for v in extras]
        first = []     # the results of the call that compiled the program, handed to that call
        if self.compiled is None:
            # The storage an in-place op writes donates its buffer (XLA updates it where it is).
            first.append(self.compile_with(ctx.bufs, ctx.runtime, extras, specs, donation.argnums(planned.writes)))
        compiled = self.compiled

        def call(*flat):
            if first:
                return first.pop()
            return compiled(*flat, *extras)

        exe = Executable(call, self.kernel.short_name, planned.writes, planned.check_mode, self.checks,
                         out_specs=planned.out_specs)
        exe.boxed = True
        exe.donated = self.donated   # the slots the program donates: made private before each call
        return exe

    def compile_with(self, bufs, runtime, extras, specs, donated=()):
        start = time.perf_counter()
        trace = _EagerTrace(self, specs)

        def run(*flat):
            return trace(*flat)

        sharding = jax.sharding.SingleDeviceSharding(pjrt.device(self.device_index))
        try:
            # jit's own dispatch (its C++ fast path) serves later calls: the extras' avals never change.
            # Compiled under the persistent cache as graphs are: a second process serving the same
            # traffic loads the program instead of compiling it.
            with cache.graph_compile_context() as hits:
                jitted = jax.jit(run, out_shardings=sharding, donate_argnums=donated)
                donation.make_private(bufs, donated, self.device_index)
                results = jitted(*bufs, *runtime, *extras)
        except NoRule:
            raise
        except Exception as err:  # noqa: BLE001 - a node without a working rule: compiled per shape
            error = getattr(err, "error", err)
            if isinstance(error, NoRule):
                raise error from None
            raise NoRule(self.kernel.short_name, f"{type(error).__name__}: {error}") from None
        self.compiled = jitted
        self.donated = donated
        self.checks = trace.checks
        seconds = time.perf_counter() - start
        metrics.compile_seconds += seconds
        if hits.count:   # an eager executable loaded from the persistent cache, as exact ones count
            metrics.eager_cache_loads += 1
            metrics.extra["bucketed_eager_persistent_cache_hits"] += 1
        else:
            metrics.executables_compiled += 1
            metrics.eager_compiles[_REASON] += 1
            metrics.extra["bucketed_eager_compiles"] += 1
        return results


def _source(name):
    from torch._dynamo.source import ConstantSource
    return ConstantSource(name)


class _Planned(BucketedProgram):
    """The planning of a bucketed graph, for one eager op: no per-shape fallback of its own."""

    allow_inplace = True   # one in-place op: the eager trace writes its new value of self back

    def _fall_back(self, err):
        raise err


class _EagerTrace(_Trace):
    """(storage buffers..., the eager call's runtime values..., true sizes..., strides of each
    dynamic view..., layouts of each output...)."""

    def __init__(self, eager, specs):
        p = eager.program
        super().__init__(p, eager.bucket_values, specs, eager.nbufs, eager.nruntime)
        self.eager = eager

    def __call__(self, *flat):
        e = self.eager
        bufs = flat[:self.nbufs]
        runtime = flat[self.nbufs:self.nbufs + self.nruntime]
        rt = iter(runtime)
        rest = iter(flat[self.nbufs + self.nruntime:])
        self.values = {s: next(rest) for s in e.symbols}
        self.base_key = None
        if e.kernel.lowering.random:   # the eager call's generator inputs come last
            self.base_key = jax.random.fold_in(jax.random.key(runtime[-2]), runtime[-1])
        env = {}
        written = None     # (view spec, offset, strides or None) of self, for an in-place op
        phs = iter(self.p.placeholders)
        for n, read in enumerate(e.reads):
            ph = next(phs)
            v = ph.meta["val"]
            if read[0] == "scalar":   # a runtime value, as in eager: a new learning rate compiles nothing
                env[ph] = next(rt)
            elif read[0] == "size":
                env[ph] = _padded(v.node.expr, self.buckets)
            elif read[0] == "view" and read[2]:
                spec = read[1]
                offset = next(rt) if spec[inputs.OFFSET] is None else 0
                strides = next(rest)
                strides = [strides[d] for d in range(len(spec[1]))]
                if e.flat:
                    env[ph] = self.read_flat(bufs[spec[inputs.SLOT]], spec[0], _shape_exprs(v), offset,
                                             e.flat_out_exprs)
                else:
                    env[ph] = self.read_box(bufs[spec[inputs.SLOT]], spec[0], _shape_exprs(v), offset, strides,
                                            tail=contiguous_tail(spec[1], spec[2]))
                if n == 0:
                    written = (spec, offset, strides)
            else:
                env[ph], offset = inputs.read(read[1], bufs, rt)
                if n == 0 and read[0] == "view":
                    written = (read[1], offset, None)
        if e.flat:
            return self.evaluate_flat(env, list(rest))
        if not e.inplace:
            return self.evaluate(env, list(rest))
        found = self.run_steps(env)
        out = e.node
        value = self.result(env, out)
        spec, offset, strides = written
        slot = spec[inputs.SLOT]
        if strides is None:            # self has no dynamic dim: written as eager writes it
            new_bufs = {}
            inputs.write_back(new_bufs, bufs, spec, value, offset)
            new_buf = new_bufs[slot]
        else:
            flat = bufs[slot]
            new_buf = dyn.box_scatter(flat, value.astype(flat.dtype), self.box_dims(_shape_exprs(out.meta["val"])),
                                      strides, offset)
        return (new_buf, checks.pack(found)) if found else (new_buf,)


    def read_flat(self, buf, dtype, exprs, offset, out_exprs):
        """A row-major view's elements in storage order, as many as the result's box holds, shaped
        as that box (its data is not where the box would put it: only an elementwise op may use
        it). A view of the result's last sizes repeats, as broadcasting repeats it."""
        shape = tuple(self.padded_int(x) for x in out_exprs)
        n = int(np.prod(shape, dtype=np.int64))
        flat = layout.reinterpret(buf, jax_dtype(dtype))
        if len(exprs) == len(out_exprs) and isinstance(offset, int) and offset == 0 and flat.shape[0] >= n:
            return flat[:n].reshape(shape)
        itype = jnp.int64 if flat.shape[0] + n >= 2**31 - 1 else jnp.int32
        pos = lax.iota(itype, n)
        if len(exprs) < len(out_exprs):
            numel = 1
            for x in exprs:
                numel = numel * self.true(x)
            pos = pos % jnp.maximum(jnp.asarray(numel).astype(itype), 1)
        idx = jnp.asarray(offset).astype(itype) + pos
        return jnp.take(flat, idx, mode="fill", fill_value=0).reshape(shape)

    def evaluate_flat(self, env, out_layouts):
        """The elementwise op on storage-ordered inputs: its result is already the true tensor's
        storage, zeros after its last element."""
        found = self.run_steps(env)
        out = next(what[0] for kind, what in self.p.output_kinds if kind == "array")
        value = self.result(env, out).reshape(-1)
        vec = out_layouts[0]
        numel = 1
        for d in range(out.meta["val"].dim()):
            numel = numel * vec[d]
        value = jnp.where(lax.iota(jnp.int32, value.shape[0]) < numel, value, jnp.zeros((), value.dtype))
        return (value, checks.pack(found)) if found else (value,)


def apply_setting(value) -> None:
    """Install the bucketer into eager kernels while ``config.shapes`` is "bucketed"."""
    clear()
    if value == "bucketed":
        seams.seam("bucketer").install(bucketer)
    else:
        seams.seam("bucketer").uninstall()
