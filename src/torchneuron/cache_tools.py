"""``torchneuron cache info|pack|unpack|verify``: a warm compile cache as something a deployment
pipeline can ship and check.

The cache folder (``config.cache_dir``, ``TORCHNEURON_CACHE_DIR``) holds eager executables under
``eager/``, torch.compile graphs under ``graphs/`` (``runtime.executable_store``) and JAX's own
compilation cache files at its top (``compile.cache``). An archive is a tar.gz of those files under
``cache/`` plus ``torchneuron-cache.json``, a manifest of what was packed and what it was written
under. Entry files are read through their JSON headers only: nothing here unpickles an entry.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

from . import __version__
from .config import config
from .runtime import executable_store

MANIFEST = "torchneuron-cache.json"
_PREFIX = "cache/"
KINDS = ("eager", "graphs")      # the store's folders
JAX_FILES = "jax"                # files of JAX's compilation cache, at the top of the folder
DOCTOR_PROBE_PREFIX = ".doctor-probe-"   # `torchneuron doctor`'s write probe: no cache file
_MANIFEST_FORMAT = 1

# Exit statuses of `torchneuron cache verify`: every executable was served / some were compiled /
# the cache could not be verified (no cache, bad command, the script failed).
SERVED, COMPILED, UNUSABLE = 0, 1, 2


class CacheToolError(Exception):
    """What a cache command cannot do as asked (printed as an error; exit status 2)."""


def cache_dir(given: str | None) -> str:
    directory = given if given is not None else config.cache_dir
    if not directory:
        raise CacheToolError("no cache folder: the persistent cache is off (TORCHNEURON_CACHE_DIR is empty); "
                             "give one with --cache-dir DIR")
    return os.path.abspath(directory)


def _kind_of(relpath: str) -> str | None:
    """The kind of a cache file by its path in the folder, or None for what is not cache content
    (half-written entries, an unpack in progress)."""
    parts = relpath.split("/")
    if parts[-1].endswith(".tmp") or parts[0].startswith((".unpack-", DOCTOR_PROBE_PREFIX)):
        return None
    if len(parts) == 2 and parts[0] in KINDS and parts[1].endswith(".tnexe"):
        return parts[0]
    if len(parts) == 1:
        return JAX_FILES
    return None


def _cache_files(directory: str, skip: str | None = None):
    """(relative path with "/", kind, size) of every cache file in ``directory``, sorted."""
    found = []
    for folder, subdirs, files in os.walk(directory):
        subdirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            if os.path.islink(path) or (skip and os.path.abspath(path) == skip):
                continue
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            kind = _kind_of(rel)
            if kind is None:
                continue
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                # Removed since the listing: another process shares the folder (a writer renaming
                # its temporary file, `torchneuron doctor`'s write probe on another rank).
                continue
            found.append((rel, kind, size))
    return found


def scan(directory: str, skip: str | None = None) -> dict:
    """What ``directory`` holds: files per kind, bytes, and the fingerprints its entries were
    written under (with the entries of each)."""
    counts = dict.fromkeys((*KINDS, JAX_FILES), 0)
    fingerprints: dict = {}
    unknown = 0
    total = 0
    files = _cache_files(directory, skip) if os.path.isdir(directory) else []
    for rel, kind, size in files:
        counts[kind] += 1
        total += size
        if kind == JAX_FILES:
            continue
        header = executable_store.read_header(os.path.join(directory, *rel.split("/")))
        if not header or not header.get("fingerprint"):
            unknown += 1
            continue
        group = fingerprints.setdefault(header["fingerprint"], {
            "fingerprint": header["fingerprint"], **(header.get("details") or {}),
            "entries": dict.fromkeys(KINDS, 0)})
        group["entries"][kind] += 1
    return {"files": files, "entries": counts, "bytes": total, "fingerprints": list(fingerprints.values()),
            "unknown_entries": unknown}


def installation() -> dict:
    details = executable_store.fingerprint_details()
    return {"versions": {"torchneuron": __version__, **details["versions"]}, "platform": details["platform"],
            "fingerprint": executable_store.fingerprint()}


def _entries_text(entries: dict) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in entries.items() if n) or "nothing"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- info ------------------------------------------------------------------------------------------
def info(directory: str) -> int:
    if not os.path.isdir(directory):
        raise CacheToolError(f"no cache folder at {directory}; point --cache-dir (or TORCHNEURON_CACHE_DIR) at one")
    found = scan(directory)
    here = executable_store.fingerprint()
    print(f"cache folder   {directory}")
    for kind in KINDS:
        print(f"{kind:14} {found['entries'][kind]} entries")
    print(f"{'jax':14} {found['entries'][JAX_FILES]} files (JAX's compilation cache)")
    print(f"{'bytes':14} {found['bytes']} ({_mib(found['bytes'])})")
    lines = []
    for group in found["fingerprints"]:
        label = f"{group['fingerprint'][:12]}: {_entries_text(group['entries'])}"
        if group["fingerprint"] == here:
            label += " (this installation's)"
        else:
            label += " -- never used here: " + "; ".join(executable_store.fingerprint_differences(group) or
                                                         ["another fingerprint"])
        lines.append(label)
    if found["unknown_entries"]:
        lines.append(f"{found['unknown_entries']} entries without a readable header (an earlier format, or damaged; "
                     "never used here)")
    print(f"{'fingerprints':14} " + ("\n" + " " * 15).join(lines or ["none"]))
    return 0


# -- pack ------------------------------------------------------------------------------------------
def pack(archive: str, directory: str) -> int:
    if not os.path.isdir(directory):
        raise CacheToolError(f"no cache folder at {directory}; point --cache-dir (or TORCHNEURON_CACHE_DIR) at one")
    archive = os.path.abspath(archive)
    found = scan(directory, skip=archive)
    manifest = {"format": _MANIFEST_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **installation(), "entries": found["entries"], "bytes": found["bytes"],
                "fingerprints": found["fingerprints"], "unknown_entries": found["unknown_entries"]}
    folder = os.path.dirname(archive)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pack-", suffix=".tmp")
    except OSError as err:
        raise CacheToolError(f"cannot write the archive {archive} ({err.strerror or err}); choose another path") from None
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            member = tarfile.TarInfo(MANIFEST)
            member.size, member.mtime, member.mode = len(data), int(time.time()), 0o644
            tar.addfile(member, io.BytesIO(data))
            for rel, _, _ in found["files"]:
                tar.add(os.path.join(directory, *rel.split("/")), arcname=_PREFIX + rel, recursive=False)
        os.replace(tmp, archive)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    print(f"torchneuron cache pack: {archive}: {_entries_text(found['entries'])} "
          f"({_mib(found['bytes'])} of {directory}; fingerprint {manifest['fingerprint'][:12]}, "
          f"{len(found['fingerprints'])} in its entries)")
    return 0


# -- unpack ----------------------------------------------------------------------------------------
def _checked_members(tar: tarfile.TarFile, archive: str) -> list:
    """Every member, refused as a whole if one could write outside the cache folder or is not a
    plain file or folder: an archive from elsewhere must not be able to place a file anywhere."""
    members = tar.getmembers()
    for m in members:
        name = m.name
        parts = name.split("/")
        if name.startswith("/") or posixpath.isabs(name) or (len(name) > 1 and name[1] == ":"):
            raise CacheToolError(f"refusing {archive}: member {name!r} has an absolute path")
        if ".." in parts:
            raise CacheToolError(f"refusing {archive}: member {name!r} points outside the cache folder ('..')")
        if m.issym() or m.islnk():
            raise CacheToolError(f"refusing {archive}: member {name!r} is a link (to {m.linkname!r}); "
                                 "cache archives hold plain files only")
        if not (m.isfile() or m.isdir()):
            raise CacheToolError(f"refusing {archive}: member {name!r} is not a plain file or folder")
        if name != MANIFEST and not (name + "/").startswith(_PREFIX):
            raise CacheToolError(f"refusing {archive}: member {name!r} is neither {MANIFEST} nor under {_PREFIX}; "
                                 "was it written by torchneuron cache pack?")
    return members


def _warn_differences(manifest: dict, archive: str) -> None:
    here = installation()
    packed_by = []
    for part in ("versions", "platform"):
        theirs = manifest.get(part) or {}
        for name, ours in here[part].items():
            if theirs.get(name) != ours:
                packed_by.append(f"{name} {theirs.get(name)!r} in the archive, {ours!r} here")
    if packed_by:
        print(f"torchneuron cache unpack: warning: {archive} was packed by another installation: "
              + "; ".join(packed_by) + ". JAX's compilation cache files it holds are keyed on JAX's "
              "version and the platform.", file=sys.stderr)
    details = executable_store.fingerprint_details()
    for group in manifest.get("fingerprints") or ():
        if group.get("fingerprint") == here["fingerprint"]:
            continue
        why = executable_store.fingerprint_differences(group, details, where="in the archive") or [
            f"fingerprint {str(group.get('fingerprint'))[:12]} in the archive, {here['fingerprint'][:12]} here"]
        print(f"torchneuron cache unpack: warning: {_entries_text(group.get('entries') or {})} entries were "
              f"written under another fingerprint and will never be used by this installation: "
              + "; ".join(why) + ". Pack the cache again with this installation's versions and platform, "
              "or deploy with the installation that wrote it.", file=sys.stderr)


def unpack(archive: str, directory: str) -> int:
    archive = os.path.abspath(archive)
    try:
        tar = tarfile.open(archive, mode="r:*")
    except (OSError, tarfile.TarError) as err:
        raise CacheToolError(f"cannot read the archive {archive} ({getattr(err, 'strerror', None) or err})") from None
    with tar:
        members = _checked_members(tar, archive)
        manifest_member = next((m for m in members if m.name == MANIFEST), None)
        if manifest_member is None:
            raise CacheToolError(f"{archive} has no {MANIFEST}: it is not an archive of torchneuron cache pack")
        try:
            manifest = json.load(tar.extractfile(manifest_member))
        except ValueError as err:
            raise CacheToolError(f"{archive}: its {MANIFEST} is not valid JSON ({err})") from None
        _warn_differences(manifest, archive)
        try:
            os.makedirs(directory, exist_ok=True)
            staging = tempfile.mkdtemp(dir=directory, prefix=".unpack-")
        except OSError as err:
            raise CacheToolError(f"cannot write the cache folder {directory} ({err.strerror or err}); "
                                 "choose another with --cache-dir") from None
        added = dict.fromkeys((*KINDS, JAX_FILES), 0)
        present = 0
        try:
            for m in members:
                if not m.isfile() or m.name == MANIFEST:
                    continue
                rel = m.name[len(_PREFIX):]
                kind = _kind_of(rel)
                if kind is None:
                    continue
                target = os.path.join(directory, *rel.split("/"))
                if os.path.exists(target):
                    present += 1   # the same name is the same key: keep the one already there
                    continue
                # Staged next to the cache, then renamed in: a reader never sees half a file.
                staged = os.path.join(staging, f"{sum(added.values())}.part")
                with tar.extractfile(m) as src, open(staged, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(staged, target)
                added[kind] += 1
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    print(f"torchneuron cache unpack: added {_entries_text(added)} to {directory}"
          + (f" ({present} already there)" if present else ""))
    return 0


# -- verify ----------------------------------------------------------------------------------------
def verify(directory: str, interp: list[str], script_argv: list[str]) -> int:
    """Run the script on a copy of the cache folder, which the run may add to without changing the
    original, and list each executable the cache did not serve."""
    if not os.path.isdir(directory):
        raise CacheToolError(f"no cache folder at {directory}; unpack one there or point --cache-dir "
                             "(or TORCHNEURON_CACHE_DIR) at one")
    work = tempfile.mkdtemp(prefix="torchneuron-verify-")
    try:
        copy = os.path.join(work, "cache")
        shutil.copytree(directory, copy, symlinks=True,
                        ignore=shutil.ignore_patterns("*.tmp", ".unpack-*", ".pack-*"))
        log_path = os.path.join(work, "lookups.jsonl")
        env = dict(os.environ, TORCHNEURON_CACHE_DIR=copy, **{executable_store.LOG_VARIABLE: log_path})
        # The script imports this very torchneuron, whatever the interpreter's own path says.
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        print(f"torchneuron cache verify: running {' '.join(script_argv)} on a copy of {directory}",
              file=sys.stderr, flush=True)
        rc = subprocess.run([*interp, *script_argv], env=env).returncode
        records = []
        if os.path.exists(log_path):
            with open(log_path) as f:
                records = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    served = [r for r in records if r["outcome"] == "served"]
    missed = [r for r in records if r["outcome"] == "compiled" and r["cacheable"]]
    never = [r for r in records if r["outcome"] == "compiled" and not r["cacheable"]]
    for r in missed:
        print(f"compiled {r['kind']} {r['what']}: {r['reason']}")
    for r in never:
        print(f"compiled {r['kind']} {r['what']} (no cache keeps it): {r['reason']}")
    summary = f"torchneuron cache verify: {len(served)} served from the cache, {len(missed)} compiled"
    if never:
        summary += f" (and {len(never)} that no cache keeps)"
    print(summary)
    if rc != 0:
        print(f"torchneuron cache verify: the script exited with status {rc}; the cache is not verified",
              file=sys.stderr)
        return UNUSABLE
    return COMPILED if missed else SERVED
