"""``torch.neuron.memory``: the memory functions of ``torch.cuda.memory``, for neuron devices.

Statistics come from the allocator (``runtime/memory.py``), which gives every storage its own
device buffer: there is no caching allocator of ours, so every allocation is one segment of one
block and ``empty_cache()`` has no cached blocks to release. Reserved memory is what PJRT's own
allocator holds where the platform reports its statistics (the GPU client's pool: its
``pool_bytes``, beside its other figures as ``pjrt.*`` keys), else (the CPU) allocated memory.
Counts and bytes match ``torch.cuda.memory_stats()``'s key names, for the ``all`` pool and the
caching allocator's ``small_pool`` (storages of at most 1 MiB) and ``large_pool``, each storage
counted in the pool its size puts it in (``allocated_bytes.small_pool.current``,
``segment.all.peak``, ``num_alloc_retries``...); byte peaks are
exact, count peaks are the largest live count seen when statistics are read (the allocation path
counts bytes only, to stay cheap).

``_record_memory_history()`` / ``_snapshot()`` / ``_dump_snapshot()`` produce the snapshot format
``torch.cuda.memory._snapshot()`` does (``segments`` and ``device_traces``), which PyTorch's
visualizer (https://pytorch.org/memory_viz, ``torch.cuda._memory_viz``) reads. Stacks are Python
stacks (torchneuron's own frames left out); a free is recorded when the allocator accounts for it,
at the next allocation or statistics read after PyTorch released the storage.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import time

from ..config import config
from . import host_memory, pjrt
from . import memory as _memory

__all__ = [
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_stats", "memory_summary", "mem_get_info", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_accumulated_memory_stats",
    "empty_cache", "memory_snapshot", "_record_memory_history", "_snapshot", "_dump_snapshot",
]

_allocator = _memory.allocator
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _index(device) -> int:
    # Imported here: device.py imports this module (torch.neuron.memory is this module).
    from .device import _index as index
    return index(device)


# -- statistics -----------------------------------------------------------------------------------
class _Accumulated:
    """Per (device, pool): the allocator's totals when accumulated statistics were last reset."""

    def __init__(self):
        self.bases: dict = {}   # (device index, pool) -> (allocated bytes, freed bytes, live, frees)
        self.count_peak: dict = {}   # (device index, pool) -> largest live count seen
        self.num_ooms: dict = {}


_acc = _Accumulated()
# torch.cuda.memory_stats()'s pools: all, and its caching allocator's small pool (blocks of at most
# 1 MiB) and large pool; a storage is in the pool its size puts it in (the allocator's pool flag).
_POOLS = (("all", None), ("small_pool", False), ("large_pool", True))


def _live(index: int) -> dict:
    """Pool name -> (number of live storages, their bytes) on one device."""
    small = large = 0
    for r in list(_allocator.records.values()):
        if r.device_index == index:
            if r.nbytes > _memory.LARGE_POOL:
                large += 1
            else:
                small += 1
    a = _allocator
    return {"all": (small + large, a.allocated.get(index, 0)),
            "small_pool": (small, a.pool_bytes.get((index, False), 0)),
            "large_pool": (large, a.pool_bytes.get((index, True), 0))}


def _since_start(index: int, large) -> tuple[int, int, int]:
    """(peak bytes, bytes freed, storages freed) of one pool (None: all) since start."""
    a = _allocator
    if large is None:
        return a.peak.get(index, 0), a.freed_bytes.get(index, 0), a.freed_count.get(index, 0)
    pool = (index, large)
    return a.pool_peak.get(pool, 0), a.pool_freed_bytes.get(pool, 0), a.pool_freed_count.get(pool, 0)


def memory_allocated(device=None) -> int:
    """Bytes held by live neuron tensors' storages on ``device``."""
    _allocator.collect()
    return _allocator.allocated.get(_index(device), 0)


def max_memory_allocated(device=None) -> int:
    """The peak of ``memory_allocated()`` since start or ``reset_peak_memory_stats()``."""
    _allocator.collect()
    return _allocator.peak.get(_index(device), 0)


def memory_reserved(device=None) -> int:
    """Bytes the device's allocator holds: PJRT's pool where the platform reports one (the GPU
    client's BFC allocator reserves its pool up front), else ``memory_allocated()`` (the CPU: each
    storage has its own buffer, nothing is cached)."""
    index = _index(device)
    return _pjrt_reserved(index, "pool_bytes", "bytes_in_use") or memory_allocated(index)


def max_memory_reserved(device=None) -> int:
    """The peak of ``memory_reserved()``: PJRT's own peak where it reports one (since the process
    started: ``reset_peak_memory_stats()`` cannot lower it), else ``max_memory_allocated()``."""
    index = _index(device)
    return _pjrt_reserved(index, "peak_pool_bytes", "peak_bytes_in_use") or max_memory_allocated(index)


