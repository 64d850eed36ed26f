"""torch.profiler integration and the tracer behind it.

While a ``torch.profiler`` session records, every neuron op, executable compile, CPU fallback,
torch.compile graph and host<->device copy appears as a named range (``neuron::<op>``,
``neuron::compile::<op>``, ``neuron::fallback::<op>``, ``neuron::graph::<name>``,
``neuron::h2d`` / ``neuron::d2h``) in its traces, and per-op statistics are gathered for
:func:`summary`.

With ``torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])``
the exported Chrome trace also holds a ``neuron:<i>`` process -- the device lane: one track of
executions (eager ops and torch.compile graphs, waited for while a session records, so their
slices last until the results are ready), one of compiles, one of host<->device transfers (with
their bytes), one of CPU fallbacks and one of adaptive-eager regions (a slice per fused
executable run, or per op-by-op group whose ops' executions lie within it, with the op count and
names in its args), each slice linked by a flow arrow from the CPU range that issued it (for a
region: that cut it; a run overlapping the program on the worker thread, ``adaptive_overlap``,
has no arrow). PyTorch's C++ profiler has no hook a Python backend can fill, so the lane is added
to the JSON ``export_chrome_trace`` writes, and the lane's measured times are given to the
session's FunctionEvents when PyTorch builds them (``prof.events()``, ``key_averages()``): each
op's ``device_time_total`` / ``self_device_time_total``, plus a device event per execution, as
CUDA kernels appear.

The same tracer serves the migration-readiness report (call sites of the first call of each op,
failures, fallback transfer costs). It is installed on ``metrics.tracer`` only while someone needs
it; otherwise the kernels run their plain code and pay nothing (see ``eager.kernel.set_tracing``).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import sys
import threading
import time

import torch
import torch.autograd.profiler as autograd_profiler
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from . import seams
from .eager import kernel
from .metrics import metrics, op_key
from .runtime import memory, sites

__all__ = ["enable", "disable", "reset", "stats", "summary", "is_enabled"]


class OpStat:
    __slots__ = ("calls", "total_ns", "compiles", "compile_ns", "bytes")

    def __init__(self):
        self.calls = 0
        self.total_ns = 0
        self.compiles = 0
        self.compile_ns = 0
        self.bytes = 0


class Tracer:
    """Observes kernel calls, compiles, fallbacks and copies for the profiler and the report."""

    def __init__(self):
        self.collector = None     # the active readiness-report collector, if any
        self.ranges = False       # a torch.profiler session is recording: emit named ranges
        self.timing = False       # gather per-op statistics for summary()
        self.stats: dict[tuple[str, str], OpStat] = {}
        self._range = None
        # The device lane of the current or last torch.profiler session: (track, name, start ns,
        # end ns (wall clock), issuing thread, extra args).
        self.device_events: list = []
        self._cut = threading.local()   # .at: (reason, wall ns) of this thread's last region cut

    # -- what the hooks call --------------------------------------------------------------------
    def kernel(self, k, call, args, kwargs):
        name = k.short_name
        col = self.collector
        if col is not None and name not in col.native_seen:
            col.first_call(name, "native")
        if not self.timing:
            try:
                return call(k, *args, **kwargs)
            except BaseException as err:
                if col is not None:
                    col.failed(name, "native", err)
                raise
        stat = self._stat(name, "native")
        rng = self._enter("neuron::" + name) if self.ranges else None
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        try:
            result = call(k, *args, **kwargs)
            if rng is not None:
                self._executed(name, wall, result)
            return result
        except BaseException as err:
            if col is not None:
                col.failed(name, "native", err)
            raise
        finally:
            stat.calls += 1
            stat.total_ns += time.perf_counter_ns() - start
            if rng is not None:
                rng.__exit__(None, None, None)

    def compile(self, k, compile_fn, args):
        col = self.collector
        if col is not None:   # args: (executable, ...): why it is needed, for per-site counts
            loads = metrics.eager_cache_loads
            try:
                return self._compile(k, compile_fn, args)
            finally:   # compiled, or loaded from the persistent cache (which counts a load)
                col.eager_compile(k.short_name, args[0].reason, loaded=metrics.eager_cache_loads > loads)
        return self._compile(k, compile_fn, args)

    def _compile(self, k, compile_fn, args):
        if not self.timing:
            return compile_fn(k, *args)
        stat = self._stat(k.short_name, "native")
        rng = self._enter("neuron::compile::" + k.short_name) if self.ranges else None
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        try:
            return compile_fn(k, *args)
        finally:
            stat.compiles += 1
            stat.compile_ns += time.perf_counter_ns() - start
            if rng is not None:
                self._device("compile", k.short_name, wall)
                rng.__exit__(None, None, None)

    def fallback(self, op, run, args, kwargs):
        """An op without a neuron kernel: ``run(op, *args, **kwargs)`` decomposes it or runs it on CPU.

        Which of the two happened is read from the op's own counters afterwards, so the fallback
        code needs no knowledge of the tracer beyond the call at its entry.
        """
        name = op_key(op.name())
        col = self.collector
        rng = self._enter("neuron::fallback::" + name) if self.ranges else None
        cpu_before = metrics.fallbacks.get(name, 0)
        dec_before = metrics.decompositions.get(name, 0)
        copies_before = (metrics.h2d_copies, metrics.h2d_bytes, metrics.d2h_copies, metrics.d2h_bytes)
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        error = None
        try:
            return run(op, *args, **kwargs)
        except BaseException as err:
            error = err
            raise
        finally:
            elapsed = time.perf_counter_ns() - start
            went_cpu = (metrics.fallbacks.get(name, 0) > cpu_before
                        and metrics.decompositions.get(name, 0) == dec_before)
            if error is not None and type(error).__name__ == "FallbackError":
                went_cpu = True    # fallback="error" refused to run it on CPU
            path = "cpu" if went_cpu else "decomposed"
            if rng is not None:
                if went_cpu:   # with the user's line that called it
                    self._device("fallback", name, wall,
                                 {"path": "cpu", "call_site": sites.format_site(sites.user_site(2))})
                rng.__exit__(None, None, None)
            if self.timing:
                stat = self._stat(name, path)
                stat.calls += 1
                stat.total_ns += elapsed
            if col is not None:
                if (name, path) not in col.sites:
                    col.first_call(name, path)
                if error is not None:
                    col.failed(name, path, error)
                elif went_cpu:
                    after = (metrics.h2d_copies, metrics.h2d_bytes, metrics.d2h_copies, metrics.d2h_bytes)
                    col.fallback_cost(name, [a - b for a, b in zip(after, copies_before)], elapsed)

    def copy(self, direction, fn, *args):
        """A host<->device copy; ``direction`` is "h2d" or "d2h"."""
        col = self.collector
        counter = "h2d_bytes" if direction == "h2d" else "d2h_bytes"
        before = getattr(metrics, counter)
        rng = self._enter("neuron::" + direction) if self.ranges else None
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        try:
            result = fn(*args)
            if rng is not None and direction == "h2d":
                _block(result)   # the upload's slice lasts until the buffer is on the device
            return result
        finally:
            elapsed = time.perf_counter_ns() - start
            nbytes = getattr(metrics, counter) - before
            if rng is not None:
                self._device("transfer", direction, wall, {"bytes": nbytes})
                rng.__exit__(None, None, None)
            if self.timing:
                stat = self._stat(direction, "copy")
                stat.calls += 1
                stat.total_ns += elapsed
                stat.bytes += nbytes
            if col is not None:
                col.transfer(direction, nbytes)

    def graph(self, program, call, args):
        """A torch.compile graph (one executable) running on neuron."""
        if not self.timing:
            return call(program, *args)
        name = "graph::" + program.name
        stat = self._stat(name, "graph")
        rng = self._enter("neuron::" + name) if self.ranges else None
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        try:
            result = call(program, *args)
            if rng is not None:
                self._executed(name, wall, result)
            return result
        finally:
            stat.calls += 1
            stat.total_ns += time.perf_counter_ns() - start
            if rng is not None:
                rng.__exit__(None, None, None)

    def graph_compile(self, program, compile_fn, args):
        if not self.timing:
            return compile_fn(program, *args)
        name = "graph::" + program.name
        stat = self._stat(name, "graph")
        rng = self._enter("neuron::compile::" + name) if self.ranges else None
        start = time.perf_counter_ns()
        wall = time.time_ns() if rng is not None else 0
        try:
            return compile_fn(program, *args)
        finally:
            stat.compiles += 1
            stat.compile_ns += time.perf_counter_ns() - start
            if rng is not None:
                self._device("compile", name, wall)
                rng.__exit__(None, None, None)

    # -- adaptive eager regions (eager/adaptive/recorder.py's flush, run.py) ----------------------
    def region_cut(self, reason):
        """A region is cut (a host read, backward end, optimizer step...): its runs' slices flow
        from the CPU range this thread is in now."""
        if self.ranges:
            self._cut.at = (reason, time.time_ns(), threading.get_native_id())

    def cut_here(self):
        """This thread's last cut, for a fused run it hands to the overlap worker."""
        return getattr(self._cut, "at", None)

    def adopt_cut(self, cut):
        """On the overlap worker: the run that follows flows from ``cut`` (the cutting thread's)."""
        self._cut.at = cut

    def fused(self, seg, fn, inputs, runtime):
        """A fused region executable runs: one slice on the regions track, lasting until its
        results are ready."""
        if not self.ranges:
            return fn(*inputs, *runtime)
        start = time.time_ns()
        result = fn(*inputs, *runtime)
        self._region(seg, True, start, _block(result))
        return result

    def interpreted(self, seg, interpret, current, runtime, run_op):
        """A region segment runs op by op: each op's execution on the executions track, grouped
        under one slice on the regions track."""
        if not self.ranges:
            return interpret(seg.ops, current, runtime, run_op)
        start = time.time_ns()
        first = len(self.device_events)

        def traced(exe, bufs, rt):
            wall = time.time_ns()
            result = run_op(exe, bufs, rt)
            self._executed(exe.key[0].short_name, wall, result)
            return result

        found = interpret(seg.ops, current, runtime, traced)
        device = next((e[6] for e in self.device_events[first:] if e[6] is not None), None)
        self._region(seg, False, start, device)
        return found

    def _region(self, seg, fused, start, device):
        cut = getattr(self._cut, "at", None)   # on the overlap worker: the cut it adopted
        names = [op[0].key[0].short_name for op in seg.ops]
        args = {"ops": len(names), "fused": fused, "op_names": names}
        if cut is not None:
            args["cut"] = cut[0]
        self._device("region", f"{'fused' if fused else 'op-by-op'} region ({len(names)} ops)", start,
                     args, device, start if cut is None else cut[1], None if cut is None else cut[2])

    def float64(self, op_name):
        col = self.collector
        if col is not None and op_name not in col.float64_sites:
            col.float64(op_name)

    # -- helpers --------------------------------------------------------------------------------
    def _stat(self, name, path):
        key = (name, path)
        stat = self.stats.get(key)
        if stat is None:
            stat = self.stats[key] = OpStat()
        return stat

    def _enter(self, name):
        rng = self._range(name)
        rng.__enter__()
        return rng

    def _device(self, track, name, start_wall, args=None, device=None, issued=None, thread=None):
        """``thread``: the thread whose CPU range issued it (default: this one)."""
        self.device_events.append((track, name, start_wall, time.time_ns(), thread or threading.get_native_id(),
                                   args, device, start_wall if issued is None else issued))

    def _executed(self, name, start_wall, result):
        """An execution's device slice: from its dispatch until its results are ready. An op that
        adaptive eager only recorded has none here: it runs in its region (:meth:`fused`,
        :meth:`interpreted`)."""
        if _recorded(result):
            return
        device = _block(result)
        issued = start_wall
        compiled = self.device_events[-1] if self.device_events else None
        if compiled is not None and compiled[0] == "compile" and compiled[2] >= start_wall:
            start_wall = compiled[3]   # the compile inside this call is the compile track's
        self._device("execute", name, start_wall, None, device, issued)


