"""Adaptive eager mode: record eager ops, run each pending region as one fused executable.

With the mode on, a lowered op does everything plain eager does up to the point of running: it
binds its arguments, checks shapes and dtypes (PyTorch's meta rules, so errors surface at the
user's line), applies promotion and the float64 policy, and allocates its outputs as real neuron
storages. Instead of running, it appends itself to the pending region. The outputs' buffers are
"pending" until a sync point flushes the region:

- a host read (``.cpu()``, ``.item()``, ``.tolist()``, printing) of any pending storage,
- ``torch.neuron.synchronize()``, a CPU fallback, a host write into a device tensor,
- the region reaching ``config.adaptive_max_ops`` ops, switching the mode off, or the program exiting.

A flush traces the recorded ops' own bodies (the same ``_Traced`` functions plain eager jits) into
one JAX function, in order, threading each storage's current buffer from op to op, and returns the
buffers of the storages still alive. Regions are cached by structure (the ops' cache keys and how
their storages connect, plus which results are still alive): a training loop compiles its step
once, then only hits the cache. Scalars and RNG offsets stay runtime inputs, so values, in-place
effects, views, autograd, RNG streams and memory statistics are those of plain eager.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time

import jax

from ..config import config
from ..metrics import metrics
from ..runtime import memory, sites
from . import kernel

_records = memory.allocator.records


class Region:
    """The ops recorded since the last flush and the storages they connect."""

    def __init__(self):
        self.lock = threading.RLock()
        self.reset()

    def reset(self):
        self.ops = []            # (executable, input storage ids, output storage ids, runtime count)
        self.runtime = []        # every op's runtime inputs (scalars, RNG seeds/offsets), in order
        self.sid_of = {}         # storage address -> storage id within the region
        self.addr_of = []        # storage id -> address
        self.external = []       # buffers read from storages that existed before the region
        self.external_sids = []
        self.results = set()     # storage ids whose buffer the region produces (outputs, writes)
        self.sites = []          # per op: its call site, for ops that may have device checks

    def _sid(self, addr, buf):
        sid = self.sid_of.get(addr)
        if sid is None:
            sid = self.sid_of[addr] = len(self.addr_of)
            self.addr_of.append(addr)
            if buf is not None:
                # Capture the buffer now: the storage may die before the flush.
                self.external.append(buf)
                self.external_sids.append(sid)
        return sid

    def record(self, k, exe, values, ctx):
        with self.lock:
            input_sids = tuple(self._sid(addr, buf) for addr, buf in zip(ctx.addrs, ctx.bufs))
            device_index = ctx.device_index if ctx.device_index is not None else k.output_device(values)
            outs, out_sids = [], []
            for spec in exe.out_specs:
                if spec is None:
                    outs.append(None)
                    out_sids.append(None)
                    continue
                dtype, sizes, strides = spec
                numel = 1
                for s in sizes:
                    numel *= s
                t = memory.allocator.new_tensor(sizes, strides, dtype, device_index, buf=PENDING,
                                                storage_nbytes=numel * dtype.itemsize)
                sid = self._sid(t.untyped_storage().data_ptr(), None)
                out_sids.append(sid)
                self.results.add(sid)
                outs.append(t)
            for slot in exe.writes:
                _records[ctx.addrs[slot]].buf = PENDING
                self.results.add(input_sids[slot])
            self.ops.append((exe, input_sids, tuple(out_sids), len(ctx.runtime)))
            # Device checks are known once an executable was traced (None: not yet).
            maybe_checked = exe.traced.checks is None or exe.traced.checks
            self.sites.append(sites.place(sys._getframe()) if maybe_checked else None)
            self.runtime.extend(ctx.runtime)
            full = len(self.ops) >= config.adaptive_max_ops
        if full:
            self.flush("size limit")
        return k.returned(outs, values)

    def flush(self, reason: str) -> None:
        if not self.ops:
            return
        with self.lock:
            if not self.ops:
                return
            ops, runtime, op_sites = self.ops, self.runtime, self.sites
            external, external_sids, addr_of = self.external, self.external_sids, self.addr_of
            memory.allocator.collect()   # storages freed meanwhile need no output
            live = tuple(sorted(sid for sid in self.results if addr_of[sid] in _records))
            self.reset()
            # Executables stand for their cache keys (one per key, hashed by identity: cheaper than
            # re-hashing every op's key at each flush, and held alive here so ids are not reused).
            structure = (tuple(ops), tuple(external_sids), live)
            built = _regions.get(structure)
            if built is None:
                built = _build(ops, external_sids, live)
                start = time.perf_counter()
                results = built[0](*external, *runtime)
                metrics.compile_seconds += time.perf_counter() - start
                metrics.region_compiles += 1
                metrics.executables_compiled += 1
                # Custom kernels (torchneuron.kernel) are named with their namespace, ATen ops not.
                metrics.custom_kernel_compiles.update({exe.op_name for exe, *_ in ops if "::" in exe.op_name})
                _regions[structure] = built
            else:
                metrics.region_cache_hits += 1
                results = built[0](*external, *runtime)
            for sid, buf in zip(live, results):
                rec = _records.get(addr_of[sid])
                if rec is not None:
                    rec.buf = buf
            # Then the outcomes of the ops' device checks, in op order.
            for n, outcome in zip(built[1], results[len(live):]):
                ops[n][0].traced.report(outcome, op_sites[n])
            metrics.regions_flushed += 1
            metrics.region_ops += len(ops)
            metrics.flush_reasons[reason] += 1


PENDING = memory.PENDING
_regions: dict = {}
region = Region()


def _build(ops, external_sids, live):
    """(the region's jitted function, indices of the ops whose device-check outcomes it returns
    after the live buffers -- known once the function has been traced, at its first call)."""
    n_external = len(external_sids)
    checked = []

    def run(*flat):
        current = dict(zip(external_sids, flat[:n_external]))
        position = n_external
        outcomes = []
        checked.clear()
        for n, (exe, input_sids, out_sids, n_runtime) in enumerate(ops):
            bufs = [current[sid] for sid in input_sids]
            results = exe.traced(*bufs, *flat[position:position + n_runtime])
            position += n_runtime
            k = 0
            for sid in out_sids:
                if sid is not None:
                    current[sid] = results[k]
                    k += 1
            for slot in exe.writes:
                current[input_sids[slot]] = results[k]
                k += 1
            if exe.traced.checks:
                outcomes.append(results[k])
                checked.append(n)
        return tuple(current[sid] for sid in live) + tuple(outcomes)

    return jax.jit(run), checked


def device_checks_changed(mode: str) -> None:
    """Executables compile their device checks in (or not): forget the eager and region caches
    when ``config.device_checks`` changes (installed as its observer by ``torchneuron.register``)."""
    flush("settings change")
    kernel.clear_cache()
    _regions.clear()


# -- public switches ----------------------------------------------------------------------------
def flush(reason: str = "explicit") -> None:
    """Run every pending recorded op (a no-op in plain eager mode or with nothing pending)."""
    if region.ops:
        region.flush(reason)


def set_eager_mode(mode: str) -> None:
    """``"adaptive"`` records and fuses eager ops; ``"plain"`` runs each op as it is called."""
    config.eager_mode = mode  # validates, then calls apply_mode


def apply_mode(mode: str) -> None:
    """Follow ``config.eager_mode`` (installed as its observer by ``torchneuron.register``)."""
    if mode == "adaptive":
        kernel.recorder = region
    else:
        kernel.recorder = None
        flush("mode change")


@contextlib.contextmanager
def eager_mode(mode: str):
    """Run a block in the given eager mode, restoring the previous one afterwards."""
    previous = config.eager_mode
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def region_cache_size() -> int:
    return len(_regions)


memory.flush_pending = flush
atexit.register(lambda: flush("exit"))
