"""Running a region at its cut: fused segments where compiled, else op by op through plain eager's
executables; and the worker thread on which a fused run overlaps the program (``adaptive_overlap``)."""

from __future__ import annotations

import queue
import threading

from ...config import config
from ...metrics import metrics
from ...runtime import donation, memory
from . import compiler, plans


def run_region(plan, external, runtime, outcomes):
    """Run one occurrence of ``plan``: each segment fused if its executable is ready, else op by op
    (queuing its compile when the plan has repeated enough). Returns the buffers of ``plan.live``;
    appends (op position, outcome) of the ops' device checks to ``outcomes``, in op order."""
    plan.seen += 1
    direct = plan.direct
    fn = direct.fn if direct is not None else None
    if fn is not None:   # one fused executable taking the region's inputs, returning its results
        metrics.region_cache_hits += 1
        results = run_fused(plan, direct, fn, external, runtime, _LIST_ONLY)
        if direct.checked:
            outcomes.extend(zip(direct.checked, results[len(plan.live):]))
        return results
    current = dict(zip(plan.external_sids, external))
    segments = plan.segments   # read once: the compiler thread may replace the list (isolate.py)
    split = len(segments) > 1
    for seg in segments:
        rt = runtime[seg.rt_start:seg.rt_stop]
        fn = seg.fn
        if fn is not None:
            metrics.region_cache_hits += 1
            results = run_fused(plan, seg, fn, [current[sid] for sid in seg.in_sids], rt, _LIST_AND_TABLE)
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
                elif plans.churning():
                    reason = "regions keep changing"
                elif not compiler.budget.take(len(seg.ops)):
                    reason = "waiting for compile budget"
                else:
                    reason = "compiling"
                    compiler.submit(plan, seg, plan.device, [current[sid] for sid in seg.in_sids] + list(rt))
            metrics.region_unfused[reason] += 1
            tracer = metrics.tracer
            if tracer is None:
                found = plans.interpret(seg.ops, current, rt, run_op)
            else:   # a profiler session: the ops' slices on the neuron lane (torchneuron.profiler)
                found = tracer.interpreted(seg, plans.interpret, current, rt, run_op)
            if found:
                start = seg.start
                outcomes.extend((start + n, outcome) for n, outcome in found)
        if split:
            current = {sid: current[sid] for sid in seg.carry}
    return [current[sid] for sid in plan.live]


# References of an input buffer only the region holds, as make_private counts them: the inputs list
# (and the region's table of buffers, for segments of a split region), and getrefcount's argument.
_LIST_ONLY, _LIST_AND_TABLE = 2, 3


def run_fused(plan, seg, fn, inputs, runtime, owned):
    """``fn`` (the fused executable of ``seg``) on ``inputs``: its buffers of ``seg.out_sids``, then
    its checked ops' outcomes. If it raises, the ops run one by one instead (an error of theirs is
    the program's, raised as plain eager raises it), and the segment is bisected to fuse what runs.
    The storages it writes are updated in place (donated) unless something else refers to their
    buffers (``owned``: the references the caller's structures hold)."""
    donated = seg.donated
    if donated:
        donation.make_private(inputs, donated, plan.device, owned)
    try:
        tracer = metrics.tracer
        if tracer is not None:   # a profiler session: the run's slice on the neuron lane
            return tracer.fused(seg, fn, inputs, runtime)
        return fn(*inputs, *runtime)
    except Exception as err:   # noqa: BLE001 - judged by running the same ops one by one
        memory.raise_if_out_of_memory(err, plan.device)   # torch.OutOfMemoryError
        if any(inputs[i].is_deleted() for i in donated):   # consumed: nothing to run op by op
            raise
        current = dict(zip(seg.in_sids, inputs))
        found = plans.interpret(seg.ops, current, runtime, run_op)
        compiler.run_failed(plan, seg, [*inputs, *runtime], err)
        return tuple(current[sid] for sid in seg.out_sids) + tuple(outcome for _, outcome in found)


def run_op(exe, bufs, runtime):
    """One recorded op through its per-op executable, exactly as plain eager runs it."""
    call = exe.call
    if call is None:
        k = exe.key[0]
        return k.first_call(exe, donation.keep_inputs(exe, bufs, exe.key[4]), runtime, (), exe.key[4])
    metrics.cache_hits += 1
    # The region keeps its table of buffers: the op must not donate them.
    try:
        return call(*donation.keep_inputs(exe, bufs, exe.key[4]), *runtime)
    except Exception as err:
        memory.raise_if_out_of_memory(err, exe.key[4])   # torch.OutOfMemoryError
        raise


# -- fused runs overlapping the program ----------------------------------------------------------
# Cuts after which the program goes on without reading anything the region computes: its fused run
# may overlap what follows. Every other cut (host reads and writes, synchronize, fallbacks,
# collectives, mode and settings changes, exit) joins it and runs the region before returning.
OVERLAPPING = frozenset({"backward end", "before optimizer step", "optimizer step", "size limit"})


class InFlight:
    """A fused run on the worker thread: the records of its results (in ``plan.live`` order), their
    positions by storage address (in the same order), and its results or error once ``latch`` is
    released."""

    __slots__ = ("latch", "recs", "index", "wanted", "checks", "results", "error", "cut")

    def __init__(self, recs, index):
        self.latch = threading.Lock()
        self.latch.acquire()
        self.recs, self.index = recs, index
        self.wanted = set()       # positions of results the region being recorded reads
        self.checks = None        # (ops, their call sites, positions of checked ops) to report at the join
        self.results = self.error = None
        self.cut = None           # a profiler session: the cut its run's slice flows from


class Deferred:
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


def overlap(plan, seg, fn, external, runtime, h):
    """Run ``fn``, the fused executable of ``plan``'s only segment ``seg``, on the worker thread."""
    global _runner
    if _runner is None:
        _runner = threading.Thread(target=_run_loop, name="torchneuron-region-runner", daemon=True)
        _runner.start()
    tracer = metrics.tracer
    if tracer is not None:
        h.cut = tracer.cut_here()
    _runs.put((plan, seg, fn, external, runtime, h))
    return h


def _run_loop():
    while True:
        plan, seg, fn, external, runtime, h = _runs.get()
        tracer = metrics.tracer
        if tracer is not None:
            tracer.adopt_cut(h.cut)
        try:
            h.results = run_fused(plan, seg, fn, external, runtime, _LIST_ONLY)   # XLA runs it without the GIL
        except BaseException as err:   # raised in the user's thread when the run is joined
            h.error = err
        # Dropped before the joiner wakes, not kept while waiting for the next run: the inputs'
        # buffers (a step's old parameters and moments) go as soon as their storages have newer
        # ones, and a joined run holds none of them.
        plan = seg = fn = external = runtime = None
        latch, h = h.latch, None
        latch.release()


def reset_after_fork() -> None:
    """The worker thread is gone in a forked child (which may not use the device, runtime/fork.py):
    its exit must not wait for a run that will never finish."""
    global _runner, _runs
    _runner, _runs = None, queue.SimpleQueue()