def _buffers(result):
    """The storage records of ``result``'s neuron tensors, and any bare buffers (jax.Arrays) in it."""
    stack = [result]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.device.type == "neuron":
                rec = memory.allocator.records.get(v.untyped_storage().data_ptr())
                if rec is not None:
                    yield rec, rec.buf
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif hasattr(v, "block_until_ready"):   # a jax.Array (an upload's buffer)
            yield None, v


def _block(result):
    """Wait until the device buffers behind ``result``'s neuron tensors are computed; returns the
    device index of the first one (None if none)."""
    device = None
    for rec, buf in _buffers(result):
        if rec is not None and device is None:
            device = rec.device_index
        wait = getattr(buf, "block_until_ready", None)
        if wait is not None:
            wait()
    return device


def _recorded(result) -> bool:
    """Whether ``result``'s neuron tensors are pending: recorded by adaptive eager, not run yet."""
    return any(buf is memory.PENDING for _, buf in _buffers(result))


_tracer = Tracer()
_lock = threading.Lock()
_explicit = False   # enable() was called: keep timing between profiler sessions


def update() -> None:
    """Install the tracer on the metrics registry exactly while something needs it."""
    t = _tracer
    needed = t.collector is not None or t.ranges or t.timing
    if needed and t._range is None:
        t._range = torch._C._profiler._RecordFunctionFast
    if needed:
        seams.seam("tracer").install(t)
    else:
        seams.seam("tracer").uninstall()
    kernel.set_tracing(needed)
    _set_graph_tracing(needed)


