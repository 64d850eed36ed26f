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

An entry file is a header line (JSON: what it holds, its lookup key, the fingerprint and what went
into it) followed by the pickled executable, so ``torchneuron cache info|pack|unpack`` read entries
without unpickling them. ``torchneuron cache verify`` runs a script with ``TORCHNEURON_CACHE_LOOKUP_LOG``
set: every executable the run loads or compiles is then appended to that file, with why the store
could not serve it; without it nothing is recorded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import sys
import tempfile
import threading
import time
import warnings

import jax
import jaxlib
import torch
from jax._src.lax import linalg as jax_linalg
from jax.experimental import serialize_executable

from ..config import config
from ..metrics import metrics
from . import pjrt

_FORMAT = 2
# The first line of every entry file: a file that starts otherwise is not an entry of this format.
MAGIC = b"torchneuron-executable %d\n" % _FORMAT
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


# The distributions that carry each platform's PJRT plugin (the CPU client is part of jaxlib).
_PLUGIN_DISTRIBUTIONS = {
    "cuda": ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt"),
    "rocm": ("jax-rocm7-plugin", "jax-rocm7-pjrt", "jax-rocm60-plugin", "jax-rocm60-pjrt"),
    "tpu": ("libtpu", "libtpu-nightly"),
    "neuron": ("libneuronxla", "jax-neuronx", "neuronx-cc"),
}
_PLUGIN_DISTRIBUTIONS["gpu"] = _PLUGIN_DISTRIBUTIONS["cuda"]


def _plugin_versions(platform: str) -> dict:
    """Installed versions of the packages that carry ``platform``'s PJRT plugin (and compiler)."""
    found = {}
    for name in _PLUGIN_DISTRIBUTIONS.get(platform, ()):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _driver_versions() -> dict:
    """The CUDA driver and libraries JAX's CUDA plugin reports, where it has them (feature-detected:
    the module and its functions vary between plugin releases)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    found = {}
    for name in ("cuda_driver_get_version", "cuda_runtime_get_version", "cudnn_get_version"):
        fn = getattr(cuda_versions, name, None) if cuda_versions is not None else None
        if fn is not None:
            try:
                found[name.removesuffix("_get_version")] = str(fn())
            except Exception:  # noqa: BLE001 - no GPU behind the plugin: nothing to report
                pass
    return found


@functools.cache
def fingerprint_details() -> dict:
    """What the fingerprint covers, by part: versions, platform, and a digest of the torchneuron
    sources that decide an executable (``fingerprint_sources``)."""
    dev = pjrt.devices()[0]
    sources = hashlib.sha256()
    for name in fingerprint_sources():
        with open(name, "rb") as f:
            sources.update(os.path.relpath(name, _PACKAGE_ROOT).encode())
            sources.update(f.read())
    return {"format": _FORMAT,
            "versions": {"python": sys.version, "torch": torch.__version__, "jax": jax.__version__,
                         "jaxlib": jaxlib.__version__},
            # The PJRT plugin's own version string, its packages and the driver: a plugin or
            # driver update may compile differently, so it invalidates stored executables.
            "platform": {"setting": config.platform, "device": dev.platform, "device_kind": dev.device_kind,
                         "pjrt": pjrt.platform_version(), "plugins": _plugin_versions(dev.platform),
                         "driver": _driver_versions() if dev.platform in ("cuda", "gpu") else {},
                         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
            "sources": sources.hexdigest()}


@functools.cache
def fingerprint() -> str:
    """Versions, platform and the code that decides an executable (``fingerprint_sources``): a
    change there invalidates the store (what an executable computes depends on lowerings, layouts,
    dtype rules, config...)."""
    return hashlib.sha256(json.dumps(fingerprint_details(), sort_keys=True).encode()).hexdigest()


def fingerprint_differences(details: dict, here: dict | None = None, where: str = "in the cache") -> list[str]:
    """Each part in which an entry's fingerprint details differ from this installation's, naming
    both sides ("torch 2.4.0 in the cache, 2.5.1 here"); [] when they agree."""
    here = here or fingerprint_details()
    if not details:
        return ["it does not say what it was written under (an earlier torchneuron wrote it)"]
    found = []
    if details.get("format") != here["format"]:
        found.append(f"entry format {details.get('format')} {where}, {here['format']} here")
    for part in ("versions", "platform"):
        theirs, ours = details.get(part) or {}, here[part]
        for name in ours:
            if theirs.get(name) != ours[name]:
                shown = repr if part == "platform" else str
                found.append(f"{name} {shown(theirs.get(name))} {where}, {shown(ours[name])} here")
    if details.get("sources") != here["sources"]:
        found.append(f"torchneuron sources ({', '.join(FINGERPRINTED)}) differ: digest "
                     f"{str(details.get('sources'))[:12]} {where}, {here['sources'][:12]} here")
    return found


class EntryName(str):
    """An entry's file name; ``lookup`` is the key of the same parts without the fingerprint, which
    finds the entries of one program written under another fingerprint."""

    lookup: str = ""


def key(*parts) -> EntryName:
    """The entry name for ``parts`` (whose ``repr`` must be the same in every process)."""
    lookup = hashlib.sha256(repr(parts).encode()).hexdigest()
    name = EntryName(hashlib.sha256(f"{fingerprint()}:{lookup}".encode()).hexdigest())
    name.lookup = lookup
    return name


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


def read_header(path: str) -> dict | None:
    """An entry file's header (kind, what, lookup, fingerprint, details), or None for a file that
    is not an entry of this format."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            return json.loads(f.readline())
    except (OSError, ValueError):
        return None


