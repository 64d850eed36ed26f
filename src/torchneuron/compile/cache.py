"""Where compiled graphs persist: JAX's persistent compilation cache, a graph index, dumps.

Graph executables are compiled through JAX's persistent compilation cache in ``config.cache_dir``
(``TORCHNEURON_CACHE_DIR``; "" turns caching off), keyed by JAX on the StableHLO module, compile
options and the PJRT platform version, so a process that traces the same graph loads it instead
of compiling it. Every graph is written (minimum compile time 0); eager per-op executables stay
out of it (they have their own index in ``runtime.executable_store``).

Tracing the interpreter and lowering to StableHLO still cost seconds per large graph before JAX can
even compute its key, so ``<cache_dir>/graphs/`` also keeps an index from the graph itself (FX code,
constants, input signature, platform, versions and a fingerprint of every torchneuron source file)
to the serialized executable: a warm process goes from the FX graph straight to a loaded executable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import warnings

import jax
from jax._src import compilation_cache
from jax._src import config as jax_config

from ..config import config
from ..runtime import executable_store

_tls = threading.local()
_lock = threading.Lock()
_configured_dir: str | None = None     # the config.cache_dir last configured
_active_dir = ""                        # the folder JAX was given ("" for off)
_listening = False


class Hits:
    """Persistent-cache hits JAX reported while one graph compiled."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


def _on_event(event: str, **_kwargs) -> None:
    hits = getattr(_tls, "hits", None)
    if hits is not None and event == "/jax/compilation_cache/cache_hits":
        hits.count += 1


def _configure() -> str:
    """Point JAX's persistent cache at config.cache_dir (again, if the setting changed); returns
    the folder in use ("" when caching is off or the folder is unusable)."""
    global _configured_dir, _active_dir, _listening
    want = config.cache_dir or ""
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
        if want == _configured_dir:
            return _active_dir
        first, _configured_dir = _configured_dir is None, want
        if first and jax.config.jax_compilation_cache_dir and not want:
            # The user set up JAX's cache themselves and turned ours off: leave theirs alone.
            _active_dir = ""
            return _active_dir
        if want and not usable_dir(want, "compile cache", "TORCHNEURON_CACHE_DIR",
                                   "compiled graphs are not kept on disk"):
            want = ""
        jax.config.update("jax_compilation_cache_dir", want or None)
        # JAX opens its cache once per process; make it reopen at the new place.
        compilation_cache.reset_cache()
        _active_dir = want
    return want


_unusable: dict = {}   # directory -> why it cannot be used (each warned about once)


def usable_dir(directory: str, what: str, variable: str, consequence: str) -> bool:
    """Whether ``directory`` exists (or can be created) and takes files. The caches and dumps are
    optional: an unusable folder (a read-only HOME, a path under a file) is one warning, not an
    error that stops torch.compile."""
    if directory in _unusable:
        return False
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
        return True
    except OSError as err:
        _unusable[directory] = err
        warnings.warn(
            f"torchneuron: the {what} folder {directory!r} cannot be used ({err.strerror or err}); "
            f"{consequence}. Set {variable} to a writable folder (\"\" turns it off).", stacklevel=3)
        return False


@contextlib.contextmanager
def graph_compile_context():
    """Around one graph's lower+compile: persistent cache on for it, hits counted."""
    directory = _configure()
    hits = Hits()
    previous = getattr(_tls, "hits", None)
    _tls.hits = hits
    try:
        if directory:
            with jax_config.persistent_cache_min_compile_time_secs(0.0):
                yield hits
        else:
            yield hits
    finally:
        _tls.hits = previous


def dump(name: str, gm, lowered, specs, dump_dir: str | None = None) -> None:
    """Write the graph's FX code and StableHLO text to dump_dir (config.dump_dir by default)."""
    directory = dump_dir or config.dump_dir
    if not directory or not usable_dir(directory, "dump", "TORCHNEURON_DUMP_DIR",
                                       "graphs are compiled without writing their dumps"):
        return
    try:
        _write_dump(directory, name, gm, lowered, specs)
    except OSError as err:   # e.g. the disk filled up: the compile itself is fine
        warnings.warn(f"torchneuron: could not write the dump of graph {name} to {directory!r}: {err}",
                      stacklevel=2)


def _write_dump(directory, name, gm, lowered, specs) -> None:
    with open(os.path.join(directory, f"{name}.fx.py"), "w") as f:
        f.write(f"# torchneuron torch.compile graph {name}\n")
        f.write("# input signature (dtype, sizes, strides, storage offset (None: a runtime input), "
                "storage slot, storage numel):\n")
        for i, spec in enumerate(specs):
            f.write(f"#   {i}: {spec}\n")
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))
    with open(os.path.join(directory, f"{name}.stablehlo.mlir"), "w") as f:
        f.write(lowered.as_text())


# -- the graph index -----------------------------------------------------------------------------
# Stored with eager executables in ``runtime.executable_store`` (under ``<cache_dir>/graphs/``).
package_sources = executable_store.package_sources


def graph_key(graph_hash: str, signature, device_index: int) -> str:
    return executable_store.key(graph_hash, signature, device_index)


def enabled() -> bool:
    """Whether graphs are kept on disk (config.cache_dir is set and usable)."""
    return bool(_configure())


def load_graph(key: str, devices):
    """(loaded executable, metadata dict) for an indexed graph, or None."""
    if not _configure():
        return None
    return executable_store.load("graphs", key, devices)


def store_graph(key: str, compiled, meta: dict) -> None:
    if _configure():
        executable_store.store("graphs", key, compiled, meta)
