"""torchneuron.export.save / load: a torch.export program as a neuron artifact (a .pt2 with its
StableHLO), run on neuron; the CPU module is the oracle."""

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
