"""Adaptive eager mode: record eager ops, replay known regions cheaply, run them fused once compiled.

With the mode on, a lowered op does everything plain eager does up to the point of running: it
binds its arguments, checks shapes and dtypes (PyTorch's meta rules, so errors surface at the
user's line), applies promotion and the float64 policy, and allocates its outputs as real neuron
storages. Instead of running, it appends itself to the pending region; its outputs' buffers are
"pending" until the region is cut.

Where regions are cut. A region ends where a training step has natural boundaries, so the same
step produces the same regions whether or not the loop reads a value every step:

- the end of a backward pass (``loss.backward()``, ``torch.autograd.grad``),
- before and after ``optimizer.step()`` (any ``torch.optim`` optimizer),
- a host read (``.cpu()``, ``.item()``, printing), ``torch.neuron.synchronize()``, a CPU fallback, a
  host write into a device tensor, a collective, switching the mode off, the program exiting,
- an op on another device, and ``config.adaptive_max_ops`` ops (a safety net for loops without
  any of the above).

How a region runs. A region's structure (its executables, how their storages connect, which results
are still alive) names a ``Plan``. A plan seen for the first time runs at once, op by op, through
the same per-op executables plain eager uses. Once it has been seen
``config.adaptive_compile_after`` times, its fused executable is compiled on a background thread
while later occurrences keep running op by op; occurrences after the compile finished run as one
fused executable; after a cut where the program reads nothing (a backward end, an optimizer step),
that executable runs on a worker thread while the program records the next region
(``config.adaptive_overlap``), and the next cut or host read takes its results. A plan longer than
``config.adaptive_segment_ops`` ops is split into segments compiled separately (compile time grows
faster than linearly with the op count). When most recent regions are new (a program whose regions
keep changing), nothing more is compiled until they settle;
``metrics()["region_unfused"]`` counts every segment run that went op by op, by reason.

Replay. After a cut, the region that followed this plan last time is predicted; while the user's
calls match it op by op, each call is checked against the known executable's key (same kernel,
same statics, each tensor's dtype, sizes, strides, offset and storage wiring, each scalar's type)
instead of building and hashing a key, and the region's structure is known at the cut without
hashing. A call that does not match ends the replay; the op then takes the full path.

Scalars and RNG offsets stay runtime inputs, so values, in-place effects, views, autograd, RNG
streams and memory statistics are those of plain eager.

Device checks (``ops/checks.py``: index bounds, integer division by zero). A recorded op whose
executable may check values keeps its user call site; whether it runs op by op or inside a fused
segment (which returns the check outcomes after its results), every outcome is reported after the
region ran, in op order, with the site of that occurrence -- as plain eager reports them.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import operator
import os
import queue
import sys
import threading
import time

import jax
import numpy as np
import torch

from ..config import config
from ..metrics import metrics
from ..ops.signature import OPT_TENSOR_LIST, TENSOR_LIST
from ..runtime import inputs, memory, rng, sites
from ..runtime.dtypes import jax_dtype
from ..runtime.inputs import is_view, match_view, views
from ..runtime.values import offset_array, scalar_array
from . import kernel, key
from .plan import sharding

_records = memory.allocator.records
PENDING = memory.PENDING
_NOT_REPLAYED = kernel.NOT_REPLAYED
_freeze = key.freeze
_graph_task_id = torch._C._current_graph_task_id
_LISTS = (TENSOR_LIST, OPT_TENSOR_LIST)
_dtype_of = operator.attrgetter("dtype")
_storage_of = operator.attrgetter("numel", "dtype", "device_index")   # as _OpCheck's list storages
_buf_of = operator.attrgetter("buf")
_class_of = operator.attrgetter("__class__")
_shape_of = operator.attrgetter("shape")
_offset_of = torch.Tensor.storage_offset
_stride_of = torch.Tensor.stride
_data_ptr_of = torch.Tensor.data_ptr
_default_dtype = torch.get_default_dtype


class Region:
    """The ops recorded since the last cut and the storages they connect."""

    def __init__(self):
        self.lock = threading.RLock()
        self.prev = None          # plan of the region flushed last
        self.graph_task = -1      # the autograd graph task whose backward is being recorded
        self.inflight = None      # the fused run of the region cut last, while it runs (_InFlight)
        self.reset(None)

    def reset(self, cursor):
        self.ops = []            # (executable, input storage ids, output storage ids, runtime count)
        self.runtime = []        # every op's runtime inputs (scalars, RNG seeds/offsets), in order
        self.sid_of = {}         # storage address -> storage id within the region
        self.addr_of = []        # storage id -> address
        self.external = []       # buffers read from storages that existed before the region
        self.external_sids = []
        self.results = set()     # storage ids whose buffer the region produces (outputs, writes)
        self.sites = {}          # op position -> user call site, for ops that may have device checks
        self.device = None
        self.cursor = cursor     # the plan this region is predicted to repeat, while calls match it
        self.pos = 0             # how many of its ops were replayed
        self.deferred = False    # whether ``external`` holds buffers the region in flight produces

    # -- cuts at autograd boundaries ------------------------------------------------------------
    def _backward_boundary(self, task):
        """Called when the current thread's graph task differs from the one seen last: a backward
        pass starts (its end will cut the region), or one ended without its callback (it raised)."""
        self.graph_task = task
        if task != -1:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(task))
        else:
            self.flush("backward end")

    def _backward_done(self, task):
        with self.lock:
            if self.graph_task == task:
                self.graph_task = -1
            self.flush("backward end")

    # -- the replay fast path -------------------------------------------------------------------
    def replay(self, k, args, kwargs):
        """Record a call of ``k`` that matches the next op of the predicted plan, checking it against
        that op's executable key; ``NOT_REPLAYED`` when there is no prediction or it does not match."""
        with self.lock:
            task = _graph_task_id()
            if task != self.graph_task:
                self._backward_boundary(task)
            cursor = self.cursor
            if cursor is None:
                return _NOT_REPLAYED
            pos = self.pos
            check = cursor.check(pos) if pos < len(cursor.ops) else None
            if check is None or check.kernel is not k:
                self.cursor = None
                return _NOT_REPLAYED
            if _default_dtype() is not check.default_dtype:
                self.cursor = None
                return _NOT_REPLAYED
            values = k.bind(args, kwargs)
            for i, frozen, want in check.statics:   # as the key holds them (Kernel.statics)
                if (_freeze(values[i]) if frozen else values[i]) != want:
                    self.cursor = None
                    return _NOT_REPLAYED
            if check.aliased:   # as Kernel.__call__ on a cache hit: the views' offsets may differ
                k.check_overlaps(values)
            n_addr, n_ext, n_rt = len(self.addr_of), len(self.external), len(self.runtime)
            if not self._match_inputs(check, values):
                self._rollback(n_addr, n_ext, n_rt)
                self.cursor = None
                return _NOT_REPLAYED
            if check.factory and k.output_device(values) != check.device:
                self._rollback(n_addr, n_ext, n_rt)
                self.cursor = None
                return _NOT_REPLAYED
            if check.random:
                # As the full path: the op's generator argument, else the device's default generator.
                gen = None if k.generator_index is None else values[k.generator_index]
                self.runtime.extend(rng.state_of(gen, check.device).next_key_inputs())
            outs = self._new_outputs(check.exe, check.device)[0]
            written = check.written
            if written:   # an in-place foreach op writes a storage per list element
                for rec in map(_records.__getitem__, map(self.addr_of.__getitem__, written)):
                    rec.buf = PENDING
                self.results.update(written)
            if check.maybe_checked:
                self.sites[len(self.ops)] = sites.place(sys._getframe())
            self.ops.append(check.entry)
            self.device = check.device
            self.pos = pos + 1
            full = len(self.ops) >= config.adaptive_max_ops
        if full:
            self.flush("size limit")
        return k.returned(outs, values)

    def _match_inputs(self, check, values):
        """Whether the call's arguments give the executable's key, with the storage wiring the plan
        recorded (collecting runtime values and new external storages on the way)."""
        sid_of, runtime = self.sid_of, self.runtime
        for arg in check.args:
            tag = arg[0]
            v = values[arg[1]]
            if tag is _VIEW:
                _, _, spec, sid, storage = arg
                addr = match_view(v, spec, runtime)
                if addr is None:
                    return False
                known = sid_of.get(addr)
                if known != sid and (known is not None or not self._external(addr, sid, storage, check.device)):
                    return False
            elif tag is _VIEW_LIST:
                _, _, dtypes, shapes, strides, whole, itemsizes, sids, storages, consecutive = arg
                try:
                    if v is None or len(v) != len(sids) or tuple(map(_dtype_of, v)) != dtypes \
                            or tuple(map(_stride_of, v)) != strides or tuple(map(_shape_of, v)) != shapes:
                        return False
                    if whole is True:
                        # Every view spans its whole storage (parameters): its data pointer is the
                        # storage's address exactly when its offset is 0 (a view's data pointer lies
                        # inside its own storage's span, never at another storage's start), which
                        # the storage lookups below require.
                        addrs = list(map(_data_ptr_of, v))
                    else:
                        offsets = tuple(map(_offset_of, v))
                        addrs = list(map(operator.sub, map(_data_ptr_of, v), map(operator.mul, offsets, itemsizes)))
                except (AttributeError, TypeError):
                    return False
                if whole is not True:            # as Kernel.__call__: offsets of partial views, in order
                    for offset, w in zip(offsets, whole):
                        if w:
                            if offset:
                                return False
                        else:
                            runtime.append(offset_array(offset))
                known = list(map(sid_of.get, addrs))
                if known != sids and not self._externals(known, addrs, sids, storages, check.device, consecutive):
                    return False
            elif tag is _SCALAR_LIST:            # a list of runtime scalars (an optimizer's per-tensor steps)
                if v is None or v.__class__ is not list and v.__class__ is not tuple \
                        or tuple(map(_class_of, v)) != arg[2]:
                    return False
                runtime.extend(map(scalar_array, v))
            elif tag is _LIST:
                spec = arg[2]
                if v is None or len(v) != len(spec):
                    return False
                for t, s in zip(v, spec):
                    if not self._match(t, s, arg[3], check):
                        return False
            elif not self._match(v, arg[2], arg[3], check):
                return False
        return True

    def _externals(self, known, addrs, sids, storages, device, consecutive):
        """``_external`` for a list's storages: at once when all of them are new to the region and
        come next in the plan's order (a foreach op reading parameters, gradients or moments at the
        start of the optimizer's region), else element by element."""
        if consecutive and sids[0] == len(self.addr_of) and known.count(None) == len(known) \
                and len(set(addrs)) == len(addrs):
            recs = list(map(_records.get, addrs))
            if None not in recs and list(map(_storage_of, recs)) == storages:
                self.sid_of.update(zip(addrs, sids))
                self.addr_of.extend(addrs)
                self.external_sids.extend(sids)
                bufs = list(map(_buf_of, recs))
                for i, buf in enumerate(bufs):
                    if buf is None:   # never written: zeros, as _external
                        bufs[i] = memory.empty_buffer(recs[i])
                    elif buf is PENDING:
                        bufs[i] = self._in_flight(addrs[i])
                self.external.extend(bufs)
                return True
        return self._externals_one_by_one(known, addrs, sids, storages, device)

    def _externals_one_by_one(self, known, addrs, sids, storages, device):
        for addr, sid, storage, k in zip(addrs, sids, storages, known):
            if k != sid and (k is not None or not self._external(addr, sid, storage, device)):
                return False
        return True

    def _external(self, addr, sid, storage, device):
        """Register a storage first read by this op as the region's next external input, if it is
        the one the plan expects there."""
        if sid != len(self.addr_of):
            return False
        rec = _records.get(addr)
        if rec is None or rec.device_index != device or rec.numel != storage[0] or rec.dtype is not storage[1]:
            return False
        self.sid_of[addr] = sid
        self.addr_of.append(addr)
        buf = rec.buf
        if buf is None:
            buf = memory.empty_buffer(rec)
        elif buf is PENDING:
            buf = self._in_flight(addr)
        self.external.append(buf)
        self.external_sids.append(sid)
        return True

    def _in_flight(self, addr):
        """The buffer of a storage that the region in flight produces, as a placeholder resolved at
        the next flush (a storage pending in no region in flight cannot occur: wait for it then)."""
        h = self.inflight
        i = None if h is None else h.index.get(addr)
        if i is None:
            self._join()
            return memory.empty_buffer(_records[addr])
        self.deferred = True
        h.wanted.add(i)
        return _Deferred(h, i)

    def _match(self, v, spec, sids, check):
        """``_match_inputs`` for one argument of an unusual kind (scalars, masked or CPU tensors)."""
        if spec is None:
            return v is None
        if spec.__class__ is type:               # a runtime scalar of this Python type
            if v.__class__ is not spec:
                return False
            self.runtime.append(scalar_array(v))
            return True
        if spec[0].__class__ is not torch.dtype:
            return self._match_unusual(v, spec)
        addr = match_view(v, spec, self.runtime)
        if addr is None:
            return False
        slot = spec[inputs.SLOT]
        sid = sids[slot]
        known = self.sid_of.get(addr)
        return known == sid or (known is None and self._external(addr, sid, check.storages[slot], check.device))

    def _match_unusual(self, v, spec):
        if not isinstance(v, torch.Tensor):
            return False
        tag = spec[0]
        if tag == inputs.CPU_SCALAR:
            if v.device.type != "cpu" or v.dim() != 0 or v.dtype is not spec[1]:
                return False
            self.runtime.append(np.asarray(v.item(), dtype=jax_dtype(v.dtype)))
            return True
        if tag == inputs.EMPTY:
            return v.device.type == "neuron" and v.numel() == 0 and v.dtype is spec[1] and tuple(v.shape) == spec[2]
        return False

    def _rollback(self, n_addr, n_ext, n_rt):
        for addr in self.addr_of[n_addr:]:
            del self.sid_of[addr]
        del self.addr_of[n_addr:], self.external[n_ext:], self.external_sids[n_ext:], self.runtime[n_rt:]

    def _new_outputs(self, exe, device):
        """The op's outputs as real neuron storages whose buffers the region will produce, and their
        storage ids."""
        outs, sids = [], []
        new = memory.allocator.new_output
        for layout in exe.outputs:
            if layout is None:
                outs.append(None)
                sids.append(None)
                continue
            t = new(layout, PENDING, device)
            sid = len(self.addr_of)
            addr = t.data_ptr()
            self.sid_of[addr] = sid
            self.addr_of.append(addr)
            self.results.add(sid)
            outs.append(t)
            sids.append(sid)
        return outs, tuple(sids)

    # -- the full path --------------------------------------------------------------------------
    def _sid(self, addr, buf):
        sid = self.sid_of.get(addr)
        if sid is None:
            sid = self.sid_of[addr] = len(self.addr_of)
            self.addr_of.append(addr)
            # Capture the buffer now: the storage may die before the flush.
            self.external.append(self._in_flight(addr) if buf is PENDING else buf)
            self.external_sids.append(sid)
        return sid

    def record(self, k, exe, values, ctx):
        """Record a call whose executable the kernel looked up by its key."""
        if exe.call is None and exe not in _traced_once:
            if _reads_non_floating(exe.key[1]):
                _trace_now(k, exe, values, ctx)   # raises again for every call that would fail
            _traced_once.add(exe)
        with self.lock:
            device = ctx.device_index
            bufs = ctx.bufs
            if self.device is not None and device != self.device:
                self.flush("device change")     # a region runs on one device
                bufs = [memory.empty_buffer(_records[addr]) for addr in ctx.addrs]
            input_sids = tuple(self._sid(addr, buf) for addr, buf in zip(ctx.addrs, bufs))
            outs, out_sids = self._new_outputs(exe, device)
            for slot in exe.writes:
                _records[ctx.addrs[slot]].buf = PENDING
                self.results.add(input_sids[slot])
            entry = (exe, input_sids, out_sids, len(ctx.runtime))
            checks = exe.checks   # known once the executable was traced (None: not yet)
            if checks is None or checks:
                self.sites[len(self.ops)] = sites.place(sys._getframe())
            self.ops.append(entry)
            self.runtime.extend(ctx.runtime)
            self.device = device
            if len(self.ops) == 1:
                # No prediction for this region: a plan that started with this op last time.
                plan = _starts.get(exe)
                if plan is not None and plan.ops[0] == entry:
                    self.cursor, self.pos = plan, 1
            full = len(self.ops) >= config.adaptive_max_ops
        if full:
            self.flush("size limit")
        return k.returned(outs, values)

    # -- the cut --------------------------------------------------------------------------------
    def _join(self):
        """Wait for the fused run in flight and put its results in their storages' records."""
        h = self.inflight
        if h is None:
            return
        self.inflight = None
        h.latch.acquire()
        if h.error is not None:
            failed = memory.Unavailable(f"{type(h.error).__name__}: {h.error}".splitlines()[0])
            for rec, addr in zip(h.recs, h.index):
                if rec.buf is PENDING and self.sid_of.get(addr) not in self.results:
                    rec.buf = failed
            raise h.error
        # Storages the region being recorded writes stay pending (it produces them); others were
        # written since if not pending (a freed buffer).
        sid_of, written = self.sid_of, self.results
        for rec, addr, buf in zip(h.recs, h.index, h.results):
            if rec.buf is PENDING and sid_of.get(addr) not in written:
                rec.buf = buf
        results = h.results
        # Keep only what the region being recorded reads (its placeholders): the others' storages
        # hold them, or died (their buffers go now, as after a run at the cut).
        h.results = [buf if i in h.wanted else None for i, buf in enumerate(results[:len(h.recs)])]
        if h.checks is not None:   # the outcomes of the ops' device checks, after the results, in op order
            ops, op_sites, checked = h.checks
            for n, outcome in zip(checked, results[len(h.recs):]):
                ops[n][0].report(outcome, op_sites.get(n))

    def flush(self, reason: str) -> None:
        if not self.ops and (self.inflight is None or reason in _OVERLAPPING):
            return   # nothing to run; a run in flight goes on
        with self.lock:
            self._join()
            if not self.ops:
                return
            ops, runtime, addr_of, records, op_sites = self.ops, self.runtime, self.addr_of, _records, self.sites
            memory.allocator.collect()   # storages freed since the last allocation need no result
            live = [sid for sid in self.results if addr_of[sid] in records]
            live.sort()
            live = tuple(live)
            cursor = self.cursor
            if cursor is not None and self.pos == len(cursor.ops) and cursor.live == live:
                plan = cursor      # every op replayed: the structure is known without hashing it
                _recent.append(False)
            else:
                plan = _plan_for((tuple(ops), tuple(self.external_sids), live), self.device)
            external = self.external
            if self.deferred:   # buffers of the region that was in flight, now joined
                external = [b.resolve() if b.__class__ is _Deferred else b for b in external]
            metrics.region_replayed_ops += self.pos
            self.reset(None)
            metrics.regions_flushed += 1
            metrics.region_ops += len(ops)
            metrics.flush_reasons[reason] += 1
            outcomes = []
            direct = plan.direct
            if direct is not None and direct.fn is not None and config.adaptive_overlap and reason in _OVERLAPPING \
                    and (not direct.checked or config.device_checks != "sync"):
                # The fused executable runs on the worker thread while the program goes on; its
                # storages stay pending until the next flush (or host read) joins it, which then
                # reports its device checks (deferred ones: read at a sync point, after that join).
                plan.seen += 1
                metrics.region_cache_hits += 1
                h = _InFlight([records[addr_of[sid]] for sid in live], {addr_of[sid]: i for i, sid in enumerate(live)})
                if direct.checked:
                    h.checks = (ops, op_sites, direct.checked)
                self.inflight = _overlap(direct.fn, external, runtime, h)
                self._advance(plan, ops)
                return
            try:
                results = _run(plan, external, runtime, outcomes)
            except BaseException as err:
                # Reads of what the region would have produced raise instead of seeing PENDING.
                failed = memory.Unavailable(f"{type(err).__name__}: {err}".splitlines()[0])
                for sid in live:
                    rec = records.get(addr_of[sid])
                    if rec is not None:
                        rec.buf = failed
                raise
            get = records.get
            for sid, buf in zip(live, results):
                rec = get(addr_of[sid])
                if rec is not None:
                    rec.buf = buf
            self._advance(plan, ops)
            # The outcomes of the ops' device checks, in op order (a "sync" error raises here, once
            # the region's results are in place).
            for n, outcome in outcomes:
                ops[n][0].report(outcome, op_sites.get(n))

    def _advance(self, plan, ops):
        """The prediction after running ``plan``: the plan that followed it last time."""
        if self.prev is not None:
            self.prev.next = plan
        self.prev = plan
        _starts[ops[0][0]] = plan
        self.cursor = plan.next


