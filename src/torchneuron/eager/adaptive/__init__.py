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

The package, by job: ``recorder`` (the pending region: recording, replay, the cut), ``plans`` (a
region's structure, its segments, how a replayed call is checked), ``run`` (running a region at its
cut, op by op or fused, and the overlap worker), ``compiler`` (the background compiler and its
budget); this module holds the public switches.
"""

from __future__ import annotations

import atexit
import contextlib
import os

from ... import seams
from ...config import config
from .. import kernel
from . import compiler, plans, recorder
from . import run as runs
from .compiler import CompileBudget, budget, wait_for_compiles
from .recorder import region

__all__ = ["CompileBudget", "budget", "clear_region_cache", "device_checks_changed", "eager_mode", "flush",
           "region", "region_cache_size", "set_eager_mode", "wait_for_compiles"]


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
        seams.seam("recorder").install(region)
        budget.start()
        if not _optimizer_hooks:
            from torch.optim.optimizer import (  # not at the top: torch.optim is only needed here
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )
            _optimizer_hooks.append(register_optimizer_step_pre_hook(_before_step))
            _optimizer_hooks.append(register_optimizer_step_post_hook(_after_step))
    else:
        seams.seam("recorder").uninstall()
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
        plans.table.clear()
        plans.starts.clear()
        recorder.traced_once.clear()
        region.prev = region.cursor = None


def clear_region_cache() -> None:
    """Forget every region plan and fused executable (the next occurrences start as first sightings)."""
    with region.lock:
        plans.table.clear()
        plans.starts.clear()
        plans.recent.clear()
        budget.tokens = 0.0
        region.prev = region.cursor = None


def region_cache_size() -> int:
    """How many region segments have a fused executable."""
    return sum(1 for plan in plans.table.values() for seg in plan.segments if seg.fn is not None)


def _shutdown():
    flush("exit")
    compiler.close()


def _after_fork_in_child():
    runs.reset_after_fork()
    region.inflight = None


seams.seam("flush_pending").install(flush)
seams.seam("wait_in_flight").install(_wait_in_flight)
os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown)
