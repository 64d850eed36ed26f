"""The background compiler of adaptive eager: fused executables of repeated plans' segments,
compiled on a low-priority thread within a CPU-time budget."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time

import jax

from ...config import config
from ...metrics import metrics
from ...runtime import donation, executable_store
from ..plan import sharding
from . import isolate, plans


def _trace_op(exe, bufs, runtime):
    time.sleep(0)   # tracing holds the GIL: let the user's thread in between ops
    return exe.traced(*bufs, *runtime)


def written_inputs(seg) -> tuple:
    """Positions of ``seg``'s inputs whose storages it writes: their old buffers are dead after it."""
    out = set(seg.out_sids)
    return tuple(i for i, sid in enumerate(seg.in_sids) if sid in out)


def _fused(seg, device, donated=()):
    """The fused executable of ``seg``, donating the inputs at ``donated`` (bisection's pieces,
    run on samples of live buffers, donate nothing)."""
    ops, in_sids, out_sids = seg.ops, seg.in_sids, seg.out_sids
    n_in = len(in_sids)

    def run(*flat):
        current = dict(zip(in_sids, flat[:n_in]))
        found = plans.interpret(ops, current, flat[n_in:], _trace_op)
        seg.checked = tuple(n for n, _ in found)   # before seg.fn is set: the caller reads both
        return tuple(current[sid] for sid in out_sids) + tuple(outcome for _, outcome in found)

    return jax.jit(run, out_shardings=sharding(device), donate_argnums=donated)


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

    def charge(self, seconds: float):
        """Work that is not one region's compile (a bisection's probes): its time, not a model's."""
        if config.adaptive_compile_budget < 1:
            with self.lock:
                self.tokens -= seconds


budget = CompileBudget()
_jobs: queue.Queue = queue.Queue()
_pending = 0
_idle = threading.Condition()
_worker = None
_closing = False


def submit(plan, seg, device, sample, failure=None):
    """Queue the compile of ``plan``'s segment ``seg`` on the inputs ``sample`` (its buffers, then its
    runtime inputs); with ``failure`` (reason, error text), the bisection of a segment whose fused
    executable failed when it ran."""
    global _pending, _worker
    seg.state = "compiling" if failure is None else "bisecting"
    with _idle:
        _pending += 1
        if _worker is None:
            _worker = threading.Thread(target=_compile_loop, name="torchneuron-region-compiler", daemon=True)
            _worker.start()
    _jobs.put((plan, seg, device, sample, failure))


def _compile_loop():
    global _pending
    with contextlib.suppress(OSError, AttributeError):
        # Linux threads have their own nice value: the user's thread keeps the CPU first.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    while True:
        job = _jobs.get()
        if not _closing:
            _compile(*job)
        with _idle:
            _pending -= 1
            _idle.notify_all()


def _compile(plan, seg, device, sample, failure):
    start = time.perf_counter()
    verify = config.adaptive_verify_fusion
    if failure is None:
        try:
            donated = written_inputs(seg)
            fn = _fused(seg, device, donated)
            # Calling it (not lower().compile()) fills jit's C++ dispatch cache with the signature
            # the user's thread will call it with; the run itself is a pure function's, its result
            # unused (but compared with the ops run one by one when verifying). The sample's
            # buffers may still be storages' (or shared): what it donates is a copy.
            results = fn(*[donation.private_copy(b, device) if i in donated else b for i, b in enumerate(sample)])
            if verify:
                diff = isolate.difference(seg, results, isolate.Reference(seg, sample))
                if diff is not None:
                    failure = ("differs", diff)
        except Exception as err:   # bisected below; the region runs op by op meanwhile
            failure = ("compile failed", f"{type(err).__name__}: {err}".splitlines()[0][:500])
        else:
            if failure is None:
                _ready(seg, fn, donated)
        seconds = time.perf_counter() - start
        metrics.region_compile_seconds += seconds
        budget.settle(len(seg.ops), seconds)
        if failure is None:
            return
    seg.error = failure[1]
    try:
        seconds = isolate.bisect(plan, seg, device, sample, failure, _fused, verify or failure[0] == "differs")
    except Exception as err:   # the ops fail one by one too: the segment stays op by op
        seg.state, seg.error = failure[0], f"{failure[1]}; bisecting it failed: {type(err).__name__}: {err}"
        return
    metrics.region_compile_seconds += seconds
    budget.charge(seconds)


def _ready(seg, fn, donated=()):
    seg.donated = donated   # before fn: the user's thread reads fn first
    seg.fn = fn
    seg.state = "ready"
    metrics.region_compiles += 1
    # Custom kernels (torchneuron.kernel) are named with their namespace, ATen ops not.
    metrics.custom_kernel_compiles.update({exe.name for exe, *_ in seg.ops if "::" in exe.name})
    if executable_store.logging_lookups():
        executable_store.log("compiled", "regions", f"adaptive-eager region of {len(seg.ops)} ops",
                             "fused regions are compiled in the background and never kept on disk",
                             cacheable=False)


def run_failed(plan, seg, sample, err) -> None:
    """The fused executable of ``seg`` raised when it ran (its ops then ran one by one on the
    user's thread, and gave results): it runs op by op from now on, bisected in the background to
    fuse what runs; after a third failure it is not bisected again."""
    seg.fn = None
    seg.failures += 1
    text = f"{type(err).__name__}: {err}".splitlines()[0][:500]
    if seg.failures > 2:
        seg.state, seg.error = "run failed", text
        return
    submit(plan, seg, plan.device, sample, ("run failed", text))


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until every queued region compile finished (tests, benchmarks); False on timeout."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout)


def close() -> None:
    """At exit: queued compiles are dropped; one in flight finishes first."""
    global _closing
    _closing = True
    wait_for_compiles()