def load(kind: str, name: str, devices):
    """(loaded executable, metadata dict) of a stored entry, or None."""
    path = _path(kind, name)
    if path is None or not os.path.exists(path):
        return None
    _prepare_custom_calls()
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a compiled-executable entry of this torchneuron's format")
            f.readline()   # the header
            entry = pickle.load(f)
        compiled = serialize_executable.deserialize_and_load(
            entry["payload"], entry["in_tree"], entry["out_tree"], backend=devices[0].client,
            execution_devices=list(devices))
        return compiled, entry["meta"]
    except Exception as err:  # noqa: BLE001 - a bad entry only costs a compile
        _load_failures[path] = f"{type(err).__name__}: {err}"
        warnings.warn(f"torchneuron: ignoring unreadable compiled-executable cache entry {path}: {err}",
                      stacklevel=2)
        return None


def store(kind: str, name: str, compiled, meta: dict, what: str | None = None) -> None:
    """Write ``compiled`` (an executable XLA compiled in this process, or a function returning
    one) and ``meta``; ``what`` names the op or graph for ``torchneuron cache info|verify``."""
    path = _path(kind, name)
    if path is None:
        return
    try:
        if callable(compiled) and not hasattr(compiled, "as_text"):
            compiled = compiled()
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    except Exception as err:  # noqa: BLE001 - some executables cannot be serialized (XLA CPU sort comparators:
        # "`LessThan` is not serializable"); they are compiled again in the next process
        metrics.extra["executables_not_storable"] += 1
        _not_storable[name] = f"{type(err).__name__}: {err}"
        return
    header = {"kind": kind, "what": what or meta.get("op") or meta.get("name") or "",
              "lookup": getattr(name, "lookup", ""), "fingerprint": fingerprint(),
              "details": fingerprint_details(), "written": time.time()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write then rename, so a concurrent reader never sees half an entry.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
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
# Why an entry was not served or not written; filled only on those (compiling) paths.
_load_failures: dict = {}    # path -> the error loading it
_not_storable: dict = {}     # entry name -> the error serializing it


# -- the lookup log of `torchneuron cache verify` -------------------------------------------------
LOG_VARIABLE = "TORCHNEURON_CACHE_LOOKUP_LOG"
_log_path = os.environ.get(LOG_VARIABLE) or None
_log_lock = threading.Lock()
_headers_by_lookup: dict = {}   # kind -> {lookup: [header, ...]}, read once per kind when logging


def logging_lookups() -> bool:
    """Whether this process records its lookups (``torchneuron cache verify`` runs it)."""
    return _log_path is not None


def log(outcome: str, kind: str, what: str, reason: str = "", cacheable: bool = True) -> None:
    """Append one executable's outcome ("served" or "compiled") to the lookup log."""
    record = {"outcome": outcome, "kind": kind, "what": what, "reason": reason, "cacheable": cacheable}
    with _log_lock, open(_log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


def miss_reason(kind: str, name: str | None) -> tuple[str, bool]:
    """(why the store did not serve entry ``name``, whether a cache could ever serve it); called
    on the compiling path of a logged run only."""
    if not enabled():
        return "the persistent cache is off (TORCHNEURON_CACHE_DIR is empty)", True
    if name is None:
        return ("never stored: a torchneuron.kernel op (user code), or a key holding values that differ "
                "between processes"), False
    if name in _not_storable:
        return f"never stored: XLA cannot serialize this executable ({_not_storable[name]})", False
    path = _path(kind, name)
    if path in _load_failures:
        return f"load failure: {_load_failures[path]}", True
    others = [h for h in _entries_by_lookup(kind).get(getattr(name, "lookup", ""), ())
              if h.get("fingerprint") != fingerprint()]
    if others:
        differences = fingerprint_differences(others[0].get("details") or {}) or [
            f"fingerprint {others[0].get('fingerprint', '')[:12]} in the cache, {fingerprint()[:12]} here"]
        return "present under another fingerprint: " + "; ".join(differences), True
    return "key not in cache", True


def _entries_by_lookup(kind: str) -> dict:
    if kind not in _headers_by_lookup:
        found = {}
        folder = os.path.join(config.cache_dir, kind)
        for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            header = read_header(os.path.join(folder, entry)) if entry.endswith(".tnexe") else None
            if header and header.get("lookup"):
                found.setdefault(header["lookup"], []).append(header)
        _headers_by_lookup[kind] = found
    return _headers_by_lookup[kind]