def _pjrt_reserved(index: int, *names) -> int:
    """The first of PJRT's statistics ``names`` the device reports (0 where none is)."""
    stats = pjrt.memory_stats(index)
    return next((int(stats[n]) for n in names if stats.get(n)), 0)


def reset_peak_memory_stats(device=None) -> None:
    index = _index(device)
    a = _allocator
    a.collect()
    a.peak[index] = a.allocated.get(index, 0)
    live = _live(index)
    for name, large in _POOLS:
        if large is not None:
            a.pool_peak[(index, large)] = a.pool_bytes.get((index, large), 0)
        _acc.count_peak[(index, name)] = live[name][0]


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None) -> None:
    index = _index(device)
    _allocator.collect()
    live = _live(index)
    for name, large in _POOLS:
        count, current = live[name]
        _, freed_bytes, freed = _since_start(index, large)
        _acc.bases[(index, name)] = (current, freed_bytes, count, freed)
    _acc.num_ooms[index] = 0
    _allocator.num_allocs = _allocator.num_frees = 0


def _stat(prefix: str, current: int, peak: int, allocated: int, freed: int, out: dict) -> None:
    out[prefix + ".current"] = current
    out[prefix + ".peak"] = peak
    out[prefix + ".allocated"] = allocated
    out[prefix + ".freed"] = freed


def memory_stats(device=None) -> dict:
    """The statistics ``torch.cuda.memory_stats()`` gives, under the same key names (sorted), for
    its three pools: ``all``, ``small_pool`` (storages of at most 1 MiB) and ``large_pool``."""
    index = _index(device)
    a = _allocator
    a.collect()
    live_by_pool = _live(index)
    out: dict = {}
    for pool, large in _POOLS:
        live, current = live_by_pool[pool]
        peak_count = max(_acc.count_peak.get((index, pool), 0), live)
        _acc.count_peak[(index, pool)] = peak_count
        base_bytes, base_freed, base_live, base_frees = _acc.bases.get((index, pool), (0, 0, 0, 0))
        peak_bytes, freed_bytes, freed = _since_start(index, large)
        freed_bytes -= base_freed
        freed -= base_frees
        allocated_bytes = current - base_bytes + freed_bytes
        allocations = live - base_live + freed
        # No caching allocator of ours: active = requested = allocated, one segment per allocation;
        # reserved is PJRT's pool where the platform has one (below).
        for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
            _stat(f"{name}.{pool}", current, peak_bytes, allocated_bytes, freed_bytes, out)
        for name in ("allocation", "segment", "active"):
            _stat(f"{name}.{pool}", live, peak_count, allocations, freed, out)
        for name in ("inactive_split_bytes", "inactive_split"):
            _stat(f"{name}.{pool}", 0, 0, 0, 0, out)
        if pool == "all":
            device_allocs, device_frees = allocations, freed
    for name in ("oversize_allocations", "oversize_segments"):
        _stat(name, 0, 0, 0, 0, out)
    ooms = _memory.num_ooms.get(index, 0) - _acc.num_ooms.get(index, 0)
    out.update({"num_alloc_retries": 0, "num_ooms": ooms, "num_sync_all_streams": 0,
                "num_device_alloc": device_allocs, "num_device_free": device_frees,
                "max_split_size": -1,
                # torchneuron's own (all devices): allocations and frees since the last reset.
                "num_allocs": a.num_allocs, "num_frees": a.num_frees})
    stats = pjrt.memory_stats(index)
    if stats:   # the platform's allocator: its pool is what is reserved, its own figures beside
        out["reserved_bytes.all.current"] = memory_reserved(index)
        out["reserved_bytes.all.peak"] = max_memory_reserved(index)
        out.update({f"pjrt.{k}": int(v) for k, v in stats.items() if isinstance(v, int | float)})
    return dict(sorted(out.items()))


def _scaled(value: int, prefixes, step: int, threshold: int) -> tuple[int, str]:
    """``value`` in units of step**k, k growing while the value is still ``threshold`` or more
    (torch.cuda.memory_summary's cells)."""
    prefix, pref = prefixes[0], value
    for new_prefix in prefixes[1:]:
        if pref < threshold:
            break
        prefix = new_prefix
        value //= step
        pref /= step
    return value, prefix