# -- fused runs overlapping the program ----------------------------------------------------------
# Cuts after which the program goes on without reading anything the region computes: its fused run
# may overlap what follows. Every other cut (host reads and writes, synchronize, fallbacks,
# collectives, mode and settings changes, exit) joins it and runs the region before returning.
_OVERLAPPING = frozenset({"backward end", "before optimizer step", "optimizer step", "size limit"})


class _InFlight:
    """A fused run on the worker thread: the records of its results (in ``plan.live`` order), their
    positions by storage address (in the same order), and its results or error once ``latch`` is
    released."""

    __slots__ = ("latch", "recs", "index", "wanted", "checks", "results", "error")

    def __init__(self, recs, index):
        self.latch = threading.Lock()
        self.latch.acquire()
        self.recs, self.index = recs, index
        self.wanted = set()       # positions of results the region being recorded reads
        self.checks = None        # (ops, their call sites, positions of checked ops) to report at the join
        self.results = self.error = None


class _Deferred:
    """An input of the region being recorded that the run in flight produces."""

    __slots__ = ("run", "i")

    def __init__(self, run, i):
        self.run, self.i = run, i

    def resolve(self):
        run = self.run
        if run.results is None:   # it failed (the error was raised when it was joined)
            return memory.Unavailable(f"{type(run.error).__name__}: {run.error}".splitlines()[0])
        return run.results[self.i]