def _set_graph_tracing(on: bool) -> None:
    """Route torch.compile graphs through the tracer, as kernels are (``compile.graph.set_tracing``)."""
    if not on and "torchneuron.compile.graph" not in sys.modules:
        return          # never loaded, never swapped: nothing to restore
    from .compile import graph  # the graph compiler loads with the first torch.compile, not here
    graph.set_tracing(on)


def attach_collector(collector) -> None:
    with _lock:
        if _tracer.collector is not None and collector is not None:
            raise RuntimeError("torchneuron: a readiness report is already collecting in this process")
        _tracer.collector = collector
        update()


# -- torch.profiler sessions ----------------------------------------------------------------------
def _session_started() -> None:
    with _lock:
        _tracer.stats = {}
        _tracer.device_events = []
        _tracer.ranges = True
        _tracer.timing = True
        update()


def _session_stopped() -> None:
    with _lock:
        _tracer.ranges = False
        _tracer.timing = _explicit
        update()


_hooks_installed = False


def install_hooks() -> None:
    """Follow torch.profiler sessions. Called once by ``torchneuron.register()``.

    PyTorch calls ``torch.autograd.profiler._run_on_profiler_start/stop`` whenever any profiler
    (``torch.profiler.profile``, ``torch.autograd.profiler.profile``, with or without a schedule)
    starts or stops recording; wrapping them is the one place that sees every session.
    """
    global _hooks_installed
    if _hooks_installed:
        return

    on_start = autograd_profiler._run_on_profiler_start
    on_stop = autograd_profiler._run_on_profiler_stop

    def run_on_profiler_start():
        on_start()
        _session_started()

    def run_on_profiler_stop():
        on_stop()
        _session_stopped()

    autograd_profiler._run_on_profiler_start = run_on_profiler_start
    autograd_profiler._run_on_profiler_stop = run_on_profiler_stop
    # torch.profiler.profile.export_chrome_trace (and tensorboard_trace_handler) end here, also for
    # a .gz path (written as JSON first, then compressed).
    export = autograd_profiler.profile.export_chrome_trace

    @functools.wraps(export)
    def export_chrome_trace(prof, path, *args, **kwargs):
        result = export(prof, path, *args, **kwargs)
        if getattr(prof, "use_device", None) == "neuron" and isinstance(path, str | os.PathLike):
            add_device_lane(os.fspath(path), list(_tracer.device_events))
        return result

    autograd_profiler.profile.export_chrome_trace = export_chrome_trace
    # prof.events() / key_averages(): PyTorch turns the session's results into FunctionEvents
    # once, lazily; the lane's measured device times are attached to them then.
    ensure = autograd_profiler.profile._ensure_function_events

    @functools.wraps(ensure)
    def ensure_function_events(prof):
        fresh = prof._function_events is None
        ensure(prof)
        if fresh and getattr(prof, "use_device", None) == "neuron" and prof.kineto_results:
            add_device_times(prof._function_events, list(_tracer.device_events),
                             prof.kineto_results.trace_start_ns())

    autograd_profiler.profile._ensure_function_events = ensure_function_events
    _hooks_installed = True


