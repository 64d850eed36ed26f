"""Compiled executables kept on disk, so a new process loads what an earlier one compiled.

Both eager per-op executables (``<cache_dir>/eager/``) and torch.compile graphs
(``<cache_dir>/graphs/``) are stored here, in ``config.cache_dir`` (``TORCHNEURON_CACHE_DIR``;
"" turns it off). An entry is found by a key computed from what decides the program (for an eager
op: its cache key; for a graph: its FX code and input signature) together with a fingerprint of
versions, platform and the torchneuron code that decides an executable (``fingerprint_sources``),
so a change to that code invalidates it and a change elsewhere (the report, the CLI) does not.

Only executables XLA compiled in this process may be stored: one that XLA deserialized from JAX's
own persistent cache serializes again without its fused CPU kernels, and loading that entry later
fails at run time ("Function ... not found"). Callers keep JAX's cache out of the compiles whose
results they store, or skip storing them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
import warnings

import jax
import torch
from jax._src.lax import linalg as jax_linalg
from jax.experimental import serialize_executable

from ..config import config
from ..metrics import metrics
from . import pjrt

_FORMAT = 1
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What decides an executable: the packages that plan, lower and compile it (lowerings, layouts,
# dtype rules and their data, kernels, graphs) and the settings they read. The other top-level
# modules and packages (metrics, profiler, report, cli, distributed, integrations) only count,
# render or set things up around it.
FINGERPRINTED = ("runtime", "ops", "eager", "compile", "kernels", "config.py")


def _walk(root: str, suffixes: tuple[str, ...]) -> list[str]:
    if os.path.isfile(root):
        return [root]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        found.extend(os.path.join(directory, n) for n in sorted(files) if n.endswith(suffixes))
    return found


def package_sources() -> list[str]:
    """Every Python source file of the installed torchneuron package, in a stable order."""
    return _walk(_PACKAGE_ROOT, (".py",))


def fingerprint_sources(root: str = _PACKAGE_ROOT) -> list[str]:
    """The files ``fingerprint`` hashes: the sources and data files (the dtype-refusal table) of
    ``FINGERPRINTED`` under the package directory ``root``, in a stable order."""
    found = []
    for part in FINGERPRINTED:
        found.extend(_walk(os.path.join(root, part), (".py", ".json")))
    return found


@functools.cache
def fingerprint() -> str:
    """Versions, platform and the code that decides an executable (``fingerprint_sources``): a
    change there invalidates the store (what an executable computes depends on lowerings, layouts,
    dtype rules, config...)."""
    h = hashlib.sha256()
    dev = pjrt.devices()[0]
    h.update(repr((_FORMAT, sys.version, torch.__version__, jax.__version__, config.platform,
                   dev.platform, dev.device_kind, pjrt.platform_version(),
                   os.environ.get("XLA_FLAGS", ""))).encode())
    for name in fingerprint_sources():
        with open(name, "rb") as f:
            h.update(os.path.relpath(name, _PACKAGE_ROOT).encode())
            h.update(f.read())
    return h.hexdigest()


def key(*parts) -> str:
    """The entry name for ``parts`` (whose ``repr`` must be the same in every process)."""
    return hashlib.sha256(repr((fingerprint(), parts)).encode()).hexdigest()


def enabled() -> bool:
    return bool(config.cache_dir)


def _path(kind: str, name: str) -> str | None:
    directory = config.cache_dir
    return os.path.join(directory, kind, f"{name}.tnexe") if directory else None


def _prepare_custom_calls() -> None:
    """XLA's CPU LAPACK custom calls (cholesky, qr, eigh, svd, lu, triangular solve...) get their
    function pointers when JAX first lowers one; a loaded executable is never lowered, and calling
    one before that jumped through a null pointer (the process died with SIGSEGV)."""
    global _custom_calls_ready
    if not _custom_calls_ready:
        jax_linalg.initialize_lapack()
        _custom_calls_ready = True


_custom_calls_ready = False


def load(kind: str, name: str, devices):
    """(loaded executable, metadata dict) of a stored entry, or None."""
    path = _path(kind, name)
    if path is None or not os.path.exists(path):
        return None
    _prepare_custom_calls()
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        compiled = serialize_executable.deserialize_and_load(
            entry["payload"], entry["in_tree"], entry["out_tree"], backend=devices[0].client,
            execution_devices=list(devices))
        return compiled, entry["meta"]
    except Exception as err:  # noqa: BLE001 - a bad entry only costs a compile
        warnings.warn(f"torchneuron: ignoring unreadable compiled-executable cache entry {path}: {err}",
                      stacklevel=2)
        return None


def store(kind: str, name: str, compiled, meta: dict) -> None:
    """Write ``compiled`` (an executable XLA compiled in this process, or a function returning
    one) and ``meta``."""
    path = _path(kind, name)
    if path is None:
        return
    try:
        if callable(compiled) and not hasattr(compiled, "as_text"):
            compiled = compiled()
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    except Exception:  # noqa: BLE001 - some executables cannot be serialized (XLA CPU sort comparators:
        # "`LessThan` is not serializable"); they are compiled again in the next process
        metrics.extra["executables_not_storable"] += 1
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write then rename, so a concurrent reader never sees half an entry.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"payload": payload, "in_tree": in_tree, "out_tree": out_tree, "meta": meta}, f)
        os.replace(tmp, path)
    except OSError as err:  # the cache is an optimisation: say so once per folder
        folder = os.path.dirname(path)
        if folder not in _unwritable:
            _unwritable.add(folder)
            warnings.warn(f"torchneuron: could not write the compiled-executable cache entry {path}: {err}; "
                          "executables are compiled again in the next process. Set TORCHNEURON_CACHE_DIR "
                          "to a writable folder (\"\" turns the cache off).", stacklevel=2)


_unwritable: set = set()
