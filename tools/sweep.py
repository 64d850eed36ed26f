"""What the developer tools share: a results file they resume from, the supervisor of worker
processes that survive crashes (``supervise``), and where their inputs and outputs live.

A sweep is a list of tasks (an OpInfo entry/dtype/check, a Hugging Face architecture, an upstream
test). Workers append one JSON line per result to one results file; a task is done once a row says
so (``key``). An interrupted sweep resumes by running only the tasks without such a row, and a
worker process that dies (a crash, a hang killed by its timeout) is replaced: the task it was on is
recorded as failed (``on_crash``) and the rest of its share goes on in a new worker.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path


class ResultsFile:
    """JSON-lines results; ``key(row)`` is the task a row completes, or None."""

    def __init__(self, path: Path, key: Callable[[dict], Hashable | None]):
        self.path = Path(path)
        self.key = key

    def files(self) -> list[Path]:
        # path.0, path.1...: what sweeps that gave each worker its own file wrote.
        return [self.path] + sorted(self.path.parent.glob(self.path.name + ".*[0-9]"))

    def rows(self) -> list[dict]:
        """Every row, in the order written (lines that do not parse, e.g. cut by a crash, skipped)."""
        rows = []
        for f in self.files():
            if not f.exists():
                continue
            for line in f.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def done(self) -> dict:
        """Task -> the last row that completed it."""
        done = {}
        for row in self.rows():
            k = self.key(row)
            if k is not None:
                done[k] = row
        return done

    def append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write per row in append mode: rows from concurrent workers never interleave.
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def drop(self, tasks: Iterable) -> None:
        """Forget the rows of ``tasks`` (they are about to run again)."""
        tasks = set(tasks)
        for f in self.files():
            if f.exists():
                keep = [line for line in f.read_text().splitlines()
                        if line.strip() and not _completes(line, self.key, tasks)]
                f.write_text("".join(line + "\n" for line in keep))

    def clear(self) -> None:
        for f in self.files():
            f.unlink(missing_ok=True)


def _completes(line: str, key, tasks) -> bool:
    try:
        return key(json.loads(line)) in tasks
    except json.JSONDecodeError:
        return False


def run_in_workers(tasks: list, jobs: int, results: ResultsFile, command: Callable[[list], list[str]],
                   on_crash: Callable[[Hashable, int], None], env: dict | None = None) -> None:
    """Run the tasks ``results`` has no row for in ``jobs`` worker processes (``run_worker``)."""
    done = results.done()
    todo = [t for t in tasks if t not in done]
    in_parallel(todo, jobs, lambda share: run_worker(share, results, command, on_crash, env))


def in_parallel(tasks: list, jobs: int, run_share: Callable[[list], None]) -> None:
    """Split ``tasks`` into ``jobs`` shares (round robin) and run each share in its own thread."""
    shares = [tasks[i::jobs] for i in range(max(1, jobs))]
    threads = [threading.Thread(target=run_share, args=(share,)) for share in shares if share]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_worker(tasks: list, results: ResultsFile, command: Callable[[list], list[str]],
               on_crash: Callable[[Hashable, int], None], env: dict | None = None) -> None:
    """Run ``command(pending tasks)`` until every task of ``tasks`` has a row in ``results``.

    The worker writes its rows in task order. One that exits with an error is replaced;
    ``on_crash(task, exit code)`` records the first task it left undone, so the next worker starts
    after it.
    """
    pending = {}

    def next_command():
        done = results.done()
        pending["todo"] = todo = [t for t in tasks if t not in done]
        pending["cmd"] = cmd = command(todo) if todo else None
        return cmd

    def exited(code, _timed_out):
        done = results.done()
        first = next((t for t in pending["todo"] if t not in done), None)
        if first is None:
            return False
        if code == 0:
            raise RuntimeError(f"sweep: a worker exited normally without a result for {first!r}: {pending['cmd']}")
        on_crash(first, code)
        if first not in results.done():
            raise RuntimeError(f"sweep: recording the crash of task {first!r} did not complete it")
        return True

    supervise(next_command, exited, env=env)


def supervise(command: Callable[[], list[str] | None], exited: Callable[[int, str | None], bool],
              env: dict | None = None, timeout: float | None = None, heartbeat: Path | None = None,
              quiet: bool = False, stderr: Path | None = None) -> None:
    """The one supervisor of the tools' worker processes: start ``command()`` (None: nothing left
    to do) until ``exited(exit code, task that ran past the timeout or None)`` returns False;
    ``exited`` records what a dead worker left undone, so the next one resumes after it.

    ``heartbeat``: a file the worker writes (``{"id": task, "start": time.time()}``) when it starts
    a task; a task that runs past ``timeout`` seconds gets the worker killed with its process group
    (it runs in a session of its own, so hung grandchildren go too). ``quiet``: the worker's stdout
    is dropped; ``stderr``: appended to this file. Workers find ``tools`` (``worker_env``).
    """
    while True:
        cmd = command()
        if cmd is None:
            return
        if heartbeat is not None:
            heartbeat.unlink(missing_ok=True)
        err = open(stderr, "a") if stderr is not None else None
        try:
            proc = subprocess.Popen(cmd, env=worker_env(env), stdout=subprocess.DEVNULL if quiet else None,
                                    stderr=err, start_new_session=heartbeat is not None)
            timed_out = _watch(proc, heartbeat, timeout) if heartbeat is not None else None
            proc.wait()
        finally:
            if err is not None:
                err.close()
        if not exited(proc.returncode, timed_out):
            return


def _watch(proc, heartbeat: Path, timeout: float | None) -> str | None:
    """Wait for ``proc``; kill it if the task its heartbeat names runs past ``timeout`` (that task)."""
    while proc.poll() is None:
        time.sleep(0.5)
        try:
            cur = json.loads(heartbeat.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if timeout is not None and time.time() - cur["start"] > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return cur["id"]
    return None


def run_info(run: dict | None) -> dict:
    """What a row records about the run that wrote it: ``run`` (command, commit) and the date."""
    return {**(run or {}), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


# -- where things are -----------------------------------------------------------------------------
# The developer tools live in the repository (not in the installed package): they run from a
# checkout, whose root holds their inputs (tests/) and default outputs (build/, docs/).
REPO = Path(__file__).resolve().parents[1]


def default_path(in_checkout: str) -> Path:
    """``in_checkout`` under the repository root."""
    return REPO / in_checkout


def tool_command(name: str) -> list[str]:
    """The command line that runs ``tools/<name>.py`` in a new process (see ``worker_env``)."""
    return [sys.executable, "-m", f"tools.{name}"]


def worker_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with the repository root on ``PYTHONPATH``,
    so that a worker finds the ``tools`` package whatever its current directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def source_revision() -> str | None:
    """The checkout's commit, marked when tracked files have local changes (None if not a git checkout)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return rev.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None