_runs: queue.SimpleQueue = queue.SimpleQueue()
_runner = None


def _overlap(fn, external, runtime, h):
    global _runner
    if _runner is None:
        _runner = threading.Thread(target=_run_loop, name="torchneuron-region-runner", daemon=True)
        _runner.start()
    _runs.put((fn, external, runtime, h))
    return h


def _after_fork_in_child():
    # The worker thread is gone in a forked child (which may not use the device, runtime/fork.py):
    # its exit must not wait for a run that will never finish.
    global _runner, _runs
    _runner, _runs = None, queue.SimpleQueue()
    region.inflight = None


def _run_loop():
    while True:
        fn, external, runtime, h = _runs.get()
        try:
            h.results = fn(*external, *runtime)   # XLA runs it without the GIL
        except BaseException as err:   # raised in the user's thread when the run is joined
            h.error = err
        h.latch.release()
        # Not kept while waiting for the next run: the inputs' buffers (a step's old parameters and
        # moments) go as soon as their storages have newer ones.
        fn = external = runtime = h = None


_traced_once: set = set()   # new executables seen at a recorded call


def _reads_non_floating(specs) -> bool:
    return any(not s[inputs.DTYPE].is_floating_point for s in views(specs))


def _trace_now(k, exe, values, ctx):
    """Trace a new executable's body for its shapes only, at the user's call: a lowering that
    refuses an input dtype while it is traced (ops.numerics.require_floating: integer, bool or
    complex inputs) raises here, as in plain eager, not at the flush. Only executables reading such
    inputs pay this second trace."""
    avals = [jax.ShapeDtypeStruct((numel,), jax_dtype(dtype)) for numel, dtype in ctx.storages]
    try:
        jax.eval_shape(exe.traced, *avals, *ctx.runtime)
    except Exception as err:
        k.raise_call_error(values, err)


