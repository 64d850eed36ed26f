"""The resumable sweep the developer tools run on (``tools/sweep.py``): results it resumes
from, and worker processes that are replaced when they die or hang (one supervisor for all)."""

from __future__ import annotations

import json
import sys

import pytest

from tools import sweep

# A worker: appends {"task": t} for each task on its command line, and dies on "boom" unless the
# results file already records it.
_WORKER = """
import json, sys
path, tasks = sys.argv[1], sys.argv[2:]
for t in tasks:
    if t == "boom":
        sys.exit(3)
    with open(path, "a") as f:
        f.write(json.dumps({"task": t}) + "\\n")
"""


def _results(tmp_path):
    return sweep.ResultsFile(tmp_path / "r.jsonl", lambda row: row.get("task"))


def test_results_file_resumes_from_what_it_holds(tmp_path):
    results = _results(tmp_path)
    results.append({"task": "a", "n": 1})
    results.append({"sample": 0})                      # a row that completes no task
    results.append({"task": "b"})
    results.append({"task": "a", "n": 2})              # the last row of a task counts
    with open(results.path, "a") as f:
        f.write('{"task": "c", "cut by a cra')          # a line cut short by a crash
    assert set(results.done()) == {"a", "b"} and results.done()["a"]["n"] == 2
    results.drop(["a"])
    assert set(results.done()) == {"b"} and {"sample": 0} in results.rows()
    results.clear()
    assert results.rows() == []


def test_a_dead_worker_is_replaced_and_its_task_recorded(tmp_path):
    results = _results(tmp_path)
    results.append({"task": "a"})                      # done before: not run again
    commands, crashes = [], []

    def command(todo):
        commands.append(list(todo))
        return [sys.executable, "-c", _WORKER, str(results.path), *todo]

    def crashed(task, code):
        crashes.append((task, code))
        results.append({"task": task, "status": "fail"})

    sweep.run_in_workers(["a", "b", "boom", "c", "d"], 1, results, command, crashed)
    assert crashes == [("boom", 3)]
    assert commands == [["b", "boom", "c", "d"], ["c", "d"]]
    assert [r["task"] for r in results.rows()] == ["a", "b", "boom", "c", "d"]


def test_tasks_are_shared_between_workers(tmp_path):
    results = _results(tmp_path)
    shares = []

    def command(todo):
        shares.append(list(todo))
        return [sys.executable, "-c", _WORKER, str(results.path), *todo]

    sweep.run_in_workers(list("abcde"), 2, results, command, lambda t, c: None)
    assert sorted(shares) == [["a", "c", "e"], ["b", "d"]]
    assert set(results.done()) == set("abcde")


def test_a_worker_that_exits_without_its_results_is_an_error(tmp_path):
    results = _results(tmp_path)
    with pytest.raises(RuntimeError, match="exited normally without a result for 'a'"):
        sweep.run_worker(["a"], results, lambda todo: [sys.executable, "-c", "pass"], lambda t, c: None)


def test_run_info_records_the_run_and_the_date():
    info = sweep.run_info({"command": "cmd"})
    assert info["command"] == "cmd" and info["date"].endswith("+00:00")
    json.dumps(info)


def test_supervisor_kills_a_worker_whose_task_runs_past_the_timeout(tmp_path):
    heartbeat = tmp_path / "current"
    hang = ("import json, sys, time; open(sys.argv[1], 'w').write(json.dumps({'id': 't1', 'start': time.time()})); "
            "time.sleep(600)")
    exits = []

    def exited(code, timed_out):
        exits.append((code, timed_out))
        return False

    sweep.supervise(lambda: [sys.executable, "-c", hang, str(heartbeat)], exited, timeout=1, heartbeat=heartbeat)
    assert exits == [(-9, "t1")]


def test_supervisor_restarts_workers_until_told_to_stop(tmp_path):
    runs = iter([[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", "pass"], None])
    exits = []
    sweep.supervise(lambda: next(runs), lambda code, timed_out: exits.append(code) or True)
    assert exits == [3, 0]


def test_workers_find_the_tools_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exits = []
    sweep.supervise(iter([[*sweep.tool_command("sweep")], None]).__next__,
                    lambda code, timed_out: exits.append(code) or True)
    assert exits == [0]


# -- the OpInfo sweep at padded sizes (python -m tools.coverage --shapes bucketed) -----------------
_BUCKETED_ENTRIES = ["add", "softmax", "sum", "matmul", "cumsum", "nn.functional.layer_norm"]


def test_bucketed_sweep_runs_samples_padded_and_matches_cpu(tmp_path, monkeypatch):
    """A few entries' leading samples compiled with config.shapes="bucketed" (every dim of size >= 2
    marked dynamic, so OpInfo's sizes run padded to their bucket; the pads poisoned with NaN),
    forward and gradient: none fails,
    each entry runs some sample padded, and the report's "Bucketed shapes" section counts them
    without touching the rest of the report."""
    import torchneuron
    from tools import coverage

    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "")
    monkeypatch.setenv("TORCHNEURON_OPINFO_POISON", "")   # --poison-pads sets it; restored after
    results, report = tmp_path / "bucketed.jsonl", tmp_path / "coverage.md"
    report.write_text("# the eager sweep's report\n\nkept as it is\n")
    before = torchneuron.config.shapes
    assert coverage.main(["--shapes", "bucketed", "--ops", *_BUCKETED_ENTRIES, "--dtypes", "float32",
                          "--limit", "5", "--results", str(results), "--output", str(report),
                          "--no-jax-cache", "--quiet", "--in-process", "--poison-pads"]) == 0
    assert torchneuron.config.shapes == before            # the sweep's mode does not leak
    rows = [r for r in coverage.load_results(results) if r["status"] != "cpu_error"]
    failing = [f"{r['op']} {r['check']} #{r['index']} {r['desc']}: {r['detail']}" for r in rows
               if r["status"] in ("fail", "expected", "dynamo")]
    assert not failing, "\n".join(failing)
    for entry in _BUCKETED_ENTRIES:
        for check in ("forward", "grad"):
            statuses = {r["status"] for r in rows if r["op"] == entry and r["check"] == check}
            assert "native" in statuses, (entry, check, statuses)   # some sample ran padded
    text = report.read_text()
    assert text.startswith("# the eager sweep's report\n\nkept as it is\n\n## Bucketed shapes\n")
    total = sum(1 for _ in rows)
    assert f"| **all** | | {total} |" in text and "### Failing samples (0)" in text
