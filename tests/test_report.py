"""Migration-readiness report: `torchneuron check` on sample scripts, the in-process API, the pieces.

The end-to-end tests run the real CLI on tests/scripts/*.py (each in its own process, as a user
would) and assert that the report finds exactly the problem each script has, and nothing else.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import torchneuron
from torchneuron.eager import kernel as kernel_mod
from torchneuron.report import analyze, devmap, render, runner

from conftest import cpu_only

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _line_of(script: str, needle: str) -> int:
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def run_check(tmp_path, script, *options):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "torchneuron", "check", "-o", str(out), "-q", *options,
           "--", sys.executable, str(SCRIPTS / script)]
    # A fresh compile cache: what compiles must not depend on earlier runs on this machine.
    env = {**os.environ, "TORCHNEURON_CACHE_DIR": str(tmp_path / "compile-cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    return proc, report, out


def kinds(report) -> list[str]:
    return sorted(f["kind"] for f in report["findings"])


def _assert_self_contained_html(path):
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert "<script" not in html and "<link" not in html and "src=" not in html
    # The only URL is the SVG namespace.
    assert html.replace('xmlns="http://www.w3.org/2000/svg"', "").count("http") == 0
    svgs = html.split("<svg")[1:]
    for chunk in svgs:
        ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>")   # well-formed
    return len(svgs)


# -- end to end: the CLI on sample scripts ------------------------------------------------------------
def test_clean_script_with_cpu_baseline(tmp_path):
    proc, report, out = run_check(tmp_path, "clean_train.py", "--baseline", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert kinds(report) == []
    assert report["verdict"]["status"] == "ready"
    assert report["status"]["outcome"] == "completed"

    census = report["census"]
    assert {r["path"] for r in census} == {"native"}
    ops = {r["op"] for r in census}
    assert {"addmm", "mse_loss", "mse_loss_backward", "relu", "threshold_backward"} <= ops
    addmm = next(r for r in census if r["op"] == "addmm")
    assert addmm["calls"] == 12     # two Linear layers x six steps
    assert addmm["site"]["file"].endswith("clean_train.py")
    assert addmm["site"]["line"] == _line_of("clean_train.py", "mse_loss(model(x), y)")
    # Backward ops run on the autograd engine's thread: attributed to the backward() line.
    mm = next(r for r in census if r["op"] == "mm")
    assert mm["site"]["line"] == _line_of("clean_train.py", "loss.backward()")
    assert mm["site"]["via"] == "autograd backward"

    perf = report["performance"]
    assert perf["steps"] == 6 and perf["step_source"] == "explicit"
    steady = perf["steady"]
    assert steady["steps"] == 5
    assert steady["p50_s"] <= steady["p95_s"] <= steady["p99_s"] <= steady["max_s"]
    assert steady["samples_per_s"] == pytest.approx(64 * steady["steps_per_s"])
    assert perf["baseline"]["steady"]["steps"] == 5

    comp = report["compilation"]
    assert comp["executables_compiled"] > 0 and comp["cache_hits"] > 0
    assert comp["cold_executables"] == comp["executables_compiled"]   # everything compiles in step 1
    assert comp["steady_steps_compiling"] == 0

    # Uploads of x, y and four parameters; one read: the final loss.item(). The report's own
    # reads of tracked values are not the script's traffic.
    t = report["transfers"]
    assert t["h2d_copies"] == 6
    assert t["d2h_copies"] == 1 and t["d2h_bytes"] == 4

    num = report["numerics"]["values"]
    assert [v["name"] for v in num] == ["loss"]
    loss = num[0]
    assert loss["count"] == loss["baseline_count"] == 6
    assert loss["within_tolerance"] and loss["max_abs"] < 1e-4
    baseline = report["runs"]["baseline"]
    assert baseline["metrics"]["op_calls"] == {}          # the baseline really ran on CPU
    assert baseline["status"]["outcome"] == "completed"

    assert report["memory"]["peak_bytes"] > 0
    env = report["environment"]
    assert env["torch"] == torch.__version__
    import jax
    assert env["jax"] == jax.__version__ and env["pjrt_platform"] == "cpu" and env["device_count"] >= 1
    assert env["torchneuron"] == torchneuron.__version__
    assert "settings" in env

    md = (out / "report.md").read_text()
    assert md.index("## Verdict") < md.index("## Environment and versions") < md.index("## Op census")
    for section in ("## CPU fallbacks", "## Compilation", "## Host↔device transfers", "## Performance",
                    "## Numerics", "## Memory"):
        assert section in md
    assert _assert_self_contained_html(out / "report.html") >= 3   # latency, loss, loss error


def test_cuda_script_with_cpu_fallback_in_loop(tmp_path):
    """A CUDA script, unchanged, under --device-map; steps come from optimizer.step()."""
    proc, report, _ = run_check(tmp_path, "cuda_fallback_in_loop.py", "--device-map", "cuda=neuron",
                                "--steps", "4")
    assert proc.returncode == 1, proc.stderr       # a blocker
    assert kinds(report) == ["fallback_in_loop"]
    finding = report["findings"][0]
    assert finding["op"] == "mylab::activation_histogram"
    assert finding["title"].startswith("mylab::activation_histogram runs on CPU")   # its namespace kept
    assert finding["site"]["line"] == _line_of("cuda_fallback_in_loop.py", "= activation_histogram(")

    assert report["status"] == {**report["status"], "outcome": "stopped", "reason": "steps"}
    assert report["performance"]["steps"] == 4
    assert report["performance"]["step_source"] == "optimizer"
    assert report["runs"]["neuron"]["device_map_rewrites"] > 0

    paths = {r["op"]: r["path"] for r in report["census"]}
    assert paths.pop("mylab::activation_histogram") == "cpu"
    assert set(paths.values()) == {"native"} and "addmm" in paths      # the model ran on neuron
    (row,) = report["fallbacks"]
    assert row["op"] == "mylab::activation_histogram" and row["calls"] == 4 and row["in_hot_loop"]
    assert row["steady_steps_with_calls"] == row["steady_steps"] == 3
    assert row["d2h_copies"] == 4 and row["d2h_bytes"] == 4 * 32 * 16 * 4   # `hidden` read back per call
    assert row["h2d_copies"] == 4 and row["h2d_bytes"] == 4 * 10 * 4        # the histogram uploaded
    assert report["transfers"]["via_fallback"]["d2h_bytes"] == row["d2h_bytes"]


def test_float64_script(tmp_path):
    proc, report, _ = run_check(tmp_path, "float64_train.py")
    assert proc.returncode == 0, proc.stderr       # warnings only
    assert kinds(report) == ["float64_downcast"]
    finding = report["findings"][0]
    assert finding["site"]["line"] == _line_of("float64_train.py", "dtype=torch.float64")
    assert report["float64"] and all(r["count"] >= 1 for r in report["float64"])
    assert report["verdict"]["status"] == "ready_with_warnings"


# -- the in-process API ---------------------------------------------------------------------------------
def _train(steps, model, opt, x, with_fallback=False):
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        if with_fallback:
            cpu_only(out.detach(), 5)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        torchneuron.track("loss", loss)
        torchneuron.step()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("neuron")
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4).to("neuron")


@pytest.mark.filterwarnings("ignore:torchneuron. torchneuron_test..cpu_only is not lowered")
def test_check_context_manager_and_baseline_drift(tmp_path):
    model, opt, x = _model()
    with torchneuron.check(str(tmp_path / "a")) as chk:
        _train(4, model, opt, x, with_fallback=True)
    assert sorted(f["kind"] for f in chk.findings) == ["fallback_in_loop"]
    assert set(chk.files) == {"md", "html", "json"} and all(os.path.exists(p) for p in chk.files.values())
    # Nothing stays hooked into the kernels once the block ends.
    assert torchneuron.metrics.tracer is None
    assert kernel_mod.Kernel.__call__ is kernel_mod._plain_call

    # The same computation against that run: no drift. Against a perturbed copy: drift.
    model, opt, x = _model()
    with torchneuron.check(baseline=chk.files["json"]) as same:
        _train(4, model, opt, x)
    loss = same.report["numerics"]["values"][0]
    assert loss["compared"] == 4 and loss["within_tolerance"] and loss["max_abs"] == 0.0
    assert [f["kind"] for f in same.findings] == []

    previous = json.loads(pathlib.Path(chk.files["json"]).read_text())
    values = previous["runs"]["neuron"]["tracked"]["loss"]["values"]
    values[2] = [values[2][0] * 1.01]
    (tmp_path / "perturbed.json").write_text(json.dumps(previous))
    model, opt, x = _model()
    with torchneuron.check(baseline=str(tmp_path / "perturbed.json")) as drift:
        _train(4, model, opt, x)
    assert [f["kind"] for f in drift.findings] == ["numeric_drift"]
    loss = drift.report["numerics"]["values"][0]
    assert loss["first_bad_index"] == 2 and loss["max_rel"] == pytest.approx(0.01 / 1.01, rel=1e-3)


def test_eager_compiles_after_the_first_step_are_reported_by_call_site(tmp_path, monkeypatch):
    # Static shapes: every new length compiles (with config.shapes="bucketed" these lengths share
    # one bucket and compile nothing after the first).
    monkeypatch.setattr(torchneuron.config, "shapes", "static")
    x = torch.randn(97, 13).to("neuron")
    with torchneuron.check(str(tmp_path / "r")) as chk:
        for step in range(9):
            for i in range(8):
                (x[step * 8 + i] * 2).sum()          # rows: one executable for every offset
            if step % 3 == 0:
                x[: 50 + step].exp().sum()            # a new shape every third step: compiles then
            torchneuron.step()
    report = chk.report
    sites = report["compilation"]["compile_sites"]
    assert [e["op"] for e in sites] == ["exp", "sum"], sites
    exp = sites[0]
    assert exp["count"] == 2 and exp["steps"] == [3, 6] and exp["reasons"] == {"new shape": 2}
    assert exp["site"]["line"] == _line_here("x[: 50 + step].exp().sum()")
    # Two of eight steady steps compile: not every step, but a loop that keeps compiling.
    loops = [f for f in report["findings"] if f["kind"] == "compiling_loop"]
    assert {f["op"] for f in loops} == {"exp", "sum"}, report["findings"]
    assert "new shape" in loops[0]["detail"] and "pad_to_multiple" in loops[0]["detail"]
    md = pathlib.Path(chk.files["md"]).read_text()
    assert "Eager executables needed after the first step" in md

    with torchneuron.check(str(tmp_path / "every")) as every:
        for step in range(5):
            x[: 60 + step].cos().sum()               # a new shape in every step
            torchneuron.step()
    blocker = next(f for f in every.findings if f["kind"] == "recompiles_every_step")
    assert "aten::cos at" in blocker["detail"] and "new shape" in blocker["detail"]
    assert "compiling_loop" not in {f["kind"] for f in every.findings}


def _line_here(needle: str) -> int:
    lines = pathlib.Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line and "_line_here" not in line)


def test_failing_op_is_a_blocker_with_its_call_site(tmp_path):
    x = torch.randn(16).to("neuron")
    old = torchneuron.config.fallback
    torchneuron.config.fallback = "error"
    try:
        with torchneuron.check() as chk:
            with pytest.raises(RuntimeError, match="cpu_only"):
                cpu_only(x, 4)   # the failing line
    finally:
        torchneuron.config.fallback = old
    assert [f["kind"] for f in chk.findings] == ["op_failed", "no_steps"]
    failed = chk.findings[0]
    assert failed["op"] == "torchneuron_test::cpu_only"
    lines = pathlib.Path(__file__).read_text().splitlines()
    assert failed["site"]["line"] == next(i for i, t in enumerate(lines, 1) if t.endswith("# the failing line"))
    row = next(r for r in chk.report["census"] if r["op"] == "torchneuron_test::cpu_only")
    assert row["failed"] == 1 and row["path"] == "cpu" and "TORCHNEURON_FALLBACK" in row["error"]


def test_adaptive_regions_that_keep_changing_are_reported(tmp_path, monkeypatch):
    from torchneuron.eager import adaptive

    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)

    adaptive.wait_for_compiles()
    adaptive.clear_region_cache()
    with torchneuron.eager_mode("adaptive"), torchneuron.check(str(tmp_path)) as chk:
        for block in range(10):   # four new shapes for each one that repeats
            for n in (5 * block + 1, 5 * block + 2, 5 * block + 3, 5 * block + 4, 5 * block + 1):
                (torch.ones(n).to("neuron") * 2).sum().item()
            torchneuron.step()
    adaptive.wait_for_compiles()
    a = chk.report["compilation"]["adaptive"]
    assert a["regions"] == 50 and a["unfused_runs"]["first sighting"] == 40
    assert a["unfused_runs"]["regions keep changing"] >= 3
    assert "adaptive_regions_change" in [f["kind"] for f in chk.findings]
    md = pathlib.Path(chk.files["md"]).read_text()
    assert "Adaptive eager regions" in md and "regions keep changing" in md


# -- the runner (in this process): budgets and script errors --------------------------------------------
def _run_runner(tmp_path, monkeypatch, source, **spec):
    script = tmp_path / "script.py"
    script.write_text(source)
    spec = {"role": "baseline", "device_map": {}, "output": str(tmp_path / "run.json"), **spec}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert runner.main([str(tmp_path / "spec.json"), "--", str(script), "--flag"]) == 0
    return json.loads((tmp_path / "run.json").read_text())


def test_runner_timeout_stops_the_script(tmp_path, monkeypatch):
    run = _run_runner(tmp_path, monkeypatch, "import sys, time\nassert sys.argv[1:] == ['--flag']\n"
                      "while True:\n    time.sleep(0.01)\n", timeout=0.5)
    assert run["status"]["outcome"] == "stopped" and run["status"]["reason"] == "timeout"
    assert kinds(analyze.build(run)) == ["no_steps", "timeout"]


def test_runner_records_script_errors_and_step_budget(tmp_path, monkeypatch):
    run = _run_runner(tmp_path, monkeypatch, "import torchneuron\nfor i in range(10):\n"
                      "    torchneuron.track('i', i)\n    torchneuron.step()\nraise ValueError('boom')\n", steps=3)
    assert run["status"]["outcome"] == "stopped" and len(run["steps"]) == 3
    assert run["tracked"]["i"]["values"] == [[0.0], [1.0], [2.0]]

    run = _run_runner(tmp_path, monkeypatch, "x = 1\nraise ValueError('boom')\n")
    err = run["status"]["error"]
    assert run["status"]["outcome"] == "error" and err["type"] == "ValueError" and err["message"] == "boom"
    assert err["site"]["line"] == 2
    assert kinds(analyze.build(run)) == ["no_steps", "script_error"]


# -- device map -------------------------------------------------------------------------------------------
def test_device_map_runs_cuda_code_on_neuron():
    assert not torch.cuda.is_available()
    dm = devmap.DeviceMap({"cuda": "neuron"}).install()
    try:
        assert torch.cuda.is_available()
        assert torch.zeros(2, device="cuda").device.type == "neuron"
        assert torch.randn(2).cuda().device.type == "neuron"
        assert torch.randn(2).to("cuda:0").device == torch.device("neuron", 0)
        t = torch.ones(3).to(torch.device("cuda"), torch.float16)
        assert t.device.type == "neuron" and t.dtype == torch.float16 and t.is_cuda
        layer = torch.nn.Linear(2, 2).cuda()
        assert layer.weight.device.type == "neuron"
        assert t.new_zeros(2, device="cuda").device.type == "neuron"
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == torch.neuron.max_memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    finally:
        dm.uninstall()
    assert not torch.cuda.is_available()
    assert torch.zeros(1).device.type == "cpu"
    assert "is_cuda" not in torch.Tensor.__dict__ and torch.Tensor.to is torch._C.TensorBase.to


def test_device_map_parse_and_compose():
    m = devmap.parse(["cuda=neuron"])
    assert m == {"cuda": "neuron"}
    assert devmap.compose(m, {"neuron": "cpu"}) == {"cuda": "cpu", "neuron": "cpu"}
    with pytest.raises(ValueError, match="SRC=DST"):
        devmap.parse(["cuda"])


# -- analysis and rendering on synthetic runs ------------------------------------------------------------
def _synthetic_run(steps, **metrics):
    run = analyze.empty_run("neuron", "")
    run["status"] = {"outcome": "completed", "reason": None, "error": None}
    run["steps"] = steps
    run["metrics"].update(metrics)
    run["tracked"] = {}
    return run


def _step(**kw):
    base = {"seconds": 0.01, "samples": None, "memory": 0, "compiles": 0, "compile_seconds": 0.0,
            "cache_hits": 1, "graphs_compiled": 0, "recompiles": 0, "graph_breaks": 0, "fallbacks": {},
            "h2d_copies": 0, "h2d_bytes": 0, "d2h_copies": 0, "d2h_bytes": 0, "ops": 1}
    base.update(kw)
    return base


def test_percentiles_match_numpy():
    import numpy as np
    xs = [0.3, 0.1, 0.5, 0.9, 0.2, 0.7, 0.4]
    for q in (0, 50, 95, 99, 100):
        assert analyze.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_compile_and_fallback_thresholds():
    # One late compile (optimizer state on step 2) is not a pattern; every step is.
    once = _synthetic_run([_step(compiles=5), _step(compiles=1)] + [_step() for _ in range(4)])
    assert kinds(analyze.build(once)) == []
    every = _synthetic_run([_step(compiles=5)] + [_step(compiles=1, recompiles=1) for _ in range(5)],
                           recompiles={"tensor 'x' size mismatch at index 0": 5})
    report = analyze.build(every)
    assert kinds(report) == ["recompiles_every_step"]
    assert "size mismatch" in report["findings"][0]["detail"]
    varied = {f"0/{i}: tensor 'x' size mismatch at index 0. expected {i}, actual {i + 1}": 1 for i in range(4)}
    assert analyze._top_pattern({**varied, "call to print": 2}) == ("0/0: tensor 'x' size mismatch at index 0. "
                                                                    "expected 0, actual 1", 4)
    some = _synthetic_run([_step(compiles=5)] + [_step(compiles=1)] * 2 + [_step()] * 5)
    assert kinds(analyze.build(some)) == ["steady_compiles"]
    # A fallback only during set-up is a warning; graph breaks are reported with their reasons.
    setup = _synthetic_run([_step(fallbacks={"geqrf": 1})] + [_step()] * 3, fallbacks={"geqrf": 1},
                           graph_breaks={"call to print": 2})
    assert kinds(analyze.build(setup)) == ["fallback", "graph_breaks"]


def test_numeric_comparison_handles_nonfinite_and_tolerances():
    mine = [[1.0], [float("nan")], ["inf"], [2.0, 3.0]]
    theirs = [[1.0005], ["nan"], [float("inf")], [2.0, 3.1]]
    max_abs, max_rel, ok, first_bad, abs_s, _, mismatch = analyze._compare(mine, theirs, 1e-3, 0.0)
    assert not mismatch and not ok and first_bad == 3
    assert abs_s[:3] == [pytest.approx(0.0005), 0.0, 0.0]
    assert max_abs == pytest.approx(0.1)
    assert analyze._compare([[1.0]], [[1.0, 2.0]], 1e-3, 0.0)[6]           # shape mismatch
    assert analyze._compare([[float("nan")]], [[1.0]], 1.0, 1.0)[2] is False  # nan vs number drifts


def test_render_escapes_and_stays_strict_json(tmp_path):
    run = _synthetic_run([_step(seconds=s) for s in (1.0, 0.01, 0.02, 0.012)],
                         fallbacks={"weird|op<b>": 3})
    run["sites"] = [{"op": "weird|op<b>", "path": "cpu",
                     "site": {"file": "a.py", "line": 3, "function": "f", "code": "x = y | z  # <tag>"}}]
    run["tracked"] = {"loss": {"shape": [], "rtol": None, "atol": None, "steps": [1, 2], "values": [[1.0], ["nan"]]}}
    report = analyze.build(run)
    files = render.write(report, str(tmp_path))
    assert "<b>" not in pathlib.Path(files["html"]).read_text()
    assert "weird\\|op<b>" in pathlib.Path(files["md"]).read_text()
    data = json.loads(pathlib.Path(files["json"]).read_text())   # strict JSON parses back
    assert data["numerics"]["values"][0]["series"][1] == "nan"
    assert math.isnan(analyze.num(data["numerics"]["values"][0]["series"][1]))
    _assert_self_contained_html(pathlib.Path(files["html"]))


# -- torch.compile ------------------------------------------------------------------------------------------
def test_compile_script_with_changing_shapes(tmp_path):
    """Needs the torch.compile backend (src/torchneuron/compile), which counts recompiles."""
    proc, report, _ = run_check(tmp_path, "compile_changing_shapes.py")
    assert proc.returncode == 1, proc.stderr
    assert kinds(report) == ["recompiles_every_step"], report["findings"]
    comp = report["compilation"]
    assert sum(comp["recompiles"].values()) == 5       # six lengths: one compile, five recompiles
    assert comp["graphs_compiled"] == 6
    assert comp["steady_steps_compiling"] == report["performance"]["steady"]["steps"] == 5
    assert not comp["graph_breaks"]


def test_step_and_track_cost_nothing_without_a_report():
    loss = (torch.ones(3).to("neuron") * 2).sum()
    before = torchneuron.metrics()
    torchneuron.track("loss", loss)
    torchneuron.step(samples=3)
    after = torchneuron.metrics()
    assert after["d2h_copies"] == before["d2h_copies"] and after["op_calls"] == before["op_calls"]
    assert torchneuron.metrics.tracer is None
