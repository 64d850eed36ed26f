"""PyTorch's own device-generic tests on neuron: ``python -m tools.upstream``.

PyTorch's test files (``test/test_ops.py``, ``test/test_view_ops.py``...) are written once for any
device: ``instantiate_device_type_tests`` builds one class per available device from
``common_device_type``'s bases. torchneuron registers ``neuron`` as the PrivateUse1 device when
``torch`` is imported, so ``PrivateUse1TestBase`` is among those bases;
``PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`` keeps only the neuron classes (``cpu`` for the
reference run). Nothing in the files is changed.

Each file runs in a worker subprocess that records one JSON line per test; the parent watches it
(``sweep.supervise``, the supervisor every tool shares): a test that runs past ``--timeout`` is
recorded as ``timeout``, one that kills the process as ``crashed``, and a fresh worker resumes
after it. Results persist under ``--results``, so a run
that is stopped resumes where it was (``--fresh`` starts over).

The expectations file (``tests/upstream/expectations.toml``) gives every test that may not pass a
reason class; the report classifies raw results against it, reports entries that started passing
(stale: the run fails) and regenerates ``docs/upstream.md`` (``--render-only`` re-renders).
``--cpu-check`` runs the neuron failures on CPU with the same files: the ones that fail there too
are version skew between the files and the pinned torch, listed apart.

This module runs the files and holds the command line; ``upstream_results`` says what a run covers
and records (files, test ids, expectations, results files), ``upstream_worker`` runs one file's
tests in a worker process, ``upstream_report`` classifies results and renders the report.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .sweep import REPO, supervise, tool_command
from .upstream_report import (
    complete_files,
    misclassified_skew,
    never_retried,
    render,
    rerun_ids,
    suggest,
    summarize,
)
from .upstream_results import (
    DEVICE_ENV,
    FAILING,
    FILES,
    RECYCLE_EXIT,
    Expectations,
    collected,
    load_results,
    records,
    results_path,
)
from .upstream_worker import run_worker

DEFAULT_TESTS_DIRS = (REPO / "tests" / "upstream" / "pytorch", REPO.parent / "shared" / "upstream-tests")
DEFAULT_EXPECTATIONS = REPO / "tests" / "upstream" / "expectations.toml"
DEFAULT_RESULTS = REPO / "build" / "upstream"
DEFAULT_OUTPUT = REPO / "docs" / "upstream.md"

# `make test`'s slice (tests/test_upstream.py): tests per file; test_ops' tests run many samples each.
CI_SAMPLE = 15
CI_SAMPLE_PER_FILE = {"test_ops.py": 6}


# -- the parent: workers, timeouts, crashes ---------------------------------------------------------
def run_file(file: str, device: str, tests_dir: Path, results_dir: Path, expectations: Expectations,
             timeout: float, sample: int = 0, only: list[str] | None = None, log=print,
             show: bool = False, select: str | None = None, jax_cache: str = "",
             rerun: bool = False, skip: list[str] | None = None) -> None:
    """Run one upstream file to completion, restarting the worker after crashes and timeouts.
    ``rerun``: run the ``only`` tests again although they have results (the new ones count).
    ``skip``: the patterns not run (default: the expectations' skip entries)."""
    out = results_path(results_dir, device, file)
    out.parent.mkdir(parents=True, exist_ok=True)
    current = Path(str(out) + ".current")
    only_file = None
    if only is not None:
        only_file = Path(str(out) + ".only")
        only_file.write_text("\n".join(only))
    env = dict(os.environ)
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = DEVICE_ENV[device]
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    env.pop("CI", None)   # upstream changes behaviour under CI (report files); run as a developer
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"   # the reference run is plain PyTorch
    cmd = [*tool_command("upstream"), "--worker", "--file", file,
           "--device", device, "--tests-dir", str(tests_dir), "--out", str(out),
           "--skip", json.dumps(expectations.skip_patterns(file) if skip is None else skip), "--sample", str(sample)]
    if only_file:
        cmd += ["--only", str(only_file)]
    if show:
        cmd += ["--show", "1"]
    if select:
        cmd += ["--select", select]
    if jax_cache and device == "neuron":
        cmd += ["--jax-cache", jax_cache]
    if rerun:
        cmd += ["--rerun-from", str(sum(1 for _ in records(out)))]
    restarts = 0

    def exited(rc, killed):
        nonlocal restarts
        if rc == 0:
            return False
        if rc == RECYCLE_EXIT:
            return True
        try:
            cur = json.loads(current.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            cur = None
        with open(out, "a") as f:
            if killed:
                f.write(json.dumps({"id": killed, "status": "timeout",
                                    "message": f"ran past the {timeout:.0f} s per-test limit"}) + "\n")
            elif cur:
                f.write(json.dumps({"id": cur["id"], "status": "crashed",
                                    "message": f"the process died (exit status {rc})"}) + "\n")
            else:   # died outside a test: importing or collecting the file
                tail = Path(str(out) + ".stderr").read_text().strip().splitlines()[-1:] or [""]
                f.write(json.dumps({"id": "<collection>", "status": "error",
                                    "message": f"exit status {rc}: {tail[0][:400]}"}) + "\n")
                return False
        restarts += 1
        log(f"  {file} [{device}]: {'timeout' if killed else 'crash'} in "
            f"{killed or cur['id']}; resuming ({restarts} restarts)")
        return True

    supervise(lambda: cmd, exited, env=env, timeout=timeout, heartbeat=current, quiet=not show,
              stderr=Path(str(out) + ".stderr"))
    current.unlink(missing_ok=True)
    if only_file:
        only_file.unlink(missing_ok=True)


# -- sources ----------------------------------------------------------------------------------------
def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_sources(tests_dir: Path) -> dict[str, dict]:
    """The files' revisions and git blob sha1s: ``tests/upstream/SOURCES.tsv`` in this repository,
    then ``SOURCES.tsv`` in the tests directory (columns ``file  upstream_path  revision  chars
    blob_sha1  notes``; ``#`` comments). A file may have several rows (a whole file and a cut
    one); it is verified when its blob sha1 matches any of them."""
    rows = defaultdict(list)
    for path in (DEFAULT_EXPECTATIONS.parent / "SOURCES.tsv", tests_dir / "SOURCES.tsv"):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            cols = line.split("\t")
            rows[cols[0]].append({"revision": cols[2], "sha1": cols[4],
                                  "notes": cols[5] if len(cols) > 5 else ""})
    sources = {}
    for file, candidates in rows.items():
        obtained = [c for c in candidates if c["sha1"] != "-"]
        if not obtained:   # a row that says why the file is not there
            sources[file] = dict(candidates[0], status="not obtained: " + candidates[0]["notes"])
            continue
        candidates = obtained
        target = tests_dir / file
        if not target.exists():
            sources[file] = dict(candidates[0], status="missing")
            continue
        sha1 = git_blob_sha1(target.read_bytes())
        match = next((c for c in candidates if c["sha1"] == sha1), None)
        sources[file] = dict(match, status="verified") if match else \
            dict(candidates[0], sha1=sha1, status="HASH MISMATCH")
    return sources


def find_tests_dir(given: str | None) -> Path | None:
    if given:
        return Path(given)
    for d in DEFAULT_TESTS_DIRS:
        if (d / "SOURCES.tsv").exists():
            return d
    return None


# -- command line -----------------------------------------------------------------------------------
def cpu_check(files, tests_dir, results_dir, expectations, timeout, log=print):
    """Run the neuron failures on CPU: the ones failing there too are version skew."""
    neuron = load_results(results_dir, "neuron", files)
    skew = {}
    for file in files:
        failing = sorted(t for t, r in neuron[file].items()
                         if r["status"] in FAILING and t != "<collection>")
        if not failing:
            continue
        log(f"cpu check: {file}: {len(failing)} tests")
        run_file(file, "cpu", tests_dir, results_dir, expectations, timeout, only=failing, log=log)
        cpu = load_results(results_dir, "cpu", [file])[file]
        skew[file] = sorted(t for t in failing if cpu.get(t, {}).get("status") in FAILING)
    return skew


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.upstream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests-dir", help="directory with the upstream files and SOURCES.tsv "
                   f"(default: the first of {', '.join(str(d) for d in DEFAULT_TESTS_DIRS)})")
    p.add_argument("--files", help="comma-separated subset of the files (default: all available)")
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="results directory (JSONL)")
    p.add_argument("--expectations", default=str(DEFAULT_EXPECTATIONS))
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="the Markdown report")
    p.add_argument("--timeout", type=float, default=180.0, help="per-test limit in seconds")
    p.add_argument("--sample", type=int, default=0,
                   help="run a deterministic sample of this many tests per file (0: all)")
    p.add_argument("--ci-sample", action="store_true",
                   help="the sample `make test` runs (CI_SAMPLE tests per file, CI_SAMPLE_PER_FILE)")
    p.add_argument("--jobs", type=int, default=1, help="files run at once")
    p.add_argument("--fresh", action="store_true", help="discard earlier results of these files")
    p.add_argument("--render-only", action="store_true", help="only re-render the report")
    p.add_argument("--no-render", action="store_true", help="do not write the report")
    p.add_argument("--cpu-check", action="store_true",
                   help="run the neuron failures on CPU to find version skew")
    p.add_argument("--suggest", action="store_true",
                   help="print expectation entries for failures that have none")
    p.add_argument("--rerun", metavar="PATTERNS",
                   help="run again the tests with results whose neutral ids match these comma-separated "
                   "fnmatch patterns ('failing': every test whose last result failed, crashed or timed "
                   "out, e.g. after a fix); the new results replace the old")
    p.add_argument("--retry-skips", action="store_true",
                   help="run again the tests of the skip entries (recorded as not run) to check that "
                   "each still crashes or times out as its cause says; one that passes or fails "
                   "otherwise makes its entry stale")
    p.add_argument("--select", metavar="PATTERNS",
                   help="comma-separated fnmatch patterns of neutral test ids to run")
    p.add_argument("--show", metavar="FILE::TEST",
                   help="run one test (neutral id) on neuron and print its traceback")
    p.add_argument("--jax-cache", metavar="DIR",
                   help="JAX's persistent compilation cache for the neuron workers (default: "
                   "RESULTS/jax-cache; 'none' turns it off)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="run files whose blob sha1 does not match SOURCES.tsv")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--device", default="neuron", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--rerun-from", type=int, help=argparse.SUPPRESS)
    p.add_argument("--skip", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)

    tests_dir = find_tests_dir(args.tests_dir)
    if tests_dir is None:
        p.error("no upstream test files found: pass --tests-dir (a directory with SOURCES.tsv)")
    sources = read_sources(tests_dir)
    expectations = Expectations(Path(args.expectations))
    results_dir = Path(args.results)
    wanted = args.files.split(",") if args.files else list(FILES)
    unknown = [f for f in wanted if f not in FILES and f not in sources]
    if unknown:
        p.error(f"unknown files {unknown}: neither in the run's list {list(FILES)} nor in SOURCES.tsv")
    runnable = []
    for f in wanted:
        s = sources.get(f)
        if s and (s["status"] == "verified" or s["status"] == "HASH MISMATCH" and args.allow_unverified):
            runnable.append(f)
        elif s and s["status"] == "HASH MISMATCH":
            print(f"{f}: blob sha1 {s['sha1']} matches no row of SOURCES.tsv; not run "
                  "(--allow-unverified runs it)")
    jax_cache = "" if args.jax_cache == "none" else \
        str(Path(args.jax_cache or Path(args.results) / "jax-cache").resolve())
    if args.show:
        import tempfile
        file, test = args.show.split("::")
        with tempfile.TemporaryDirectory() as tmp:
            run_file(file, "neuron", tests_dir, Path(tmp), expectations, args.timeout, only=[test],
                     show=True, jax_cache=jax_cache)
            print(results_path(Path(tmp), "neuron", file).read_text())
        return 0
    meta_path = results_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if not args.render_only:
        results_dir.mkdir(parents=True, exist_ok=True)
        if args.fresh:
            for f in runnable:
                for dev in ("neuron", "cpu"):
                    results_path(results_dir, dev, f).unlink(missing_ok=True)
        import jax
        import torch
        meta.update(date=datetime.date.today().isoformat(), torch=torch.__version__,
                    jax=jax.__version__, python=platform.python_version(), timeout=args.timeout,
                    sample=args.sample)
        meta_path.write_text(json.dumps(meta, indent=1))
        lock = threading.Lock()

        def log(msg):
            with lock:
                print(msg, flush=True)

        def one(f):
            t0 = time.time()
            log(f"{f}: running on neuron")
            sample = CI_SAMPLE_PER_FILE.get(f, CI_SAMPLE) if args.ci_sample else args.sample
            if args.retry_skips:
                recs = load_results(results_dir, "neuron", [f])[f]
                ids = sorted(t for t, r in recs.items() if r["status"] == "not-run"
                             and (m := expectations.match(f, t)) and m[1]["action"] == "skip")
                log(f"{f}: running {len(ids)} skipped tests again")
                if ids:
                    run_file(f, "neuron", tests_dir, results_dir, expectations, args.timeout, log=log,
                             only=ids, jax_cache=jax_cache, rerun=True, skip=[])
                return
            if args.rerun:
                ids = rerun_ids(load_results(results_dir, "neuron", [f])[f], args.rerun)
                log(f"{f}: running {len(ids)} tests again")
                if ids:
                    run_file(f, "neuron", tests_dir, results_dir, expectations, args.timeout, log=log,
                             only=ids, jax_cache=jax_cache, rerun=True)
                return
            run_file(f, "neuron", tests_dir, results_dir, expectations, args.timeout, sample, log=log,
                     select=args.select, jax_cache=jax_cache)
            log(f"{f}: done in {time.time() - t0:.0f} s")

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(one, runnable))
    skew = {}
    if args.cpu_check:
        skew = cpu_check(runnable, tests_dir, results_dir, expectations, args.timeout)
        for f, ids in skew.items():
            print(f"{f}: {len(ids)} neuron failures fail on CPU too (version skew)")
    shown = [f for f in wanted if f in runnable or not args.files]
    results = load_results(results_dir, "neuron", shown)
    if args.suggest:
        print(suggest(results, expectations, skew))
    totals = {f: collected(results_dir, "neuron", f) for f in shown}
    if not args.no_render:
        meta["missing"] = {f: "not obtained (see tests/upstream/README.md)" for f in shown if f not in sources}
        Path(args.output).write_text(render(results, expectations, sources, meta, totals))
    per_file, details, _, _ = summarize(results, expectations, complete_files(results, totals))
    total = Counter()
    for c in per_file.values():
        total.update(c)
    stale = details.get("stale", [])
    print(f"{total['results']} results: {total['passed']} passed, {total['failed']} failed unexpectedly, "
          f"{total['mismatch']} failed otherwise than their entry says, "
          f"{total['skipped-upstream']} skipped by PyTorch, {total['expected']} expected, "
          f"{total['crashed']} crashed, {total['timeout']} timed out, {total['not-run']} not run "
          f"without an entry, {len(stale)} stale expectations")
    for cat in ("failed", "mismatch", "crashed", "timeout", "not-run"):
        for file, tid, _status, msg in details.get(cat, [])[:50]:
            print(f"  {cat.upper()} {file}::{tid}: {msg[:200]}")
    for file, pattern, _, why in stale:
        print(f"  STALE {file}::{pattern}: {why}; fix or remove the entry")
    for file, pattern in never_retried(results, expectations):
        print(f"  UNCHECKED SKIP {file}::{pattern}: its tests have not run again (--retry-skips)")
    bad = total["failed"] + total["mismatch"] + total["crashed"] + total["timeout"] + total["not-run"] \
        + len(stale)
    if args.cpu_check:
        wrong = misclassified_skew(results, load_results(results_dir, "cpu", shown), expectations)
        for file, tid in wrong:
            print(f"  NOT SKEW {file}::{tid}: classed version-skew but passes on CPU")
        bad += len(wrong)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