# -- plans: what a region's structure runs as -----------------------------------------------------
class Segment:
    """Consecutive ops of a plan compiled as one fused executable."""

    __slots__ = ("ops", "start", "in_sids", "out_sids", "rt_start", "rt_stop", "carry", "fn", "checked", "state",
                 "error")

    def __init__(self, ops, start, in_sids, rt_start, rt_stop):
        self.ops = ops
        self.start = start          # the position of its first op in the plan
        self.in_sids = in_sids      # storages it reads that earlier segments or the caller provide
        self.out_sids = ()          # storages it produces that later segments read or that stay alive
        self.rt_start, self.rt_stop = rt_start, rt_stop
        self.carry = ()             # storages whose buffers are needed after it
        self.fn = None              # the fused executable, once compiled
        # Positions (in the segment) of the ops whose device-check outcomes ``fn`` returns after
        # the buffers of ``out_sids``, in op order: known once it was traced.
        self.checked = ()
        self.state = None           # None, "compiling", "ready" or "compile failed"
        self.error = None


class Plan:
    __slots__ = ("ops", "external_sids", "live", "device", "segments", "seen", "next", "checks", "direct")

    def __init__(self, structure, device):
        self.ops, self.external_sids, self.live = structure
        self.device = device
        self.seen = 0
        self.next = None            # the plan that followed this one last time (the prediction)
        self.segments = _segments(self.ops, self.live, max(1, config.adaptive_segment_ops))
        if len(self.segments) > 1:
            metrics.region_splits += 1
        self.checks = [None] * len(self.ops)
        # The segment whose executable maps the region's inputs to its results, if it is the only one.
        seg = self.segments[0]
        self.direct = seg if len(self.segments) == 1 and seg.in_sids == self.external_sids \
            and seg.out_sids == self.live else None

    def check(self, pos):
        """How a call is checked against op ``pos`` when this plan is replayed (built on first use)."""
        check = self.checks[pos]
        if check is None:
            check = self.checks[pos] = _OpCheck(self.ops[pos])
        return check


