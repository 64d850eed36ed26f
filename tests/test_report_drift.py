"""``torchneuron check --locate-drift``: the report names the first module and ATen op of the
script's model that leave CPU's tolerance (a planted float64 cancellation), says nothing for a clean
model, and changes nothing the script's own run measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Cancel(nn.Module):
        # Exact in float64 on CPU; float64 downcast to float32 on neuron loses x to rounding.
        def forward(self, x):
            y = x.double() + 1e8
            return (y - 1e8).float()   # CANCEL-LINE

    class Squash(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    class Net(nn.Module):
        def __init__(self, middle):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.middle = middle
            self.out = nn.Linear(8, 4)

        def forward(self, x):
            return self.out(torch.relu(self.middle(self.inp(x))))

    torch.manual_seed(0)
    reference = Net(Squash())          # a CPU model called first: not the one checked
    reference(torch.randn(2, 8))
    model = Net(Cancel() if sys.argv[1] == "cancel" else Squash()).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8).to("neuron")).sum().backward()   # MODEL-CALL
        opt.step()
""")


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if marker in text)


def _check(tmp_path, which, *options):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"report-{which}-{len(options)}"
    env = {**os.environ, "TORCHNEURON_CACHE_DIR": str(tmp_path / "compile-cache")}
    proc = subprocess.run([sys.executable, "-m", "torchneuron", "check", "-o", str(out), "-q", *options,
                           "--", sys.executable, str(script), which],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_locate_drift_names_the_planted_module_and_op(tmp_path):
    report, md = _check(tmp_path, "cancel", "--locate-drift")
    drift = report["drift"]
    assert drift["error"] is None and drift["drift"], drift
    assert drift["captured"]["type"] == "Net"      # the neuron model, not the CPU reference
    assert drift["captured"]["backward"] is True   # a training script: gradients compared too
    assert drift["captured"]["site"]["line"] == _line("MODEL-CALL")
    assert drift["module"]["name"] == "middle" and drift["module"]["type"] == "Cancel"
    op = drift["op"]
    assert op["op"] == "aten.sub.Tensor" and op["float64_downcast"]
    assert op["cpu_output_dtypes"] == ["float64"] and op["output_dtypes"] == ["float32"]
    assert op["site"]["line"] == _line("CANCEL-LINE")
    worst = op["difference"]["elements"][0]
    assert abs(worst["cpu"] - worst["neuron"]) > 1e-3
    found = [f for f in report["findings"] if f["kind"] == "drift_located"]
    assert len(found) == 1, report["findings"]
    f = found[0]
    assert f["module"] == "middle" and f["op"] == "aten.sub.Tensor" and f["site"]["line"] == _line("CANCEL-LINE")
    assert "middle (Cancel" in f["detail"] and "float64" in f["detail"] and "cpu" in f["detail"]
    assert "## Drift localisation" in md and "aten.sub.Tensor" in md


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_clean_model_has_no_drift_finding_and_the_run_is_unchanged(tmp_path):
    report, md = _check(tmp_path, "clean", "--locate-drift")
    assert report["drift"]["drift"] is False and report["drift"]["error"] is None
    assert report["drift"]["modules_compared"] == 4   # the model, inp, middle, out
    assert not [f for f in report["findings"] if f["kind"].startswith("drift")], report["findings"]
    assert "No drift" in md
    # Without the flag nothing is localised, and with it the script's own counts are the same.
    plain, plain_md = _check(tmp_path, "clean")
    assert plain["drift"] is None and "## Drift localisation" not in plain_md
    assert plain["runs"]["neuron"].get("drift") is None
    for key in ("op_calls", "h2d_copies", "d2h_copies", "fallbacks"):
        assert report["runs"]["neuron"]["metrics"][key] == plain["runs"]["neuron"]["metrics"][key], key
    assert [s["ops"] for s in report["runs"]["neuron"]["steps"]] == [s["ops"] for s in plain["runs"]["neuron"]["steps"]]


def test_drift_data_with_nonfinite_values_failures_and_no_model_renders():
    from torchneuron.report import analyze, render

    base = analyze.empty_run("neuron", "x")
    base["status"] = {"outcome": "completed"}
    diff = {"max_abs": "inf", "max_rel": "inf", "note": "", "elements": [{"index": [0, 1], "cpu": 1.5, "neuron": "nan"}]}
    located = {"captured": {"type": "Net", "site": None}, "error": None, "drift": True, "rtol": 1e-3, "atol": 1e-5,
               "modules_compared": 2, "ops_compared": 3, "note": "", "text": "Drift ...",
               "module": {"name": "", "type": "Net", "call": 0, "phase": "forward", "output": 0, "difference": diff},
               "op": None}
    cases = [(located, "drift_located", "cpu 1.5, neuron nan"),
             ({"captured": {"type": "Net", "site": None}, "error": "RuntimeError: different modules"},
              "drift_not_located", "different modules"),
             ({"captured": None, "error": None, "note": "no module with all its parameters on neuron was called"},
              "drift_not_located", "no module with all its parameters")]
    for data, kind, text in cases:
        report = analyze.build(dict(base, drift=data, steps=[]))
        found = [f for f in report["findings"] if f["kind"] == kind]
        assert len(found) == 1 and text in found[0]["detail"], report["findings"]
        md = render.to_markdown(json.loads(render.to_json(report)))
        assert "## Drift localisation" in md
        render.to_html(report)
