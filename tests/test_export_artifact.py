"""torchneuron.export.save / load: a torch.export program as a neuron artifact (a .pt2 with its
StableHLO), run on neuron; the CPU module is the oracle."""

import json
import os
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

import torchneuron


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x, scale: float = 1.0):
        h = torch.relu(self.norm(self.fc1(x)))
        return self.fc2(h) * scale, h.sum(dim=1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Net()
    m.train()
    m(torch.randn(16, 4))   # non-trivial running statistics
    return m.eval()


def test_save_load_runs_on_neuron_and_matches_cpu(model, tmp_path):
    x = torch.randn(3, 4)
    ep = torch.export.export(model, (x,))
    path = tmp_path / "net.pt2"
    torchneuron.export.save(ep, str(path))
    assert all(t.device.type == "cpu" for t in ep.state_dict.values())   # the user's program is untouched
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    assert any(n.endswith("torchneuron/program.stablehlo.mlir") for n in names), names
    program = torchneuron.export.load(str(path))
    assert "stablehlo" in program.stablehlo and "func.func" in program.stablehlo
    assert program.manifest["platform"] == torchneuron.config.platform
    assert program.manifest["inputs"] == [["torch.float32", [3, 4]]]
    y = torch.randn(3, 4)
    out, total = program(y)
    ref_out, ref_total = model(y)
    assert out.device.type == "neuron" and total.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), ref_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total.cpu(), ref_total.detach(), rtol=1e-5, atol=1e-5)
    # The eager module form runs on neuron too.
    eager_out, _ = program.module()(y.to("neuron"))
    torch.testing.assert_close(eager_out.cpu(), ref_out.detach(), rtol=1e-5, atol=1e-5)
    # Still a plain .pt2 for PyTorch.
    plain = torch.export.load(str(path))
    torch.testing.assert_close(plain.module()(y)[0], ref_out.detach())


def test_load_refuses_a_plain_pt2_and_save_a_module(model, tmp_path):
    ep = torch.export.export(model, (torch.randn(3, 4),))
    path = tmp_path / "plain.pt2"
    torch.export.save(ep, str(path))
    with pytest.raises(ValueError, match="no torchneuron manifest"):
        torchneuron.export.load(str(path))
    with pytest.raises(TypeError, match="torch.export.ExportedProgram"):
        torchneuron.export.save(model, str(tmp_path / "m.pt2"))


def _saved(model, tmp_path, name="net.pt2", shape=(3, 4)):
    path = tmp_path / name
    torchneuron.export.save(torch.export.export(model, (torch.randn(*shape),)), str(path))
    return path


_FRESH = """
import sys, torch, torchneuron
program = torchneuron.export.load(sys.argv[1])
outs = program(torch.load(sys.argv[2]))
torch.save([o.cpu() for o in outs], sys.argv[3])
"""


def test_artifact_runs_in_a_fresh_process_without_model_code(model, tmp_path):
    path = _saved(model, tmp_path, shape=(5, 4))
    x = torch.randn(5, 4)
    torch.save(x, tmp_path / "x.pt")
    script = tmp_path / "serve.py"
    script.write_text(_FRESH)
    package_root = os.path.dirname(os.path.dirname(torchneuron.__file__))   # this torchneuron, not the tests
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = torch.load(tmp_path / "y.pt")
    here = [o.cpu() for o in torchneuron.export.load(str(path))(x)]
    cpu = [o.detach() for o in model(x)]
    assert len(fresh) == len(here) == len(cpu) == 2
    for f, h, c in zip(fresh, here, cpu):
        assert torch.equal(f, h)                     # the same executable, bit for bit
        torch.testing.assert_close(f, c, rtol=1e-5, atol=1e-5)


def _with_manifest(path, out, change):
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("torchneuron/manifest.json"):
                data = json.dumps(change(json.loads(data))).encode()
            dst.writestr(item, data)
    return str(out)


def test_load_under_another_manifest_warns_or_refuses(model, tmp_path):
    path = _saved(model, tmp_path)
    other = _with_manifest(path, tmp_path / "other.pt2", lambda m: dict(m, torch="1.0.0", platform="tpu"))
    with pytest.warns(UserWarning, match=r"saved with torch '1\.0\.0' \(here .*platform 'tpu'"):
        program = torchneuron.export.load(other)
    x = torch.randn(3, 4)
    torch.testing.assert_close(program(x)[0].cpu(), model(x)[0].detach(), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torchneuron.export.load(str(path))
    assert not [w for w in seen if "torchneuron.export" in str(w.message)]   # the same versions: none
    future = _with_manifest(path, tmp_path / "future.pt2", lambda m: dict(m, format=3))
    with pytest.raises(ValueError, match="manifest format 3; this torchneuron reads formats 1, 2"):
        torchneuron.export.load(future)


def test_static_artifacts_have_static_shapes(model, tmp_path):
    """A program exported without dynamic_shapes keeps its shapes: other lengths than the
    exported one (two non-round ones here) are refused clearly (tests/test_export_dynamic.py
    covers programs exported with dynamic_shapes)."""
    program = torchneuron.export.load(str(_saved(model, tmp_path, shape=(7, 4))))
    assert program.manifest["format"] == 1 and "dynamic_dims" not in program.manifest
    torch.testing.assert_close(program(torch.ones(7, 4))[0].cpu(), model(torch.ones(7, 4))[0].detach(),
                               rtol=1e-5, atol=1e-5)
    for n in (5, 13):
        with pytest.raises(ValueError, match=rf"exported for input shapes \[\(7, 4\)\], got \[\({n}, 4\)\]"):
            program(torch.randn(n, 4))
