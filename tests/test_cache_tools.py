"""``torchneuron cache info|pack|unpack|verify`` against real runs: a script warms a cache in a fresh
process, the cache is packed and unpacked elsewhere, and ``verify`` runs scripts on it and lists
what the cache did not serve."""

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest
import torch

from torchneuron import cache_tools, cli
from torchneuron.runtime import executable_store

# A few eager ops and one torch.compile graph, on tiny tensors.
_WARM = textwrap.dedent("""
    import torch, torchneuron
    x = torch.arange(6.0, device="neuron").reshape(2, 3)
    y = (x * 2 + 1).sin()
    f = torch.compile(lambda t: (t.cos() * 3).sum(), backend="neuron")
    print(y.sum().item(), f(x).item())
""")
# The same, plus one op on a shape the warm run never saw.
_NEW_SHAPE = _WARM + "print(torch.ones(5, device='neuron').exp().sum().item())\n"


def _script(folder, name, text):
    path = folder / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(folder, cache dir the warm run filled, its archive)."""
    folder = tmp_path_factory.mktemp("cache_tools")
    cache = folder / "cache"
    proc = subprocess.run([sys.executable, _script(folder, "warm.py", _WARM)], capture_output=True, text=True,
                          env=dict(os.environ, TORCHNEURON_CACHE_DIR=str(cache)), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    archive = folder / "warm.tar.gz"
    assert cli.main(["cache", "pack", str(archive), "--cache-dir", str(cache)]) == 0
    return folder, cache, archive


def _unpacked(warm, tmp_path, capsys):
    _, _, archive = warm
    target = tmp_path / "deployed"
    assert cli.main(["cache", "unpack", str(archive), "--cache-dir", str(target)]) == 0
    out, err = capsys.readouterr()
    assert "added" in out and str(target) in out and "warning" not in err, (out, err)
    return target


def _verify(cache, script, capsys):
    status = cli.main(["cache", "verify", "--cache-dir", str(cache), "--", sys.executable, script])
    out, _ = capsys.readouterr()
    return status, out


def _tree(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def test_pack_writes_the_cache_and_a_manifest_of_it(warm):
    _, cache, archive = warm
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile(cache_tools.MANIFEST))
    assert all(n == cache_tools.MANIFEST or n.startswith("cache/") for n in names)
    assert len([n for n in names if n.startswith("cache/eager/")]) == manifest["entries"]["eager"] >= 4
    assert manifest["entries"]["graphs"] == 1
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["versions"]["jaxlib"]
    assert manifest["platform"]["device"] and manifest["created"].endswith("Z")
    assert manifest["bytes"] == sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    [group] = manifest["fingerprints"]
    assert group["fingerprint"] == manifest["fingerprint"] == executable_store.fingerprint()
    assert group["entries"] == {"eager": manifest["entries"]["eager"], "graphs": 1}


def test_an_unpacked_cache_serves_the_warm_script_with_no_compile(warm, tmp_path, capsys):
    folder, _, _ = warm
    deployed = _unpacked(warm, tmp_path, capsys)
    before = _tree(deployed)
    status, out = _verify(deployed, str(folder / "warm.py"), capsys)
    assert status == cache_tools.SERVED == 0, out
    assert "compiled " not in out.replace(", 0 compiled", "")
    served = int(out.split("torchneuron cache verify: ")[1].split(" served")[0])
    assert served >= 5
    assert out.rstrip().endswith(f"{served} served from the cache, 0 compiled")
    assert _tree(deployed) == before   # verify ran on a copy
    # Unpacking again adds nothing: every entry is already there.
    _, _, archive = warm
    assert cli.main(["cache", "unpack", str(archive), "--cache-dir", str(deployed)]) == 0
    assert "added nothing" in capsys.readouterr().out


def test_verify_lists_what_a_new_shape_compiles_and_fails(warm, tmp_path, capsys):
    deployed = _unpacked(warm, tmp_path, capsys)
    status, out = _verify(deployed, _script(tmp_path, "new.py", _NEW_SHAPE), capsys)
    assert status == cache_tools.COMPILED == 1, out
    assert "compiled eager exp(float32[5]): key not in cache" in out
    assert out.rstrip().endswith(" compiled") and ", 0 compiled" not in out


def _entry(folder, op):
    """(path, header, bytes) of the stored eager entry of ``op``."""
    for path in (folder / "eager").glob("*.tnexe"):
        data = path.read_bytes()
        header_end = data.index(b"\n", len(executable_store.MAGIC))
        header = json.loads(data[len(executable_store.MAGIC):header_end])
        if header["what"].startswith(op + "("):
            return path, header, data, header_end + 1
    raise AssertionError(f"no stored entry of {op}()")


def test_verify_names_another_fingerprint_and_a_load_failure(warm, tmp_path, capsys):
    """The warm entry of sin() rewritten as if another torch wrote it (its file name, which holds
    the fingerprint, no longer matches), and the entry of add() cut short: verify says which part of
    the fingerprint differs, and what failed to load."""
    folder, _, _ = warm
    deployed = _unpacked(warm, tmp_path, capsys)
    path, header, data, body = _entry(deployed, "sin")
    header["fingerprint"] = "0" * 64
    header["details"]["versions"]["torch"] = "1.0.0"
    path.unlink()
    (deployed / "eager" / ("f" * 64 + ".tnexe")).write_bytes(
        executable_store.MAGIC + json.dumps(header).encode() + b"\n" + data[body:])
    path, _, data, body = _entry(deployed, "add.Tensor")
    path.write_bytes(data[:body + 10])
    status, out = _verify(deployed, str(folder / "warm.py"), capsys)
    assert status == 1, out
    assert (f"compiled eager sin(float32[2, 3]): present under another fingerprint: torch 1.0.0 in the cache, "
            f"{torch.__version__} here") in out
    assert "compiled eager add.Tensor(float32[2, 3], int, int): load failure: " in out
    assert out.rstrip().endswith(" served from the cache, 2 compiled")


def _rewritten(archive, target, edit_manifest=None, extra=None):
    """A copy of ``archive`` with its manifest edited and ``extra`` (TarInfo, bytes) members added."""
    with tarfile.open(archive) as src, tarfile.open(target, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == cache_tools.MANIFEST and edit_manifest:
                manifest = json.loads(data)
                edit_manifest(manifest)
                data = json.dumps(manifest).encode()
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
        for member, data in extra or ():
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return target


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_a_tampered_archive_is_refused_and_nothing_is_written(warm, tmp_path, capsys, kind):
    _, _, archive = warm
    member = tarfile.TarInfo({"dotdot": "cache/../../escaped", "absolute": "/tmp/escaped",
                              "symlink": "cache/eager/link.tnexe"}[kind])
    payload = b"not a cache entry"
    if kind == "symlink":
        member.type, member.linkname, payload = tarfile.SYMTYPE, "/etc/passwd", None
    else:
        member.size = len(payload)
    bad = _rewritten(archive, tmp_path / "bad.tar.gz", extra=[(member, payload)])
    target = tmp_path / "deploy" / "cache"
    assert cli.main(["cache", "unpack", str(bad), "--cache-dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"torchneuron cache unpack: error: refusing {bad}: member {member.name!r}" in err
    assert {"dotdot": "('..')", "absolute": "absolute path", "symlink": "is a link"}[kind] in err
    assert not target.exists() and not (tmp_path / "escaped").exists()


def test_a_manifest_of_another_version_is_warned_about_naming_both_sides(warm, tmp_path, capsys):
    _, _, archive = warm

    def older_torch(manifest):
        manifest["versions"]["torch"] = "1.0.0"
        for group in manifest["fingerprints"]:
            group["versions"]["torch"] = "1.0.0"
            group["fingerprint"] = "0" * 64

    other = _rewritten(archive, tmp_path / "other.tar.gz", edit_manifest=older_torch)
    assert cli.main(["cache", "unpack", str(other), "--cache-dir", str(tmp_path / "c")]) == 0
    out, err = capsys.readouterr()
    assert "added" in out
    assert f"packed by another installation: torch '1.0.0' in the archive, '{torch.__version__}' here" in err
    assert "will never be used by this installation" in err
    assert f"torch 1.0.0 in the archive, {torch.__version__} here" in err


def test_info_shows_entries_bytes_and_fingerprints(warm, capsys):
    _, cache, _ = warm
    assert cli.main(["cache", "info", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "graphs         1 entries" in out
    assert f"{executable_store.fingerprint()[:12]}: " in out and "(this installation's)" in out


def test_a_missing_cache_folder_is_an_error_that_says_where(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert cli.main(["cache", "verify", "--cache-dir", str(missing), "--", sys.executable, "x.py"]) == 2
    assert f"no cache folder at {missing}" in capsys.readouterr().err
    assert cli.main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 2
    assert "give the command to run after --" in capsys.readouterr().err


def test_a_file_removed_while_the_folder_is_scanned_is_skipped(tmp_path, monkeypatch):
    # Processes share a cache folder: a file listed by os.walk may be gone before its size is read
    # (two torchrun ranks running `torchneuron doctor`: one rank's write probe vanished under the
    # other's scan, which failed with FileNotFoundError).
    (tmp_path / "jit_kept-0123").write_bytes(b"x" * 10)
    (tmp_path / "jit_gone-4567").write_bytes(b"y" * 20)
    (tmp_path / (cache_tools.DOCTOR_PROBE_PREFIX + "abc")).write_bytes(b"probe")
    getsize = os.path.getsize

    def removed_meanwhile(path):
        if os.path.basename(path) == "jit_gone-4567":
            os.remove(path)
        return getsize(path)

    monkeypatch.setattr(cache_tools.os.path, "getsize", removed_meanwhile)
    found = cache_tools.scan(str(tmp_path))
    assert found["entries"][cache_tools.JAX_FILES] == 1, found
    assert found["bytes"] == 10, found