# -- the device lane ------------------------------------------------------------------------------
_TRACKS = {"execute": (0, "executions", "neuron::"), "compile": (1, "compiles", "neuron::compile::"),
           "transfer": (2, "host<->device transfers", "neuron::"),
           "fallback": (3, "CPU fallbacks", "neuron::fallback::"),
           # adaptive eager's region runs; their flow starts in the CPU range that cut the region
           "region": (4, "regions", None)}
_LANE_PID = 1 << 24   # the neuron:<i> process of the trace is _LANE_PID + i
# How far (us) a lane event's issue time may fall outside the CPU range that issued it: PyTorch's
# profiler clock (converted from its own time source) and time.time_ns() differ by some us, more
# on a loaded machine.
_CLOCK_SLACK_US = 50_000.0


def device_lane(events: list, base_ns: int, cpu_events: list, pid: int) -> list:
    """Chrome trace events of the neuron lane: per device a process with one thread per track, a
    slice per recorded event, and a flow from the CPU range (``cpu_events``, on ``pid``) that
    issued it."""
    ranges: dict = {}
    for e in cpu_events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("neuron::"):
            ranges.setdefault((e["name"], e.get("tid")), []).append(e)
    out = []
    devices = set()
    for n, (track, name, start, end, thread, args, device, issued) in enumerate(events):
        tid, _, prefix = _TRACKS[track]
        index = 0 if device is None else device
        devices.add(index)
        ts = (start - base_ns) / 1000
        lane = _LANE_PID + index
        out.append({"ph": "X", "cat": "neuron", "name": name, "pid": lane, "tid": tid, "ts": ts,
                    "dur": max((end - start) / 1000, 0.001), "args": dict(args or {}, device=f"neuron:{index}")})
        at = (issued - base_ns) / 1000   # when the CPU range issued it: inside that range
        if prefix is None:   # a region: the innermost CPU range of the cutting thread at its cut
            if "cut" not in (args or {}):
                continue
            # (a backward's end cuts in the autograd engine's final callback, outside any range:
            # then the range that ended last before it, the backward's last op)
            ranges_on = [e for e in cpu_events if e.get("ph") == "X" and e.get("tid") == thread
                         and e.get("pid", pid) == pid and e["ts"] <= at]
            enclosing = [e for e in ranges_on if at <= e["ts"] + e.get("dur", 0)]
            if enclosing:
                cpu = min(enclosing, key=lambda e: e.get("dur", 0))
            elif ranges_on:
                cpu = max(ranges_on, key=lambda e: e["ts"] + e.get("dur", 0))
            else:   # a cut just before the thread's first range, as the clocks align (_CLOCK_SLACK_US)
                later = [e for e in cpu_events if e.get("ph") == "X" and e.get("tid") == thread
                         and e.get("pid", pid) == pid and e["ts"] <= at + _CLOCK_SLACK_US]
                if not later:
                    continue
                cpu = min(later, key=lambda e: e["ts"])
        else:
            candidates = ranges.get((prefix + name, thread))
            if not candidates:
                continue
            cpu = min(candidates, key=lambda e: (not e["ts"] <= at <= e["ts"] + e.get("dur", 0), abs(e["ts"] - at)))
        start_ts = min(max(at, cpu["ts"]), cpu["ts"] + cpu.get("dur", 0))
        flow = {"cat": "neuron_flow", "name": "neuron", "id": n + 1}
        out.append({**flow, "ph": "s", "pid": cpu.get("pid", pid), "tid": thread, "ts": start_ts})
        out.append({**flow, "ph": "f", "bp": "e", "pid": lane, "tid": tid, "ts": ts})
    for index in sorted(devices):
        lane = _LANE_PID + index
        out.append({"ph": "M", "name": "process_name", "pid": lane, "args": {"name": f"neuron:{index}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": lane, "args": {"sort_index": lane}})
        for tid, label, _ in _TRACKS.values():
            out.append({"ph": "M", "name": "thread_name", "pid": lane, "tid": tid, "args": {"name": label}})
    return out


def add_device_times(function_events, events: list, base_ns: int) -> None:
    """Give the session's FunctionEvents the device time the lane measured, as CUDA kernels give
    theirs (``FunctionEvent.append_kernel``), so ``device_time_total`` / ``self_device_time_total``
    and ``key_averages().table(sort_by="self_device_time_total")`` show neuron time.

    An execution or transfer counts for the ``neuron::<op>`` range that issued it; one run inside
    an adaptive region (and a fused region's run) for the CPU range that cut the region, or, where
    none encloses it (a backward's end), the range that ended last before it. Compiles and CPU
    fallbacks are host time, and an op-by-op region's slice only groups its ops' executions."""
    cpu = sorted((e for e in function_events if e.device_type == DeviceType.CPU and not e.is_async),
                 key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]

    def innermost(at, name=None):
        """The latest-starting range enclosing ``at`` (named ``name``, if given)."""
        i = bisect.bisect_right(starts, at)
        for e in reversed(cpu[max(0, i - 4096):i]):
            if e.time_range.end >= at and (name is None or e.name == name):
                return e
        return None

    def nearest(at, name):
        """The range named ``name`` closest to ``at``, within ``_CLOCK_SLACK_US``: the profiler's
        clock and the wall clock the lane reads are aligned only to some microseconds, so under
        load an issue time can fall just outside its own range."""
        i = bisect.bisect_right(starts, at + _CLOCK_SLACK_US)
        best, gap = None, _CLOCK_SLACK_US
        for e in cpu[max(0, i - 4096):i]:
            if e.name == name:
                d = max(e.time_range.start - at, at - e.time_range.end, 0)
                if d <= gap:
                    best, gap = e, d
        return best

    for track, name, start, end, _thread, args, device, issued in events:
        if track in ("compile", "fallback") or (track == "region" and not args["fused"]):
            continue
        prefix = _TRACKS[track][2]
        at = (issued - base_ns) / 1000
        target = (innermost(at, prefix + name) or nearest(at, prefix + name)) if prefix is not None else None
        if target is None:
            began = (start - base_ns) / 1000
            target = innermost(began)
            if target is None:
                i = bisect.bisect_right(starts, began)
                ended = [e for e in cpu[max(0, i - 4096):i] if e.time_range.end <= began]
                target = max(ended, key=lambda e: e.time_range.end, default=None)
        if target is None:
            continue
        index = 0 if device is None else device
        began, ended = (start - base_ns) / 1000, (end - start) / 1000 + (start - base_ns) / 1000
        target.append_kernel(name, index, ended - began)
        # and, as a CUDA kernel is, a device event of its own: a row of key_averages(), and what
        # the table's device time total adds up
        function_events.append(FunctionEvent(
            id=target.id, name=name, thread=target.thread, start_us=began, end_us=ended,
            use_device=target.use_device, device_type=DeviceType.PrivateUse1, device_index=index,
            trace_name=name, stack=[], input_shapes=[], overload_name=""))


def add_device_lane(path: str, events: list) -> None:
    """Add the neuron lane to a Chrome trace JSON file PyTorch's profiler wrote."""
    if not events:
        return
    with open(path) as f:
        trace = json.load(f)
    lane = device_lane(events, int(trace.get("baseTimeNanoseconds", 0)), trace.get("traceEvents", []),
                       os.getpid())
    trace.setdefault("traceEvents", []).extend(lane)
    with open(path, "w") as f:
        json.dump(trace, f)


# -- public API -----------------------------------------------------------------------------------
def enable() -> None:
    """Gather per-op statistics without a torch.profiler session (no trace ranges)."""
    global _explicit
    with _lock:
        _explicit = True
        _tracer.timing = True
        update()


def disable() -> None:
    global _explicit
    with _lock:
        _explicit = False
        _tracer.timing = _tracer.ranges
        update()


def is_enabled() -> bool:
    return _tracer.timing


def reset() -> None:
    _tracer.stats = {}


def stats() -> list[dict]:
    """Per-op rows of the current or most recent session, slowest first."""
    rows = []
    for (name, path), s in list(_tracer.stats.items()):
        rows.append({
            "op": name, "path": path, "calls": s.calls,
            "total_ms": s.total_ns / 1e6,
            "mean_us": s.total_ns / s.calls / 1e3 if s.calls else 0.0,
            "compiles": s.compiles, "compile_ms": s.compile_ns / 1e6, "bytes": s.bytes,
        })
    rows.sort(key=lambda r: -r["total_ms"])
    return rows


def summary(file=sys.stdout, limit: int | None = None) -> str:
    """Print (to ``file``; None prints nothing) and return a per-op table of the last session.

    Times are inclusive: a fallback's row includes its copies, an op's row its compile.
    """
    rows = stats()
    if limit is not None:
        rows = rows[:limit]
    header = ("op", "path", "calls", "total ms", "mean us", "compiles", "compile ms", "bytes")
    table = [header] + [
        (r["op"], r["path"], str(r["calls"]), f"{r['total_ms']:.3f}", f"{r['mean_us']:.1f}",
         str(r["compiles"]), f"{r['compile_ms']:.3f}", str(r["bytes"]) if r["bytes"] else "")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for n, row in enumerate(table):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if not rows:
        lines.append("(no neuron activity recorded: run a torch.profiler session or "
                     "torchneuron.profiler.enable() first)")
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text