# Argument checks of a replayed op: a tensor view, a list of views, a list or a single argument of
# another kind (checked by Region._match).
_VIEW, _VIEW_LIST, _SCALAR_LIST, _LIST, _OTHER = "view", "view list", "scalar list", "list", "other"


class _OpCheck:
    """One plan op as the replay checks it: its executable key unpacked per argument, the storage
    ids each tensor must sit on, and what the op writes."""

    __slots__ = ("entry", "exe", "kernel", "statics", "args", "storages", "device", "default_dtype", "random",
                 "factory", "written", "maybe_checked", "aliased")

    def __init__(self, entry):
        exe, input_sids, _, _ = entry
        k, specs, statics, storages, device, default_dtype = exe.key
        self.entry, self.exe, self.kernel = entry, exe, k
        # (argument index, whether the key holds it frozen, its value in the key)
        self.statics = tuple((i, frozen, v) for (i, frozen), v in zip(k.statics, statics))
        self.storages, self.device, self.default_dtype = storages, device, default_dtype
        self.args = []
        # A view's offset in the key is 0 when it spans its whole storage ("whole": the call's view
        # must start there too), else None (the call's offset is a runtime input): see
        # runtime/inputs.py. A list of views is checked field by field over the whole list.
        D, SZ, ST, OFF, SL = inputs.DTYPE, inputs.SIZES, inputs.STRIDES, inputs.OFFSET, inputs.SLOT
        for (i, kind), spec in zip(k.inputs, specs):
            if kind in _LISTS:
                if spec and all(is_view(s) for s in spec):
                    whole = tuple(s[OFF] == 0 for s in spec)
                    sids = [input_sids[s[SL]] for s in spec]
                    self.args.append((_VIEW_LIST, i, tuple(s[D] for s in spec), tuple(s[SZ] for s in spec),
                                      tuple(s[ST] for s in spec), True if all(whole) else whole,
                                      tuple(s[D].itemsize for s in spec), sids,
                                      [(*storages[s[SL]], device) for s in spec],
                                      sids == list(range(sids[0], sids[0] + len(sids)))))
                elif spec and all(t.__class__ is type for t in spec):
                    self.args.append((_SCALAR_LIST, i, spec))
                else:
                    self.args.append((_LIST, i, spec, input_sids))
            elif is_view(spec):
                slot = spec[SL]
                self.args.append((_VIEW, i, spec, input_sids[slot], storages[slot]))
            else:
                self.args.append((_OTHER, i, spec, input_sids))
        self.random = k.lowering.random
        # No tensor inputs: the device argument (else the current device) decides the key's device.
        self.factory = not _reads_storage(specs)
        self.written = tuple(input_sids[slot] for slot in exe.writes)
        self.aliased = exe.aliased   # a written view shares its storage with another argument
        # Whether a replayed call keeps its call site for device-check errors (checks are known
        # once the executable was traced, which a plan's first run does).
        checks = exe.checks
        self.maybe_checked = checks is None or bool(checks)


