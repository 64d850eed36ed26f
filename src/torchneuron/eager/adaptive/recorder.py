"""Recording eager ops into the pending region, replaying a predicted plan op by op, and the cut."""

from __future__ import annotations

import operator
import sys
import threading

import jax
import numpy as np
import torch

from ...config import config
from ...metrics import metrics
from ...runtime import inputs, memory, rng, sites
from ...runtime.dtypes import jax_dtype
from ...runtime.inputs import match_view, views
from ...runtime.values import offset_array, scalar_array
from .. import kernel, key
from . import isolate, plans
from . import run as runs
from .plans import LIST, SCALAR_LIST, VIEW, VIEW_LIST

_records = memory.allocator.records
PENDING = memory.PENDING
_NOT_REPLAYED = kernel.NOT_REPLAYED
_freeze = key.freeze
_graph_task_id = torch._C._current_graph_task_id
_dtype_of = operator.attrgetter("dtype")
_storage_of = operator.attrgetter("numel", "dtype", "device_index")   # as OpCheck's list storages
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
        self.inflight = None      # the fused run of the region cut last, while it runs (runs.InFlight)
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
            if _default_dtype() is not check.default_dtype or (
                    check.precision is not None and k.read_precision() is not check.precision):
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
            if tag is VIEW:
                _, _, spec, sid, storage = arg
                addr = match_view(v, spec, runtime)
                if addr is None:
                    return False
                known = sid_of.get(addr)
                if known != sid and (known is not None or not self._external(addr, sid, storage, check.device)):
                    return False
            elif tag is VIEW_LIST:
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
            elif tag is SCALAR_LIST:            # a list of runtime scalars (an optimizer's per-tensor steps)
                if v is None or v.__class__ is not list and v.__class__ is not tuple \
                        or tuple(map(_class_of, v)) != arg[2]:
                    return False
                runtime.extend(map(scalar_array, v))
            elif tag is LIST:
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
        return runs.Deferred(h, i)

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
            # A tensor without elements has data_ptr() 0: its storage's handle is the record's.
            addr = t.data_ptr() or t.untyped_storage().data_ptr()
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
        if exe.call is None and exe not in traced_once:
            if _reads_non_floating(exe.key[1]):
                _trace_now(k, exe, values, ctx)   # raises again for every call that would fail
            traced_once.add(exe)
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
                plan = plans.starts.get(exe)
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
        if not self.ops and (self.inflight is None or reason in runs.OVERLAPPING):
            return   # nothing to run; a run in flight goes on
        tracer = metrics.tracer
        if tracer is not None:   # a profiler session: the region's slices flow from here
            tracer.region_cut(reason)
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
                plans.recent.append(False)
            else:
                plan = _plan_for((tuple(ops), tuple(self.external_sids), live), self.device)
            external = self.external
            if self.deferred:   # buffers of the region that was in flight, now joined
                external = [b.resolve() if b.__class__ is runs.Deferred else b for b in external]
            metrics.region_replayed_ops += self.pos
            self.reset(None)
            metrics.regions_flushed += 1
            metrics.region_ops += len(ops)
            metrics.flush_reasons[reason] += 1
            outcomes = []
            direct = plan.direct
            if direct is not None and direct.fn is not None and config.adaptive_overlap and reason in runs.OVERLAPPING \
                    and (not direct.checked or config.device_checks != "sync"):
                # The fused executable runs on the worker thread while the program goes on; its
                # storages stay pending until the next flush (or host read) joins it, which then
                # reports its device checks (deferred ones: read at a sync point, after that join).
                plan.seen += 1
                metrics.region_cache_hits += 1
                h = runs.InFlight([records[addr_of[sid]] for sid in live], {addr_of[sid]: i for i, sid in enumerate(live)})
                if direct.checked:
                    h.checks = (ops, op_sites, direct.checked)
                self.inflight = runs.overlap(plan, direct, direct.fn, external, runtime, h)
                self._advance(plan, ops)
                if plan.unsited:
                    isolate.name_sites(plan, op_sites)
                return
            try:
                results = runs.run_region(plan, external, runtime, outcomes)
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
            if plan.unsited:   # groups isolated from fusion: their call sites, and a warning
                isolate.name_sites(plan, op_sites)
            # The outcomes of the ops' device checks, in op order (a "sync" error raises here, once
            # the region's results are in place).
            for n, outcome in outcomes:
                ops[n][0].report(outcome, op_sites.get(n))

    def _advance(self, plan, ops):
        """The prediction after running ``plan``: the plan that followed it last time."""
        if self.prev is not None:
            self.prev.next = plan
        self.prev = plan
        plans.starts[ops[0][0]] = plan
        self.cursor = plan.next


def _plan_for(structure, device):
    plan = plans.table.get(structure)
    plans.recent.append(plan is None)
    if plan is None:
        if len(plans.table) >= plans.MAX_PLANS:
            _forget_one_offs()
        plan = plans.table[structure] = plans.Plan(structure, device)
    return plan


def _forget_one_offs():
    """Drop plans that were never compiled (a program whose regions never repeat)."""
    for structure, plan in list(plans.table.items()):
        if all(seg.state is None for seg in plan.segments):
            del plans.table[structure]
    plans.starts.clear()
    region.prev = None


traced_once: set = set()   # new executables seen at a recorded call


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


region = Region()
