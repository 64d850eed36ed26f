"""`torchneuron check` and the readiness counters: signals stop the checked script with the CLI,
bad options and report folders are refused before anything runs (exit status 2, not 1 = blockers),
custom ops keep their namespace, and every graph break Dynamo makes is counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import torchneuron
from torchneuron import cli

from conftest import cpu_only

_MARKER_SCRIPT = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(_MARKER_SCRIPT)
    return path


def _check(tmp_path, capsys, *options, marker="ran.txt", script_path=None):
    argv = [*options, "--", sys.executable, str(script_path or tmp_path / "script.py"),
            str(tmp_path / marker)]
    status = cli.check(argv)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["--timeout", "nan"], "--timeout must be a positive number"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-2"], "--warmup must be 0 or more"),
    (["--rtol", "-0.1"], "--rtol must be a finite number >= 0"),
    (["--tol", "x"], "--tol expects NAME=RTOL[,ATOL], got 'x'"),
    (["--tol", "loss=abc"], "--tol expects numbers, got 'loss=abc'"),
    (["--baseline", "missing-report.json"], "--baseline missing-report.json: No such file"),
    (["--device-map", "cuda"], "cuda"),
], ids=["timeout", "timeout-nan", "steps", "warmup", "rtol", "tol", "tol-number", "baseline", "device-map"])
def test_invalid_options_are_refused_before_the_script_runs(tmp_path, capsys, script, options, message,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = _check(tmp_path, capsys, "-o", str(tmp_path / "report"), *options)
    assert status == cli.UNUSABLE == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "ran.txt").exists(), "the script ran before its options were checked"


def test_a_baseline_that_is_not_a_report_is_refused_before_the_script_runs(tmp_path, capsys, script):
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"schema": "something/else"}')
    status, err = _check(tmp_path, capsys, "-o", str(tmp_path / "report"), "--baseline", str(bogus))
    assert status == 2 and "neither a torchneuron report nor a run" in err
    assert not (tmp_path / "ran.txt").exists()


@pytest.mark.parametrize("where", ["under-a-file", "a-file"])
def test_an_impossible_report_folder_is_refused_before_the_script_runs(tmp_path, capsys, script, where):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    out = blocker / "report" if where == "under-a-file" else blocker
    status, err = _check(tmp_path, capsys, "--out", str(out))
    assert status == 2
    assert f"cannot write the report folder {out}" in err and "Traceback" not in err
    assert not (tmp_path / "ran.txt").exists()


def test_a_usage_error_in_the_command_is_status_2_not_1(tmp_path, capsys):
    assert cli.check(["-o", str(tmp_path / "r"), "--", "bash", "x.sh"]) == 2
    assert "runs Python programs" in capsys.readouterr().err


def test_sigterm_stops_the_checked_script_with_the_cli(tmp_path, script):
    marker = tmp_path / "pid.txt"
    child = None
    cli_proc = subprocess.Popen(
        [sys.executable, "-m", "torchneuron", "check", "-q", "-o", str(tmp_path / "report"), "--",
         sys.executable, str(script), str(marker), "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            assert cli_proc.poll() is None, cli_proc.communicate()
            time.sleep(0.2)
        child = int(marker.read_text())
        cli_proc.send_signal(signal.SIGTERM)
        _, err = cli_proc.communicate(timeout=60)
        assert cli_proc.returncode == 128 + signal.SIGTERM, err
        assert "stopped by signal" in err
        for _ in range(100):
            if not _alive(child):
                child = None
                break
            time.sleep(0.1)
        assert child is None, "the checked script outlived the CLI that SIGTERM stopped"
    finally:
        if cli_proc.poll() is None:
            cli_proc.kill()
            cli_proc.communicate()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cpu_fallback_of_a_custom_op_keeps_its_namespace(tmp_path):
    x = torch.arange(8.0).to("neuron")
    torchneuron.config.fallback = "silent"
    try:
        with torchneuron.check() as chk:
            torchneuron.step()
            cpu_only(x, 4)
            torchneuron.step()
    finally:
        torchneuron.config.fallback = "warn"
    assert torchneuron.metrics()["fallbacks"] == {"torchneuron_test::cpu_only": 1}
    titles = [f["title"] for f in chk.findings if f["kind"].startswith("fallback")]
    assert titles and all("torchneuron_test::cpu_only" in t and "aten::" not in t for t in titles), titles
    # ATen ops keep their short keys.
    assert torchneuron.metrics.__class__.__module__ == "torchneuron.metrics"
    from torchneuron.metrics import op_key, op_label
    assert op_key("aten::add.Tensor") == "add.Tensor" and op_label("add.Tensor") == "aten::add.Tensor"
    assert op_label(op_key("mylib::scale")) == "mylib::scale"


def test_data_dependent_branch_is_a_counted_graph_break():
    def f(x):
        y = x * 2
        if y.sum() > 0:   # Dynamo cannot trace a branch on a tensor's value
            return y + 1
        return y - 1

    torch._dynamo.reset()
    x = torch.ones(4)
    out = torch.compile(f, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(out.cpu(), f(x))
    breaks = torchneuron.metrics()["graph_breaks"]
    assert sum(breaks.values()) == 1, breaks
    assert any("branch" in reason.lower() or "jump" in reason.lower() for reason in breaks), breaks


def test_graph_breaks_of_other_backends_are_not_counted():
    def f(x):
        y = x * 2
        if y.sum() > 0:
            return y + 1
        return y - 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(torch.ones(3))
    assert torchneuron.metrics()["graph_breaks"] == {}


class _UnhashableBackend:
    """A backend object as Inductor's is (``_TorchCompileInductorWrapper`` defines ``__eq__`` and no
    ``__hash__``): the graph-break counter met it with ``in set()`` and failed the user's compile."""

    __hash__ = None

    def __eq__(self, other):
        return self is other

    def __call__(self, gm, example_inputs):
        return gm.forward


def test_graph_breaks_of_an_unhashable_backend_compile_and_are_not_counted():
    def f(x):
        y = x * 2
        if y.sum() > 0:
            return y + 1
        return y - 1

    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend="neuron")(torch.ones(2, device="neuron"))   # hooks installed
    out = torch.compile(f, backend=_UnhashableBackend())(torch.ones(3))
    torch.testing.assert_close(out, f(torch.ones(3)))
    assert torchneuron.metrics()["graph_breaks"] == {}


def test_readiness_report_counts_the_breaks_of_the_first_compiled_frame():
    # The report's tracer imports torchneuron.compile before Dynamo is loaded: the counter must
    # still be in place when Dynamo traces its first frame.
    code = """
import sys, torch, torchneuron
assert "torch._dynamo" not in sys.modules
def f(x):
    y = x * 2
    if y.sum() > 0:
        return y + 1
    return y - 1
with torchneuron.check() as chk:
    torch.compile(f, backend="neuron")(torch.ones(4, device="neuron"))
print("breaks", sum(chk.report["compilation"]["graph_breaks"].values()))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "breaks 1" in proc.stdout, proc.stdout