def _segments(ops, live, size):
    segments = []
    rt = 0
    for start in range(0, len(ops), size):
        chunk = ops[start:start + size]
        produced, reads = set(), {}
        n = 0
        for exe, input_sids, out_sids, n_runtime in chunk:
            for sid in input_sids:
                if sid not in produced:
                    reads.setdefault(sid, None)
            produced.update(sid for sid in out_sids if sid is not None)
            produced.update(input_sids[slot] for slot in exe.writes)
            n += n_runtime
        seg = Segment(chunk, start, tuple(reads), rt, rt + n)
        seg.carry = produced            # replaced below: what is needed after it
        segments.append(seg)
        rt += n
    needed = set(live)
    for seg in reversed(segments):
        produced = seg.carry
        seg.out_sids = tuple(sorted(produced & needed))
        seg.carry = tuple(sorted(needed))
        needed = (needed - produced) | set(seg.in_sids)
    return segments


_plans: dict = {}
_starts: dict = {}                       # first executable of a plan -> the latest such plan
_recent = collections.deque(maxlen=32)   # whether each of the latest flushes was a new plan
_MAX_PLANS = 4096


def _plan_for(structure, device):
    plan = _plans.get(structure)
    _recent.append(plan is None)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _forget_one_offs()
        plan = _plans[structure] = Plan(structure, device)
    return plan


def _forget_one_offs():
    """Drop plans that were never compiled (a program whose regions never repeat)."""
    for structure, plan in list(_plans.items()):
        if all(seg.state is None for seg in plan.segments):
            del _plans[structure]
    _starts.clear()
    region.prev = None


def _churning() -> bool:
    return len(_recent) == _recent.maxlen and sum(_recent) >= _recent.maxlen * 3 // 4


