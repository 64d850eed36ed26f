"""docs/compatibility.md (python -m tools.compatibility) is current, and what it says about an op is
what happens when the op runs on neuron."""

import warnings

import pytest
import torch

import torchneuron
from tools import compatibility
from torchneuron import metrics


@pytest.fixture(scope="module")
def rows():
    return {r[0]: r for r in compatibility.op_rows("cpu")}


def test_committed_compatibility_table_is_current(tmp_path):
    out = tmp_path / "compatibility.md"
    assert compatibility.main(["--output", str(out)]) == 0
    committed = compatibility.OUTPUT.read_text()
    assert out.read_text() == committed, "docs/compatibility.md is stale: run python -m tools.compatibility"
    assert compatibility.main(["--check"]) == 0
    out.write_text(committed.replace("| native |", "| CPU fallback |", 1))
    assert compatibility.main(["--check", "--output", str(out)]) == 1


def test_every_aten_overload_and_cuda_function_is_listed(rows):
    names = {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    assert {"add.Tensor", "mm.default", "__lshift__.Scalar"} <= set(rows)
    assert len(rows) >= 0.95 * len(names)
    cuda = {r[0] for r in compatibility.cuda_rows()}
    assert "`torch.cuda.synchronize`" in cuda and "`torch.cuda.memory._snapshot`" in cuda


def _runs(op, *args):
    """(CPU fallbacks, decompositions) counted while ``op`` runs on neuron."""
    metrics.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op(*args)
    return sum(metrics.fallbacks.values()), sum(metrics.decompositions.values())


def test_statuses_say_what_happens(rows):
    x = torch.arange(6, dtype=torch.int32, device="neuron")
    f = torch.ones(3, 3, device="neuron")
    assert rows["add.Tensor"][1] == "native" and _runs(torch.ops.aten.add.Tensor, f, f) == (0, 0)
    fallback = rows["__lshift__.Scalar"]
    assert fallback[1] == "CPU fallback"
    assert _runs(torch.ops.aten.__lshift__.Scalar, x, 1)[0] == 1
    decomposed = rows["__ilshift__.Scalar"]
    assert decomposed[1] == "decomposed (torch._decomp)"
    assert _runs(torch.ops.aten.__ilshift__.Scalar, x.clone(), 1)[1] >= 1
    assert rows["linear.default"][1] == "decomposed (PyTorch)"
    assert torchneuron.config.platform == "cpu"
