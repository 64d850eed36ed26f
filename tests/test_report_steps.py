"""The readiness report's steps are the checked device's: with a CPU reference loop before the
neuron one, steps come from the optimizer whose parameters are on neuron (and the CPU baseline run
counts the same loop); executables loaded from the persistent cache show as loads, not compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

import torchneuron
from torchneuron.eager import kernel as kernel_mod

# A CPU reference loop (3 steps), then the same model on neuron (5 steps): the flagship example's shape.
TWO_LOOPS = textwrap.dedent("""
    import torch
    from torch import nn
    import torchneuron

    def train(device, steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 8).to(device), torch.randn(32, 1).to(device)
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if device != "cpu":
                torchneuron.track("loss", loss)

    train("cpu", 3)
    train("neuron", 5)
""")


def _check(tmp_path, source, *options, cache=None):
    script = tmp_path / "script.py"
    script.write_text(source)
    out = tmp_path / "report"
    env = {**os.environ, "TORCHNEURON_CACHE_DIR": str(cache or tmp_path / "compile-cache")}
    proc = subprocess.run([sys.executable, "-m", "torchneuron", "check", "-o", str(out), "-q", *options,
                           "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_steps_are_the_neuron_loops_and_the_baseline_counts_the_same_loop(tmp_path):
    report, md = _check(tmp_path, TWO_LOOPS, "--baseline", "cpu")
    run = report["runs"]["neuron"]
    perf = report["performance"]
    assert perf["step_source"] == "optimizer" and perf["steps"] == 5
    assert run["step_optimizer"] == 1
    assert [o["devices"] for o in run["optimizers"]] == [["cpu"], ["neuron"]]
    # Every step is a neuron training step, the first one included (not a CPU step with 0 ops).
    assert all(s["ops"] > 0 for s in run["steps"]), [s["ops"] for s in run["steps"]]
    assert "optimizer #2" in perf["step_note"] and "on cpu" in perf["step_note"]
    assert "optimizer #2" in md
    # The baseline (everything on CPU) counts its second optimizer too: the same loop, 5 steps.
    baseline = report["runs"]["baseline"]
    assert baseline["step_optimizer"] == 1 and len(baseline["steps"]) == 5
    assert perf["baseline"]["steady"]["steps"] == 4
    loss = report["numerics"]["values"][0]
    assert loss["count"] == 5 and loss["steps"] == [1, 2, 3, 4, 5]   # tracked after each step


def test_step_budget_counts_the_neuron_loop_only(tmp_path):
    report, _ = _check(tmp_path, TWO_LOOPS, "--steps", "4")
    run = report["runs"]["neuron"]
    # The 3 CPU steps do not use up the budget: it stops the neuron loop after its 4th step.
    assert report["status"]["reason"] == "steps" and len(run["steps"]) == 4
    assert [o["steps"] for o in run["optimizers"]] == [3, 4]


def _train(device, steps, *, record=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4).to(device)
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model


def test_an_optimizer_on_cpu_marks_steps_only_when_none_has_neuron_parameters():
    with torchneuron.check() as chk:
        _train("cpu", 2)
        _train("neuron", 3)
    perf = chk.report["performance"]
    assert perf["steps"] == 3 and chk.report["runs"]["neuron"]["step_optimizer"] == 1
    assert all(s["ops"] > 0 for s in chk.report["runs"]["neuron"]["steps"])

    with torchneuron.check() as chk:
        x = torch.randn(4).to("neuron")
        _train("cpu", 3)
        (x * 2).sum().item()
    perf = chk.report["performance"]
    assert perf["steps"] == 3 and chk.report["runs"]["neuron"]["step_optimizer"] == 0
    assert perf["step_note"] == ("steps are counted from an optimizer whose parameters are on cpu: no "
                                 "optimizer had neuron parameters")


def test_a_warm_persistent_cache_shows_loads_not_compiles(tmp_path):
    x = torch.randn(40, 6).to("neuron")

    def loop():
        for step in range(4):
            (x[: 10 + step] * 3).sum()   # a new shape in every step
            torchneuron.step()

    with torchneuron.eager_mode("plain"):
        loop()                           # compiles, and stores the executables on disk
        kernel_mod.clear_cache()         # a fresh process: only the disk cache knows them
        with torchneuron.check(str(tmp_path / "r")) as chk:
            loop()
    comp = chk.report["compilation"]
    assert comp["executables_compiled"] == 0 and comp["eager_cache_loads"] >= 8, comp
    assert comp["cold_loads"] >= 2
    sites = {e["op"]: e for e in comp["compile_sites"]}
    assert set(sites) == {"mul.Tensor", "sum"}
    assert all(e["loaded"] == e["count"] == 3 and e["compiled"] == 0 for e in sites.values()), sites
    # The steps that loaded new executables count as steps that needed them.
    assert comp["steady_steps_compiling"] == 3
    md = (tmp_path / "r" / "report.md").read_text()
    compiled_row = next(line for line in md.splitlines() if line.startswith("| Eager executables compiled"))
    assert "loaded from the persistent cache" in compiled_row, compiled_row
    assert "| Compiled | Loaded |" in md