def _run(plan, external, runtime, outcomes):
    """Run one occurrence of ``plan``: each segment fused if its executable is ready, else op by op
    (queuing its compile when the plan has repeated enough). Returns the buffers of ``plan.live``;
    appends (op position, outcome) of the ops' device checks to ``outcomes``, in op order."""
    plan.seen += 1
    direct = plan.direct
    fn = direct.fn if direct is not None else None
    if fn is not None:   # one fused executable taking the region's inputs, returning its results
        metrics.region_cache_hits += 1
        results = fn(*external, *runtime)
        if direct.checked:
            outcomes.extend(zip(direct.checked, results[len(plan.live):]))
        return results
    current = dict(zip(plan.external_sids, external))
    split = len(plan.segments) > 1
    for seg in plan.segments:
        rt = runtime[seg.rt_start:seg.rt_stop]
        fn = seg.fn
        if fn is not None:
            metrics.region_cache_hits += 1
            results = fn(*[current[sid] for sid in seg.in_sids], *rt)
            current.update(zip(seg.out_sids, results))
            if seg.checked:
                start = seg.start
                outcomes.extend((start + n, outcome)
                                for n, outcome in zip(seg.checked, results[len(seg.out_sids):]))
        else:
            reason = seg.state
            if reason is None:
                if plan.seen < config.adaptive_compile_after:
                    reason = "first sighting"
                elif _churning():
                    reason = "regions keep changing"
                elif not budget.take(len(seg.ops)):
                    reason = "waiting for compile budget"
                else:
                    reason = "compiling"
                    _submit(seg, plan.device, [current[sid] for sid in seg.in_sids] + list(rt))
            metrics.region_unfused[reason] += 1
            found = _interpret(seg.ops, current, rt, _run_op)
            if found:
                start = seg.start
                outcomes.extend((start + n, outcome) for n, outcome in found)
        if split:
            current = {sid: current[sid] for sid in seg.carry}
    return [current[sid] for sid in plan.live]


def _interpret(ops, current, runtime, call):
    """Run recorded ops in order on the buffers in ``current`` (storage id -> buffer), in place.
    Returns [(op position, outcome)] of the ops with device checks (their executables' last result)."""
    position = 0
    found = []
    for n, (exe, input_sids, out_sids, n_runtime) in enumerate(ops):
        results = call(exe, [current[sid] for sid in input_sids], runtime[position:position + n_runtime])
        position += n_runtime
        k = 0
        for sid in out_sids:
            if sid is not None:
                current[sid] = results[k]
                k += 1
        for slot in exe.writes:
            current[input_sids[slot]] = results[k]
            k += 1
        if exe.checks:   # known once traced: by the call just made
            found.append((n, results[k]))
    return found


def _run_op(exe, bufs, runtime):
    """One recorded op through its per-op executable, exactly as plain eager runs it."""
    call = exe.call
    if call is None:
        k = exe.key[0]
        return k.first_call(exe, bufs, runtime, (), exe.key[4])
    metrics.cache_hits += 1
    return call(*bufs, *runtime)


def _trace_op(exe, bufs, runtime):
    time.sleep(0)   # tracing holds the GIL: let the user's thread in between ops
    return exe.traced(*bufs, *runtime)


def _fused(seg, device):
    ops, in_sids, out_sids = seg.ops, seg.in_sids, seg.out_sids
    n_in = len(in_sids)

    def run(*flat):
        current = dict(zip(in_sids, flat[:n_in]))
        found = _interpret(ops, current, flat[n_in:], _trace_op)
        seg.checked = tuple(n for n, _ in found)   # before seg.fn is set: the caller reads both
        return tuple(current[sid] for sid in out_sids) + tuple(outcome for _, outcome in found)

    return jax.jit(run, out_shardings=sharding(device))


# -- the background compiler ----------------------------------------------------------------------
_now = time.perf_counter


class CompileBudget:
    """Background compiles take CPU time from the program (on a two-core machine, from its own
    threads). They may use at most ``config.adaptive_compile_budget`` of the time adaptive mode has
    been on: a token bucket filling at that rate (capped, so a long run cannot save up a burst)
    that a compile draws from at its estimated cost when queued, corrected by its measured wall time
    when done. So a region compiles only once the program has run long enough to afford it, and
    background compiles cannot slow any stretch of the program down by much more than that share."""

    CAPACITY = 3.0   # seconds of compile the bucket holds; a costlier compile waits for a full bucket
    FIRST_SCALE = 4.0

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.tokens = 0.0
        self.since = None        # when adaptive mode was last switched on (None: it is off)
        # Measured / modelled compile seconds, averaged. Until a compile has been measured, assume a
        # busy machine: the first compile waits for that much run time, so it cannot slow the
        # program's first seconds (at load ~9 on two cores an 8-op region took 1.3-1.9 s, against
        # the quiet fit's 0.38 s); the first measurement replaces the guess.
        self.scale = self.FIRST_SCALE
        self.measured = False

    def start(self):
        with self.lock:
            if self.since is None:
                self.since = _now()

    def stop(self):
        with self.lock:
            self._fill()
            self.since = None

    def _fill(self):
        if self.since is not None:
            now = _now()
            self.tokens = min(self.CAPACITY, self.tokens + (now - self.since) * config.adaptive_compile_budget)
            self.since = now

    def estimate(self, n_ops: int) -> float:
        return (0.3 + 0.01 * n_ops) * self.scale   # seconds; fitted to XLA:CPU region compiles

    def take(self, n_ops: int) -> bool:
        """Draw the estimated cost of compiling ``n_ops`` ops, if the bucket affords it."""
        if config.adaptive_compile_budget >= 1:
            return True
        cost = self.estimate(n_ops)
        with self.lock:
            self._fill()
            if self.tokens < min(cost, self.CAPACITY):
                return False
            self.tokens -= cost
            return True

    def settle(self, n_ops: int, seconds: float):
        """A compile finished: charge what it really took instead of the estimate."""
        with self.lock:
            estimate = self.estimate(n_ops)
            if config.adaptive_compile_budget < 1:
                self.tokens -= seconds - estimate
            ratio = self.scale * seconds / estimate
            self.scale = 0.7 * self.scale + 0.3 * ratio if self.measured else ratio
            self.measured = True


