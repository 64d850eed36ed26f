"""The readiness report lists the fused groups adaptive eager isolated during the run
(``metrics.fusion_isolated``): a warning per group with its ops, reason and call site."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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


# A "test build": the script plants a mis-lowered tanh in fused traces only (the per-op
# executables stay right), then trains. check --verify-fusion must name the group and keep the
# training's values those of CPU.
_PLANTED = """
import torch, torchneuron
from torchneuron.eager.adaptive import compiler
real = compiler._trace_op
def planted(exe, bufs, runtime):
    out = real(exe, bufs, runtime)
    return (out[0] * 1.5, *out[1:]) if exe.name == "tanh" else out
compiler._trace_op = planted
torchneuron.config.adaptive_compile_budget = 1.0
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
data, target = torch.randn(12, 6), torch.randn(12, 1)
cpu = __import__("copy").deepcopy(model)
opt, cpu_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model.to("neuron"), cpu))
for step in range(8):
    for m, o, dev in ((model, opt, "neuron"), (cpu, cpu_opt, "cpu")):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(data.to(dev)), target.to(dev))
        loss.backward()
        o.step()
        if dev == "neuron":
            torchneuron.eager.adaptive.wait_for_compiles()
            got = loss.item()
        else:
            assert abs(got - loss.item()) <= 1e-4 * abs(loss.item()) + 1e-6, (step, got, loss.item())
print("losses match")
"""


def test_check_verify_fusion_names_a_mislowered_op_and_keeps_results_exact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_PLANTED)
    out = tmp_path / "report"
    env = {**os.environ, "TORCHNEURON_CACHE_DIR": ""}
    env.pop("TORCHNEURON_EAGER_MODE", None)
    proc = subprocess.run([sys.executable, "-m", "torchneuron", "check", "-o", str(out), "--verify-fusion",
                           "--fail-on", "never", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert "losses match" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    found = [f for f in report["findings"] if f["kind"] == "fusion_isolated"]
    assert [(f["ops"], f["reason"]) for f in found] == [(["tanh"], "differs")]
    assert found[0]["site"]["file"].endswith("train.py")
