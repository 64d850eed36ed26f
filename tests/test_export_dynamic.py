"""torchneuron.export with dynamic shapes: a program exported with ``dynamic_shapes`` is saved with
one StableHLO program per shape bucket of its range and the bucket metadata in its manifest, and
runs in a fresh process without model code at any size of the range, its outputs equal to the
eager CPU module's on the true shapes; the CPU module is the oracle."""

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from test_shapes_bucketed import TinyGPT  # embedding, positions, causal attention, layer norm, MLP
from torch import nn
from torch.export import Dim

import torchneuron
from torchneuron.compile import export as neuron_export

VOCAB, BUCKETS, MAX = 40, [16, 32, 64, 128], 128    # TinyGPT has 128 positions
LENGTHS = (7, 11, 23, 61, 100)   # buckets 16, 16 (no new compile), 32, 64, 128


def _ids(t, seed=None):
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed or t))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, d=16, heads=2, layers=1).eval()


@pytest.fixture(scope="module")
def artifact(gpt, tmp_path_factory):
    ep = torch.export.export(gpt, (_ids(9),), dynamic_shapes={"ids": {1: Dim("seq", min=2, max=MAX)}})
    path = tmp_path_factory.mktemp("export_dynamic") / "gpt.pt2"
    torchneuron.export.save(ep, str(path), buckets=BUCKETS)
    return path


def test_manifest_records_the_dynamic_dim_and_one_program_per_bucket(artifact):
    with zipfile.ZipFile(artifact) as z:
        names = z.namelist()
        manifest = json.loads(z.read(next(n for n in names if n.endswith("torchneuron/manifest.json"))))
        programs = {n.split("torchneuron/", 1)[1]: z.read(n).decode() for n in names
                    if "torchneuron/buckets/" in n}
    assert manifest["format"] == 2 and manifest["platform"] == torchneuron.config.platform
    (dim,) = manifest["dynamic_dims"]
    symbol = dim["symbol"]
    assert dim == {"input": 0, "name": "ids", "dim": 1, "symbol": symbol, "min": 2, "max": MAX,
                   "buckets": BUCKETS}
    assert manifest["inputs"] == [["torch.int64", [2, symbol]]]
    assert manifest["ladder"] == BUCKETS
    assert [p["buckets"] for p in manifest["programs"]] == [{symbol: b} for b in BUCKETS]
    assert sorted(programs) == sorted(f"buckets/{symbol}-{b}.stablehlo.mlir" for b in BUCKETS)
    assert all("func.func" in text and "stablehlo" in text for text in programs.values())
    assert len(set(programs.values())) == len(BUCKETS)   # each bucket its own program
    # Still a plain .pt2 for PyTorch, dynamic as exported.
    plain = torch.export.load(str(artifact))
    assert plain.module()(_ids(5)).shape == (2, 5, VOCAB)


_SERVE = r"""
import json, sys, torch, torchneuron
program = torchneuron.export.load(sys.argv[1])
compiles, outs = [], []
for t in json.loads(sys.argv[2]):
    before = torchneuron.metrics()["executables_compiled"]
    ids = torch.randint(0, {vocab}, (2, t), generator=torch.Generator().manual_seed(t))
    outs.append(program(ids).cpu())
    compiles.append(torchneuron.metrics()["executables_compiled"] - before)
torch.save(outs, sys.argv[3])
print(json.dumps(compiles))
"""


def _serve(artifact, cache_dir, out):
    package_root = os.path.dirname(os.path.dirname(torchneuron.__file__))   # this torchneuron, no test code
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _SERVE.format(vocab=VOCAB), str(artifact), json.dumps(LENGTHS),
                           str(out)], cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out)


def test_fresh_process_runs_every_length_of_the_range_like_cpu(gpt, artifact, tmp_path):
    """Non-round lengths in four buckets; the second length of a bucket compiles nothing, and a
    second fresh process on the same persistent cache compiles nothing at all."""
    first_compiles, first = _serve(artifact, tmp_path / "cache", tmp_path / "first.pt")
    assert first_compiles == [1, 0, 1, 1, 1]
    with torch.no_grad():
        for t, out in zip(LENGTHS, first):
            assert out.shape == (2, t, VOCAB)
            torch.testing.assert_close(out, gpt(_ids(t)), rtol=1e-5, atol=1e-5)
    second_compiles, second = _serve(artifact, tmp_path / "cache", tmp_path / "second.pt")
    assert second_compiles == [0] * len(LENGTHS)
    for a, b in zip(first, second):
        assert torch.equal(a, b)                # the same executables, bit for bit


def test_sizes_outside_the_range_and_static_dims_are_refused(artifact):
    program = torchneuron.export.load(str(artifact))
    assert sorted(p["file"] for p in program.manifest["programs"]) == sorted(program.programs)
    assert all("func.func" in text for text in program.programs.values())
    for t in (1, MAX + 1):
        with pytest.raises(ValueError, match=rf"input ids dim 1 has size {t}, outside the range \[2, {MAX}\] "
                                             r"of its dynamic size s\d+ .*buckets \[16, 32, 64, 128\]"):
            program(_ids(t))
    with pytest.raises(ValueError, match="input ids dim 0 has size 3; the program was exported with the static "
                                         "size 2"):
        program(torch.zeros(3, 9, dtype=torch.long))
    assert torchneuron.metrics()["executables_compiled"] == 0   # refused before anything compiled


class Scale(nn.Module):
    def forward(self, x):
        return (x * 2).sum(dim=1)


def test_the_range_must_fit_the_ladder(tmp_path):
    x = torch.randn(3, 5)
    unbounded = torch.export.export(Scale(), (x,), dynamic_shapes=({1: Dim("n")},))
    with pytest.raises(ValueError, match=r"dim 1 of input x \(s\d+\) has no upper bound.*max=N"):
        torchneuron.export.save(unbounded, str(tmp_path / "a.pt2"))
    bounded = torch.export.export(Scale(), (x,), dynamic_shapes=({1: Dim("n", max=100)},))
    with pytest.raises(ValueError, match=r"may be up to 100, above the largest bucket 64"):
        torchneuron.export.save(bounded, str(tmp_path / "b.pt2"), buckets=[16, 64])
    # Without a maximum, a list ladder serves up to its largest bucket.
    dims = neuron_export._dynamic_dims(unbounded, "8,24")
    assert [(d["min"], d["max"], d["buckets"]) for d in dims] == [(0, 24, [8, 24])]
    assert neuron_export._covering(20, 300, ("pow2", 16), "d") == [32, 64, 128, 256, 512]
    assert neuron_export._covering(2, 40, ("list", (4, 8, 48, 96)), "d") == [4, 8, 48]


class Sorts(nn.Module):
    def forward(self, x):
        return torch.argsort(x, dim=1, stable=True)


def test_a_program_without_bucketed_rules_is_refused(tmp_path, monkeypatch):
    """A planted fault: with the dynamic rule of ``sort`` gone the graph would compile per shape,
    which an artifact of buckets cannot hold; save says so and names the op."""
    from torchneuron.compile import dynamic
    monkeypatch.delitem(dynamic.RULES, "sort.stable", raising=False)
    monkeypatch.delitem(dynamic.RULES, "sort.default", raising=False)
    ep = torch.export.export(Sorts(), (torch.randn(2, 9),), dynamic_shapes=({1: Dim("n", min=2, max=20)},))
    with pytest.raises(ValueError, match=r"cannot be saved with dynamic shapes, it has no bucketed rule for sort"):
        torchneuron.export.save(ep, str(tmp_path / "s.pt2"))
