"""Compiled graphs, cached twice: in memory for the process, and on disk (``compile.cache``).

The same graph on the same input signature (a re-created torch.compile, a Dynamo recompile that
traced an identical graph) reuses the executable: no trace, no compile.
"""

from __future__ import annotations

import hashlib
import time

import torch

from ..config import config
from ..metrics import metrics
from ..runtime import donation, executable_store, pjrt
from ..runtime.executable import Executable
from . import cache

# (graph hash, input signature, device) -> executable, shared by every GraphProgram in the process.
_shared: dict = {}


def clear_cache() -> None:
    """Forget in-memory graph executables (the persistent cache on disk stays)."""
    _shared.clear()


def digest(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()


def cached(graph_hash, key, device_index, need_trace: bool):
    """The executable of this graph and input signature from memory, else from the on-disk index
    (unless ``need_trace``: dumps need the StableHLO, custom kernels' code is not in the key), else
    None."""
    shared_key = (graph_hash, key, device_index)
    exe = _shared.get(shared_key)
    if exe is not None:
        metrics.extra["graph_memory_cache_hits"] += 1
        return exe
    if need_trace:
        return None
    start = time.perf_counter()
    # The executable runs on the call's device only (a multi-device client would otherwise expect
    # one shard per device).
    loaded = cache.load_graph(_disk_key(graph_hash, key, device_index), [pjrt.device(device_index or 0)])
    if loaded is None:
        return None
    compiled, meta = loaded
    seconds = time.perf_counter() - start
    metrics.compile_seconds += seconds
    metrics.extra["graph_compile_seconds"] += seconds
    metrics.extra["graph_persistent_cache_hits"] += 1
    metrics.extra["graph_index_hits"] += 1
    exe = Executable(compiled, meta["name"], tuple(meta["writes"]), config.device_checks,
                     tuple(meta.get("checks", ())), n_new=meta["n_new"], n_host=meta["n_host"],
                     host_writes=tuple(meta["host_writes"]))
    exe.donated = donation.donated_slots(compiled)
    if executable_store.logging_lookups():
        executable_store.log("served", "graphs", meta.get("what") or meta["name"])
    _shared[shared_key] = exe
    return exe


# Why a graph compiled without looking in the graph index (``not_indexed`` of compile_traced).
BUCKETED = "bucketed graphs are kept in JAX's compilation cache only, which had no entry for this one"


def compile_traced(fn, bufs, runtime, index=None, not_indexed=BUCKETED, donate=False):
    """(lowered, compiled, persistent-cache hits) of ``fn`` traced on the call's inputs; the time
    it takes is counted as compile time. ``index`` is the (graph hash, input signature, device)
    the graph index was asked for, None when it was not asked (``not_indexed`` says why). With
    ``donate``, the buffers of the storages ``fn.writes`` names (known once traced) are donated:
    the caller makes them private before each call (``runtime/donation.py``)."""
    start = time.perf_counter()
    with cache.graph_compile_context() as hits:
        # The storages the graph writes (parameters and optimizer state in a training step, a KV
        # cache) donate their buffers: XLA updates them in place.
        lowered = donation.lower(fn, [*bufs, *runtime], lambda traced: traced.writes if donate else ())
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    metrics.compile_seconds += seconds
    metrics.extra["graph_compile_seconds"] += seconds
    if hits.count:
        metrics.extra["graph_persistent_cache_hits"] += 1
    else:
        metrics.graphs_compiled += 1
        metrics.executables_compiled += 1
    if executable_store.logging_lookups():
        if hits.count:
            executable_store.log("served", "graphs", describe(fn), "JAX compilation cache")
        elif index is not None:
            executable_store.log("compiled", "graphs", describe(fn),
                                 *executable_store.miss_reason("graphs", _disk_key(*index)))
        elif not cache.enabled():
            executable_store.log("compiled", "graphs", describe(fn),
                                 *executable_store.miss_reason("graphs", None))
        else:
            executable_store.log("compiled", "graphs", describe(fn), not_indexed)
    return lowered, compiled, hits.count


def describe(fn) -> str:
    """A traced graph as ``torchneuron cache verify`` names it: its kind, name, the start of its
    hash and its inputs' dtypes and sizes."""
    program = getattr(fn, "p", None)
    if program is None:
        return getattr(fn, "__name__", "graph")
    shown = [f"{str(s[0]).removeprefix('torch.')}{list(s[1])}" for s in getattr(fn, "specs", ())
             if isinstance(s, tuple) and len(s) > 1 and isinstance(s[0], torch.dtype)]
    digest_text = getattr(program, "graph_hash", "")[:12]
    return f"{program.kind} graph {program.name}" + (f" [{digest_text}]" if digest_text else "") + \
        f"({', '.join(shown)})"


def remember(graph_hash, key, device_index, exe: Executable, compiled, from_jax_cache: bool,
             on_disk: bool = True) -> None:
    """Keep a new executable in memory, and on disk when XLA compiled it just now (and ``on_disk``)."""
    if on_disk and not from_jax_cache:
        # Only a freshly compiled executable goes into the index: one that XLA deserialized
        # from JAX's cache serializes again without its fused CPU kernels, and loading that
        # entry later fails at run time ("Function ... not found").
        cache.store_graph(_disk_key(graph_hash, key, device_index), compiled, exe.meta())
    _shared[(graph_hash, key, device_index)] = exe


def _disk_key(graph_hash, key, device_index) -> str:
    return cache.graph_key(graph_hash, key, device_index or 0)

