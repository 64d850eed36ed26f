"""Compiled graphs, cached twice: in memory for the process, and on disk (``compile.cache``).

The same graph on the same input signature (a re-created torch.compile, a Dynamo recompile that
traced an identical graph) reuses the executable: no trace, no compile.
"""

from __future__ import annotations

import hashlib
import time

import jax

from ..config import config
from ..metrics import metrics
from ..runtime import pjrt
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
    _shared[shared_key] = exe
    return exe


def compile_traced(fn, bufs, runtime):
    """(lowered, compiled, persistent-cache hits) of ``fn`` traced on the call's inputs; the time
    it takes is counted as compile time."""
    start = time.perf_counter()
    with cache.graph_compile_context() as hits:
        lowered = jax.jit(fn).lower(*bufs, *runtime)
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    metrics.compile_seconds += seconds
    metrics.extra["graph_compile_seconds"] += seconds
    if hits.count:
        metrics.extra["graph_persistent_cache_hits"] += 1
    else:
        metrics.graphs_compiled += 1
        metrics.executables_compiled += 1
    return lowered, compiled, hits.count


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

