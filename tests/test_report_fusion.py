"""The readiness report lists the fused groups adaptive eager isolated during the run
(``metrics.fusion_isolated``): a warning per group with its ops, reason and call site."""

from __future__ import annotations

import pathlib

import torch

import torchneuron
from torchneuron.metrics import metrics


def _entry(ops, reason, line):
    site = {"file": "/src/train.py", "line": line, "function": "forward", "code": "y = f(x)"}
    return {"ops": ops, "sites": [None] + [site] * (len(ops) - 1), "reason": reason,
            "error": "XlaRuntimeError: INTERNAL: boom\nmore", "region_ops": 12}


def test_isolated_fused_groups_seen_during_the_run_are_warnings(tmp_path, monkeypatch):
    before = _entry(["aten::mul"], "run failed", 1)      # isolated before the report started
    monkeypatch.setattr(metrics, "fusion_isolated", [before], raising=False)
    x = torch.randn(4).to("neuron")
    with torchneuron.check(str(tmp_path)) as chk:
        (x * 2).sum().item()
        metrics.fusion_isolated.append(_entry(["aten::add", "aten::exp"], "differs", 7))
        metrics.fusion_isolated.append(_entry(["aten::cos", "aten::sin", "aten::tanh"], "compile failed", 9))
        torchneuron.step()
    found = [f for f in chk.findings if f["kind"] == "fusion_isolated"]
    assert [f["ops"] for f in found] == [["aten::add", "aten::exp"], ["aten::cos", "aten::sin", "aten::tanh"]]
    assert found[0]["site"]["line"] == 7 and found[0]["reason"] == "differs"
    assert "A fused group of 2 op(s) (of a region of 12 ops)" in found[0]["detail"]
    assert "aten::add, aten::exp" in found[0]["detail"] and "train.py:7" in found[0]["detail"]
    assert "failed to compile" in found[1]["detail"] and "boom" in found[1]["detail"]
    assert chk.report["compilation"]["fusion_isolated"][1]["reason"] == "compile failed"
    md = pathlib.Path(chk.files["md"]).read_text()
    assert "Fused groups isolated by adaptive eager" in md and "`aten::cos, aten::sin, aten::tanh`" in md


def test_no_isolated_groups_no_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "fusion_isolated", [], raising=False)
    with torchneuron.check() as chk:
        torchneuron.step()
    assert chk.report["compilation"]["fusion_isolated"] == []
    assert "fusion_isolated" not in {f["kind"] for f in chk.findings}