def _format_size(sz: int) -> str:
    return "{:6d} {}".format(*_scaled(sz, ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"], 1024, 768 * 1024))


def _format_count(cnt: int) -> str:
    return "{:7d} {} ".format(*_scaled(cnt, [" ", "K", "M"], 1000, 750 * 1000))


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A table of ``memory_stats()`` laid out as ``torch.cuda.memory_summary()``'s: per metric the
    ``all`` row, then (unless ``abbreviated``) its large-pool and small-pool rows."""
    index = _index(device)
    stats = memory_stats(index)
    rows = [("allocated_bytes", "Allocated memory", _format_size),
            ("active_bytes", "Active memory", _format_size),
            ("requested_bytes", "Requested memory", _format_size),
            ("reserved_bytes", "Reserved memory", _format_size),
            ("inactive_split_bytes", "Non-releasable memory", _format_size),
            ("allocation", "Allocations", _format_count),
            ("active", "Active allocs", _format_count),
            ("segment", "Reserved segments", _format_count),
            ("inactive_split", "Non-releasable allocs", _format_count)]
    lines = ["=" * 75,
             f" {'':13} torchneuron memory summary, device neuron:{index:<17d} ",
             "-" * 75,
             f"  {'':9} OOMs: {stats['num_ooms']:<17d} | {'':6} alloc retries: {stats['num_alloc_retries']:<13d}  ",
             "=" * 75,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    pools = [("all", "")] if abbreviated else [("all", ""), ("large_pool", "      from large pool"),
                                               ("small_pool", "      from small pool")]
    for key, label, fmt in rows:
        lines.append("-" * 75)
        for pool, sub in pools:
            p = f"{key}.{pool}."
            cur, peak, alloc, freed = (stats[p + k] for k in ("current", "peak", "allocated", "freed"))
            lines.append(f" {sub or label:<21.21} | {fmt(cur)} | {fmt(peak)} | {fmt(alloc)} | {fmt(freed)} ")
    lines.append("=" * 75)
    return "|" + "|\n|".join(lines) + "|\n"


def mem_get_info(device=None) -> tuple[int, int]:
    """(free bytes, total bytes) of a device: PJRT's ``bytes_limit``/``bytes_in_use`` where the
    platform reports them (GPU, TPU, Neuron), else (the CPU platform) the host's memory less what
    live neuron storages hold."""
    index = _index(device)
    stats = pjrt.memory_stats(index)
    if stats.get("bytes_limit"):
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    total = pjrt.total_memory(index)
    return max(total - memory_allocated(index), 0), total


def empty_cache() -> None:
    """Run the garbage collector so that unreachable tensors' storages are freed (a storage's
    buffer goes when the storage dies), then, on the CPU platform, give the freed heap memory the
    process kept (``config.cpu_retain_freed_memory``) back to the operating system."""
    import gc  # only here: the one use
    gc.collect()
    _allocator.collect()
    host_memory.release_freed_memory()


# -- history and snapshots ------------------------------------------------------------------------
def _frames(skip: int = 2) -> list:
    """The Python stack of the caller, innermost first (torch.cuda's order), as snapshot frames;
    torchneuron's own frames are left out."""
    frames = []
    f = sys._getframe(skip)
    while f is not None:
        code = f.f_code
        filename = code.co_filename
        if not filename.startswith(_PACKAGE_DIR):
            frames.append({"filename": filename, "line": f.f_lineno, "name": code.co_name})
        f = f.f_back
    return frames


class _History:
    """Records allocations and frees while ``_record_memory_history`` is on (the allocator calls
    ``alloc``/``free`` only when ``memory.history`` is set)."""

    def __init__(self, trace: bool, alloc_stacks: bool, free_stacks: bool, state_stacks: bool,
                 max_entries: int):
        self.trace = trace
        self.alloc_stacks, self.free_stacks, self.state_stacks = alloc_stacks, free_stacks, state_stacks
        self.entries: dict = {}   # device index -> deque of trace entries
        self.max_entries = max_entries
        self.live_frames: dict = {}   # storage address -> frames of its allocation

    def _entries(self, index: int):
        found = self.entries.get(index)
        if found is None:
            found = self.entries[index] = collections.deque(maxlen=self.max_entries)
        return found

    def _add(self, index: int, action: str, addr: int, size: int, frames: list, **extra) -> None:
        entry = {"action": action, "addr": addr, "size": size, "stream": 0,
                 "time_us": time.time_ns() // 1000, "frames": frames, **extra}
        self._entries(index).append(entry)

    def alloc(self, addr: int, nbytes: int, index: int) -> None:
        frames = _frames(3) if (self.alloc_stacks or self.state_stacks) else []
        if self.state_stacks:
            self.live_frames[addr] = frames
        if self.trace:
            recorded = frames if self.alloc_stacks else []
            self._add(index, "segment_alloc", addr, nbytes, recorded)
            self._add(index, "alloc", addr, nbytes, recorded)

    def free(self, addr: int, nbytes: int, index: int) -> None:
        self.live_frames.pop(addr, None)
        if self.trace:
            frames = _frames(3) if self.free_stacks else []
            self._add(index, "free_requested", addr, nbytes, frames)
            self._add(index, "free_completed", addr, nbytes, frames)
            self._add(index, "segment_free", addr, nbytes, frames)

    def oom(self, index: int, nbytes: int, device_free: int) -> None:
        if self.trace:
            self._add(index, "oom", 0, nbytes, _frames(3) if self.alloc_stacks else [],
                      device_free=device_free)


def _record_memory_history(enabled: str | None = "all", context: str | None = "all",
                           stacks: str = "all", max_entries: int = sys.maxsize, device=None,
                           clear_history: bool = False, **_ignored) -> None:
    """Start (``enabled="all"``: trace every alloc/free; ``"state"``: only the live allocations'
    stacks) or stop (``enabled=None``) recording, as ``torch.cuda.memory._record_memory_history``.

    ``context``: whose stacks are kept -- ``"all"`` (allocations and frees), ``"alloc"``,
    ``"state"`` (live allocations only) or None. ``stacks``: ``"python"`` and ``"all"`` both record
    Python stacks (there are no C++ frames to add). ``max_entries``: the trace keeps the newest."""
    if enabled is True or enabled is False:   # the older boolean form of the same call
        enabled = "all" if enabled else None
    if enabled not in (None, "all", "state"):
        raise ValueError(f"torchneuron: _record_memory_history(enabled={enabled!r}): expected "
                         "'all', 'state' or None")
    if context not in (None, "all", "alloc", "state"):
        raise ValueError(f"torchneuron: _record_memory_history(context={context!r}): expected "
                         "'all', 'alloc', 'state' or None")
    if stacks not in ("python", "all"):
        raise ValueError(f"torchneuron: _record_memory_history(stacks={stacks!r}): expected "
                         "'python' or 'all'")
    _allocator.collect()   # frees before this call are not part of the history
    if enabled is None:
        _memory.history = None
        return
    previous = _memory.history
    history = _History(trace=enabled == "all", alloc_stacks=context in ("all", "alloc"),
                       free_stacks=context == "all", state_stacks=context is not None,
                       max_entries=max_entries)
    if previous is not None and not clear_history:
        history.live_frames = previous.live_frames
        for index, entries in previous.entries.items():
            history._entries(index).extend(entries)
    _memory.history = history


def _block_frames(history, addr: int) -> list:
    if history is None:
        return []
    return history.live_frames.get(addr, [])


def _snapshot(device=None, augment_with_fx_traces: bool = False) -> dict:
    """The allocator's state and recorded trace, in ``torch.cuda.memory._snapshot()``'s format."""
    _allocator.collect()
    history = _memory.history
    segments = []
    for addr, rec in sorted(list(_allocator.records.items())):
        frames = _block_frames(history, addr)
        block = {"address": addr, "size": rec.nbytes, "requested_size": rec.nbytes,
                 "state": "active_allocated", "frames": frames}
        segments.append({
            "device": rec.device_index, "address": addr, "total_size": rec.nbytes,
            "allocated_size": rec.nbytes, "active_size": rec.nbytes, "requested_size": rec.nbytes,
            "stream": 0, "segment_type": "large" if rec.nbytes > _memory.LARGE_POOL else "small",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames, "blocks": [block]})
    count = max(pjrt.device_count(), 1)
    traces = [[] for _ in range(count)]
    if history is not None:
        for index, entries in history.entries.items():
            if index < count:
                traces[index] = [dict(e) for e in entries]
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_NEURON_ALLOC_CONF": "", "expandable_segments": False}}


def memory_snapshot() -> list:
    """The live segments (``torch.cuda.memory_snapshot()``: ``_snapshot()["segments"]``)."""
    return _snapshot()["segments"]


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Write ``_snapshot()`` as a pickle (open it at https://pytorch.org/memory_viz, or render it
    with ``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``)."""
    snapshot = _snapshot()
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)


def _on_oom(device_index: int, nbytes: int) -> None:
    """Called by the allocator before it raises ``torch.OutOfMemoryError``: records the OOM in the
    history and writes a snapshot where ``config.oom_snapshot`` says."""
    free = max(pjrt.total_memory(device_index) - _allocator.allocated.get(device_index, 0), 0)
    history = _memory.history
    if history is not None:
        history.oom(device_index, nbytes, free)
    path = config.oom_snapshot
    if path:
        try:
            _dump_snapshot(path)
        except OSError as e:
            print(f"torchneuron: could not write the out-of-memory snapshot to {path}: {e}",
                  file=sys.stderr)