budget = CompileBudget()
_jobs: queue.Queue = queue.Queue()
_pending = 0
_idle = threading.Condition()
_worker = None
_closing = False


def _submit(seg, device, sample):
    global _pending, _worker
    seg.state = "compiling"
    with _idle:
        _pending += 1
        if _worker is None:
            _worker = threading.Thread(target=_compile_loop, name="torchneuron-region-compiler", daemon=True)
            _worker.start()
    _jobs.put((seg, device, sample))


def _compile_loop():
    global _pending
    with contextlib.suppress(OSError, AttributeError):
        # Linux threads have their own nice value: the user's thread keeps the CPU first.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    while True:
        seg, device, sample = _jobs.get()
        if not _closing:
            _compile(seg, device, sample)
        with _idle:
            _pending -= 1
            _idle.notify_all()


def _compile(seg, device, sample):
    start = time.perf_counter()
    try:
        fn = _fused(seg, device)
        # Calling it (not lower().compile()) fills jit's C++ dispatch cache with the signature the
        # user's thread will call it with; the run itself is a pure function's, its result unused.
        fn(*sample)
    except Exception as err:   # the region keeps running op by op; the reason is counted
        seg.error = f"{type(err).__name__}: {err}"
        seg.state = "compile failed"
    else:
        seg.fn = fn
        seg.state = "ready"
        metrics.region_compiles += 1
        # Custom kernels (torchneuron.kernel) are named with their namespace, ATen ops not.
        metrics.custom_kernel_compiles.update({exe.name for exe, *_ in seg.ops if "::" in exe.name})
    seconds = time.perf_counter() - start
    metrics.region_compile_seconds += seconds
    budget.settle(len(seg.ops), seconds)


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until every queued region compile finished (tests, benchmarks); False on timeout."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout)


def _shutdown():
    global _closing
    flush("exit")
    _closing = True      # queued compiles are dropped; one in flight finishes before exit
    wait_for_compiles()


# -- public switches ----------------------------------------------------------------------------
def flush(reason: str = "explicit") -> None:
    """Run every pending recorded op (a no-op in plain eager mode or with nothing pending)."""
    if region.ops or region.inflight is not None:
        region.flush(reason)


def _wait_in_flight(reason: str) -> None:
    """A host read waits for the run in flight if it has device checks to report."""
    h = region.inflight
    if h is not None and h.checks is not None:
        with region.lock:
            region._join()


def set_eager_mode(mode: str) -> None:
    """``"adaptive"`` records and fuses eager ops; ``"plain"`` runs each op as it is called."""
    config.eager_mode = mode  # validates, then calls apply_mode


def apply_mode(mode: str) -> None:
    """Follow ``config.eager_mode`` (installed as its observer by ``torchneuron.register``)."""
    if mode == "adaptive":
        kernel.recorder = region
        budget.start()
        if not _optimizer_hooks:
            from torch.optim.optimizer import (  # not at the top: torch.optim is only needed here
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )
            _optimizer_hooks.append(register_optimizer_step_pre_hook(_before_step))
            _optimizer_hooks.append(register_optimizer_step_post_hook(_after_step))
    else:
        kernel.recorder = None
        budget.stop()
        while _optimizer_hooks:
            _optimizer_hooks.pop().remove()
        flush("mode change")


_optimizer_hooks: list = []


def _before_step(optimizer, args, kwargs):
    flush("before optimizer step")


def _after_step(optimizer, args, kwargs):
    flush("optimizer step")


@contextlib.contextmanager
def eager_mode(mode: str):
    """Run a block in the given eager mode, restoring the previous one afterwards."""
    previous = config.eager_mode
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def device_checks_changed(mode: str) -> None:
    """Executables compile their device checks in (or not): forget the eager executables and the
    region plans built from them when ``config.device_checks`` changes (installed as its observer by
    ``torchneuron.register``)."""
    flush("settings change")
    with region.lock:
        kernel.clear_cache()
        _plans.clear()
        _starts.clear()
        _traced_once.clear()
        region.prev = region.cursor = None


def clear_region_cache() -> None:
    """Forget every region plan and fused executable (the next occurrences start as first sightings)."""
    with region.lock:
        _plans.clear()
        _starts.clear()
        _recent.clear()
        budget.tokens = 0.0
        region.prev = region.cursor = None


def region_cache_size() -> int:
    """How many region segments have a fused executable."""
    return sum(1 for plan in _plans.values() for seg in plan.segments if seg.fn is not None)


def _reads_storage(specs) -> bool:
    return next(views(specs), None) is not None


region = Region()
memory.flush_pending = flush
memory.wait_in_flight = _wait_in_flight
os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown)
