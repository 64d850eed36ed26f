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
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import re
import sys
import threading
import time
import tomllib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .sweep import REPO, supervise, tool_command

DEFAULT_TESTS_DIRS = (REPO / "tests" / "upstream" / "pytorch", REPO.parent / "shared" / "upstream-tests")
DEFAULT_EXPECTATIONS = REPO / "tests" / "upstream" / "expectations.toml"
DEFAULT_RESULTS = REPO / "build" / "upstream"
DEFAULT_OUTPUT = REPO / "docs" / "upstream.md"

# The files and the device-generic classes in them that the run covers (None: every class that
# instantiate_device_type_tests built in the file).
FILES: dict[str, tuple[str, ...] | None] = {
    "test_ops.py": ("TestCommon", "TestCompositeCompliance", "TestMathBits"),
    "test_view_ops.py": None,
    "test_indexing.py": None,
    "test_type_promotion.py": None,
    "test_tensor_creation_ops.py": None,
    "test_shape_ops.py": None,
    "test_binary_ufuncs.py": None,
    "test_unary_ufuncs.py": None,
    "test_reductions.py": None,
    "test_sort_and_select.py": None,
    "test_nn.py": ("TestNNDeviceType",),
    "test_torch.py": ("TestTorchDeviceType",),
    "nn/test_convolution.py": ("TestConvolutionNNDeviceType",),
    "nn/test_pooling.py": ("TestPoolingNNDeviceType",),
    "test_linalg.py": None,
    "test_autograd.py": ("TestAutogradDeviceType", "TestAutogradStreamSynchronization"),
}

REASON_CLASSES = {
    "not-supported-by-design": "not supported by design (sparse, nested, forward AD, quantized, "
                               "float64/complex128 run in 32 bits...)",
    "missing-lowering": "missing lowering",
    "known-bug": "known bug (with its issue)",
    "test-assumes-cuda": "test assumes CUDA (or a native in-tree device)",
    "version-skew": "version skew: fails on CPU with the same files and the pinned torch",
}
DEVICE_ENV = {"neuron": "privateuse1", "cpu": "cpu"}
# instantiate_device_type_tests names a class after PrivateUse1TestBase.device_type, which its
# setUpClass renames from "privateuse1" to "neuron": later files' classes end in NEURON.
CLASS_SUFFIXES = {"neuron": ("PRIVATEUSE1", "NEURON"), "cpu": ("CPU",)}
# `make test`'s slice (tests/test_upstream.py): tests per file; test_ops' tests run many samples each.
CI_SAMPLE = 15
CI_SAMPLE_PER_FILE = {"test_ops.py": 6}
RECYCLE_EXIT = 3              # a worker over its memory budget exits with this and is restarted
MAX_WORKER_RSS = 4 << 30      # bytes (executables and samples pile up over thousands of tests)


# -- identifiers ------------------------------------------------------------------------------------
def neutral_name(cls_name: str, method: str, device: str) -> str:
    """``TestFooPRIVATEUSE1.test_bar_neuron_float32`` -> ``TestFoo.test_bar_float32``: the same
    identifier for the neuron and the CPU instantiation of one test."""
    generic = _generic(cls_name, device) or cls_name
    i = method.rfind("_" + device)
    if i >= 0 and (i + len(device) + 1 == len(method) or method[i + len(device) + 1] == "_"):
        method = method[:i] + method[i + len(device) + 1:]
    return f"{generic}.{method}"


def _generic(cls_name: str, device: str) -> str | None:
    for suffix in CLASS_SUFFIXES[device]:
        if cls_name.endswith(suffix):
            return cls_name[: -len(suffix)]
    return None


def run_order(file: str, ids) -> list:
    """The order a file's tests run in: by sha1 of ``file::id``, the same on every machine and run.
    A run stopped part-way (the complete test_ops run takes days on 2 cores) has then covered a
    uniform sample of the file's classes, tests and ops, not its alphabetically first tests."""
    return sorted(ids, key=lambda t: hashlib.sha1(f"{file}::{t}".encode()).digest())


def sample_ids(file: str, ids, n: int) -> set:
    """A deterministic sample of ``n`` tests of a file: the first ``n`` of ``run_order`` (so a
    larger sample contains a smaller one, and a sample's results count for the complete run)."""
    return set(run_order(file, ids)[:n])


# -- expectations -----------------------------------------------------------------------------------
class Expectations:
    """``[file]`` tables mapping a neutral test id or fnmatch pattern to
    ``{ class = "...", reason = "...", action = "xfail" | "skip" }``."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        if path and path.exists():
            data = tomllib.loads(path.read_text())
            for file, table in data.items():
                for pattern, entry in table.items():
                    if entry.get("class") not in REASON_CLASSES:
                        raise ValueError(f"{path}: [{file}] {pattern!r}: class must be one of "
                                         f"{sorted(REASON_CLASSES)}, got {entry.get('class')!r}")
                    if not entry.get("reason"):
                        raise ValueError(f"{path}: [{file}] {pattern!r} has no reason")
                    if entry.get("class") == "known-bug" and not re.search(r"issue \d+", entry["reason"]):
                        raise ValueError(f"{path}: [{file}] {pattern!r}: a known bug names its issue")
                    self.entries[file].append((pattern, entry))

    def match(self, file: str, test: str) -> tuple[str, dict] | None:
        exact = None
        for pattern, entry in self.entries.get(file, ()):
            if pattern == test:
                return pattern, entry
            if exact is None and fnmatch.fnmatchcase(test, pattern):
                exact = (pattern, entry)
        return exact

    def skip_patterns(self, file: str) -> list[str]:
        return [p for p, e in self.entries.get(file, ()) if e.get("action") == "skip"]


# -- the worker (one process per file) --------------------------------------------------------------
# Names a file's revision imports from a testing module that torch 2.13 moved elsewhere; the
# worker re-exports them where the file looks (the file itself stays as published).
def _skip_ops(*args):
    """Older files call ``skipOps(test_case_name, base_test_name, to_skip)``; torch 2.13's takes
    ``to_skip`` alone and reads both names from the decorated function."""
    from torch.testing._internal.common_device_type import skipOps
    return skipOps(args[-1])


def _skip_if_torch_dynamo(msg="test doesn't currently work with dynamo"):
    """Older files write a bare ``@skipIfTorchDynamo``; torch 2.13's asserts it gets a message."""
    if callable(msg):
        return _SKIP_IF_TORCH_DYNAMO()(msg)
    return _SKIP_IF_TORCH_DYNAMO(msg)


_SKIP_IF_TORCH_DYNAMO = None


COMPAT_NAMES = {
    "torch.testing._internal.common_methods_invocations": {
        "skip": "torch.testing._internal.common_device_type:skip",
        "xfail": "torch.testing._internal.common_device_type:xfail",
        "skipOps": f"{__name__}:_skip_ops",
        # torch 2.13's binary_ufuncs holds the Python references too.
        "binary_ufuncs_and_refs": "torch.testing._internal.common_methods_invocations:binary_ufuncs",
    },
    "torch.testing._internal.common_utils": {
        "skipIfMps": "torch.testing._internal.common_utils:skipIfMPS",
    },
    "torch.testing._internal.common_cuda": {
        "tf32_is_not_fp32": "torch.testing._internal.common_mkldnn:tf32_is_not_fp32",
    },
}


def _install_compat():
    import importlib
    global _SKIP_IF_TORCH_DYNAMO
    for where, names in COMPAT_NAMES.items():
        module = importlib.import_module(where)
        for name, source in names.items():
            if not hasattr(module, name):
                mod, attr = source.split(":")
                setattr(module, name, getattr(importlib.import_module(mod), attr))
    from torch.testing._internal import common_utils
    if _SKIP_IF_TORCH_DYNAMO is None:
        _SKIP_IF_TORCH_DYNAMO = common_utils.skipIfTorchDynamo
        common_utils.skipIfTorchDynamo = _skip_if_torch_dynamo


def _fix_super_self_class(module, generic: str) -> None:
    """test_linalg's ``TestLinalg.setUp/tearDown`` call ``super(self.__class__, self)``, which
    recurses forever now that the device class subclasses the generic one: call the generic
    class's successor in the test's MRO instead, keeping what they do (matmul TF32 off)."""
    import torch
    # instantiate_device_type_tests removed the generic class from the module: find it in the
    # device classes' bases.
    cls = next((base for v in vars(module).values() if isinstance(v, type)
                for base in v.__mro__ if base.__name__ == generic), None)
    if cls is None:
        return

    def setUp(self):                    # noqa: N802 - unittest's name
        super(cls, self).setUp()
        torch.backends.cuda.matmul.allow_tf32 = False

    def tearDown(self):                 # noqa: N802
        torch.backends.cuda.matmul.allow_tf32 = True
        super(cls, self).tearDown()

    cls.setUp, cls.tearDown = setUp, tearDown


# Per file, what the worker changes in the loaded module (the file itself stays as published).
COMPAT_AFTER_LOAD = {
    "test_linalg.py": lambda module: _fix_super_self_class(module, "TestLinalg"),
}


def _load_module(path: Path):
    import importlib.util
    _install_compat()
    sys.path.insert(0, str(path.parent))
    if path.parent.name == "nn":        # nn/test_*.py import siblings of test/ too
        sys.path.insert(0, str(path.parent.parent))
    sys.argv = [str(path)]              # common_utils parses the command line when imported
    name = "upstream_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _tests(module, device: str, classes):
    import unittest
    for cls_name in sorted(vars(module)):
        cls = getattr(module, cls_name)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        generic = _generic(cls_name, device)
        if generic is None or getattr(cls, "device_type", None) is None:
            continue
        if classes is not None and generic not in classes:
            continue
        for method in unittest.TestLoader().getTestCaseNames(cls):
            yield cls, method, neutral_name(cls_name, method, device)


def _first_line(text: str, limit: int = 400) -> str:
    """The line of a traceback that names the exception (the last one that looks like it)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    named = [i for i, ln in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", ln)]
    i = named[-1] if named else len(lines) - 1
    return " ".join(ln.strip() for ln in lines[i:i + 3])[:limit] if lines else ""


def _run_worker(args) -> int:
    import unittest

    import torch
    if args.device == "neuron":
        # Only the neuron worker loads the backend (the CPU reference run stays plain PyTorch).
        import torchneuron
        torchneuron.register()
        metrics = torchneuron.metrics
        if args.jax_cache:
            _enable_jax_cache(args.jax_cache)
    else:
        metrics = None
    path = Path(args.tests_dir) / args.file
    module = _load_module(path)
    if args.file in COMPAT_AFTER_LOAD:
        COMPAT_AFTER_LOAD[args.file](module)
    classes = FILES.get(args.file)
    out = Path(args.out)
    # A re-run counts as done only what it recorded itself (from line --rerun-from on).
    done = _done_ids(out, args.rerun_from or 0)
    only = set(Path(args.only).read_text().split()) if args.only else None
    skips = json.loads(args.skip) if args.skip else []
    current = Path(str(out) + ".current")

    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.outcome = None

        def _set(self, status, message=""):
            # The first non-pass outcome wins (an error in tearDown after a failure...).
            if self.outcome is None or self.outcome[0] in ("passed",):
                self.outcome = (status, message)

        def addSuccess(self, test):
            self._set("passed")

        def _trace(self, test, err):
            text = self._exc_info_to_string(err, test)
            if args.show:
                print(text, flush=True)
            return _first_line(text)

        def addFailure(self, test, err):
            self._set("failed", self._trace(test, err))

        def addError(self, test, err):
            self._set("error", self._trace(test, err))

        def addSkip(self, test, reason):
            self._set("skipped", str(reason)[:400])

        def addExpectedFailure(self, test, err):
            self._set("xfailed-upstream", _first_line(self._exc_info_to_string(err, test)))

        def addUnexpectedSuccess(self, test):
            self._set("failed", "unexpected success of a test PyTorch marks expectedFailure")

        def addSubTest(self, test, subtest, err):
            if err is not None:
                kind = "failed" if issubclass(err[0], test.failureException) else "error"
                self._set(kind, _first_line(self._exc_info_to_string(err, test)))

    set_up = {}
    with open(out, "a") as log:
        def record(tid, status, message="", seconds=0.0, fallbacks=()):
            rec = {"id": tid, "status": status, "message": message, "seconds": round(seconds, 3)}
            if fallbacks:
                rec["fallbacks"] = sorted(fallbacks)
            log.write(json.dumps(rec) + "\n")
            log.flush()

        tests = list(_tests(module, args.device, classes))
        Path(str(out) + ".total").write_text(str(len(tests)))
        last = [r.get("status") for r in _records(out) if r.get("id") == "<collection>"][-1:]
        if last == ["error"]:          # an earlier worker failed to collect; this one did
            record("<collection>", "collected")
        if args.select:
            tests = [t for t in tests if any(fnmatch.fnmatchcase(t[2], p) for p in args.select.split(","))]
        by_id = {t[2]: t for t in tests}
        tests = [by_id[t] for t in run_order(args.file, by_id)]
        if args.sample:
            tests = tests[:args.sample]
        for cls, method, tid in tests:
            if tid in done or (only is not None and tid not in only):
                continue
            if any(fnmatch.fnmatchcase(tid, p) for p in skips):
                record(tid, "not-run", "skipped by the expectations file (action = skip)")
                continue
            if cls not in set_up:
                try:
                    cls.setUpClass()
                    set_up[cls] = None
                except Exception as e:  # the whole class errors
                    set_up[cls] = f"setUpClass: {type(e).__name__}: {e}"[:400]
            if set_up[cls]:
                record(tid, "error", set_up[cls])
                continue
            current.write_text(json.dumps({"id": tid, "start": time.time()}))
            if metrics is not None:
                metrics.fallbacks.clear()
            result = Result()
            t0 = time.perf_counter()
            try:
                cls(method).run(result)
            except BaseException as e:  # noqa: BLE001 - a test that escapes unittest's handling
                result._set("error", f"{type(e).__name__}: {e}"[:400])
            if args.device == "neuron":
                # A device check reports at the next synchronisation point: the error belongs to
                # this test, not to the next one's first comparison.
                try:
                    torch.neuron.synchronize()
                except Exception as e:  # noqa: BLE001 - whatever the device reported
                    if result.outcome is None or result.outcome[0] == "passed":
                        result.outcome = ("error", f"reported after the test ended (a device check it "
                                                   f"triggered): {type(e).__name__}: {e}"[:400])
            seconds = time.perf_counter() - t0
            status, message = result.outcome or ("error", "the test reported no outcome")
            record(tid, status, message, seconds, metrics.fallbacks if metrics is not None else ())
            current.unlink(missing_ok=True)
            torch.set_default_dtype(torch.float32)   # a failing test may leave its own behind
            if _rss() > MAX_WORKER_RSS:
                return RECYCLE_EXIT
    return 0


def _enable_jax_cache(path: str) -> None:
    """Eager executables through JAX's persistent cache: the samples' shapes recur from test to
    test and from run to run (assertEqual alone compiles hundreds of comparisons per test), and
    compiling dominates a test's time. torch.compile's graphs use the same directory."""
    import jax

    import torchneuron  # only the neuron worker loads the backend (the CPU run stays plain PyTorch)
    torchneuron.config.cache_dir = path
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _rss() -> int:
    """Resident bytes now (0 where /proc is not there)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _records(path: Path):
    """The JSON lines of a results file, one per line ({} for a line cut short by a crash)."""
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield {}


def _done_ids(out: Path, from_line: int = 0) -> set:
    return {r["id"] for n, r in enumerate(_records(out)) if "id" in r and n >= from_line}


# -- the parent: workers, timeouts, crashes ---------------------------------------------------------
def results_path(results_dir: Path, device: str, file: str) -> Path:
    return results_dir / device / (file.replace("/", "__") + ".jsonl")


def run_file(file: str, device: str, tests_dir: Path, results_dir: Path, expectations: Expectations,
             timeout: float, sample: int = 0, only: list[str] | None = None, log=print,
             show: bool = False, select: str | None = None, jax_cache: str = "",
             rerun: bool = False) -> None:
    """Run one upstream file to completion, restarting the worker after crashes and timeouts.
    ``rerun``: run the ``only`` tests again although they have results (the new ones count)."""
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
           "--skip", json.dumps(expectations.skip_patterns(file)), "--sample", str(sample)]
    if only_file:
        cmd += ["--only", str(only_file)]
    if show:
        cmd += ["--show", "1"]
    if select:
        cmd += ["--select", select]
    if jax_cache and device == "neuron":
        cmd += ["--jax-cache", jax_cache]
    if rerun:
        cmd += ["--rerun-from", str(sum(1 for _ in _records(out)))]
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


# -- classification and the report -----------------------------------------------------------------
FAILING = ("failed", "error", "crashed", "timeout")


def rerun_ids(recs: dict, patterns: str) -> list[str]:
    """The tests of one file's results that ``--rerun PATTERNS`` runs again."""
    pats = patterns.split(",")
    return sorted(t for t, r in recs.items() if t != "<collection>" and any(
        r["status"] in FAILING if p == "failing" else fnmatch.fnmatchcase(t, p) for p in pats))


def _seconds_left(recs: dict, total: int) -> float:
    seconds = [r.get("seconds") or 0.0 for t, r in recs.items() if t != "<collection>"]
    return (total - len(seconds)) * sum(seconds) / len(seconds) if seconds else 0.0


def _hours_left(results: dict, totals: dict, complete: set) -> str:
    left = sum(_seconds_left(results[f], totals[f]) for f in results if totals.get(f) and f not in complete)
    if not left:
        return ""
    return (f" At the mean time per test recorded so far, the rest of the sampled files needs about "
            f"{left / 3600:,.0f} hours of one worker on the machine that ran them (most of a test's time "
            "is compiling executables for its shapes).")


def _time_left(recs: dict, total: int) -> str:
    """The rest of a sampled file at the mean time per test recorded so far (on the machine that
    ran it; a uniform sample, so the mean carries over)."""
    if not any(t != "<collection>" for t in recs):
        return ""
    hours = _seconds_left(recs, total) / 3600
    return f"; about {hours:.0f} h to complete" if hours >= 1 else f"; about {hours * 60:.0f} min to complete"


def complete_files(results: dict, totals: dict) -> set:
    """Files whose every collected test has a result."""
    return {f for f, recs in results.items()
            if totals.get(f) and len(recs) - ("<collection>" in recs) >= totals[f]}


def collected(results_dir: Path, device: str, file: str) -> int | None:
    """How many tests the file's device-generic classes hold (written when a worker collects)."""
    path = Path(str(results_path(results_dir, device, file)) + ".total")
    return int(path.read_text()) if path.exists() else None


def load_results(results_dir: Path, device: str, files) -> dict[str, dict[str, dict]]:
    """file -> test id -> its last record (a re-run test's newer record wins)."""
    return {file: {r["id"]: r for r in _records(results_path(results_dir, device, file)) if "id" in r}
            for file in files}


def classify(file: str, rec: dict, expectations: Expectations) -> tuple[str, str | None, str | None]:
    """(category, reason class, pattern) of one neuron result."""
    status = rec["status"]
    match = expectations.match(file, rec["id"])
    pattern, entry = match if match else (None, None)
    if status == "not-run":
        return "expected", entry["class"] if entry else "not-supported-by-design", pattern
    if status in ("skipped", "xfailed-upstream"):
        return "skipped-upstream", None, None
    if status == "passed":
        # A pattern may cover passing tests too: stale_entries() judges each entry as a whole.
        return "passed", None, pattern
    if entry:
        return "expected", entry["class"], pattern
    return status if status in ("crashed", "timeout") else "failed", None, None


def summarize(results: dict, expectations: Expectations, complete=None):
    per_file = {}
    details = defaultdict(list)
    skip_reasons = Counter()
    fallback_tests = Counter()
    for file, recs in results.items():
        c = Counter()
        for tid, rec in sorted(recs.items()):
            if tid == "<collection>":
                if rec["status"] == "collected":     # a later worker collected the file
                    continue
                c["collection-error"] += 1
                details["failed"].append((file, tid, rec["status"], rec.get("message", "")))
                continue
            cat, rclass, pattern = classify(file, rec, expectations)
            c["results"] += 1
            c[cat] += 1
            if cat == "expected":
                c["expected:" + rclass] += 1
            if cat == "passed" and rec.get("fallbacks"):
                c["passed-with-fallback"] += 1
                fallback_tests.update(rec["fallbacks"])
            if cat == "skipped-upstream":
                skip_reasons[_skip_reason(rec.get("message", ""))] += 1
            if cat in ("failed", "crashed", "timeout"):
                details[cat].append((file, tid, rec["status"], rec.get("message", "")))
        c["stale"] = 0
        per_file[file] = c
    for file, pattern in stale_entries(results, expectations, complete):
        per_file[file]["stale"] += 1
        details["stale"].append((file, pattern, "passed", "every test this entry matches passes"))
    return per_file, details, skip_reasons, fallback_tests


def _skip_reason(message: str) -> str:
    message = re.sub(r"\b(float|int|uint|bfloat|complex)\d*\b|torch\.\w+", "<dtype>", message)
    return re.sub(r"\s+", " ", message)[:120] or "(no reason given)"


def stale_entries(results: dict, expectations: Expectations, complete=None) -> list[tuple[str, str]]:
    """Entries whose matching tests all passed. A pattern is judged only on a file run completely
    (``complete``: those files; None: all), since a sample may hold only its passing tests."""
    seen = defaultdict(lambda: [0, 0])   # (file, pattern) -> [matched, passed]
    for file, recs in results.items():
        exact_only = complete is not None and file not in complete
        for rec in recs.values():
            m = expectations.match(file, rec["id"])
            if m and exact_only and m[0] != rec["id"]:
                continue
            if m and rec["status"] != "not-run":
                s = seen[(file, m[0])]
                s[0] += 1
                s[1] += rec["status"] == "passed"
    return sorted(k for k, (matched, passed) in seen.items() if matched and matched == passed)


COLUMNS = [("results", "results"), ("passed", "passed"), ("failed", "failed (unexpected)"),
           ("skipped-upstream", "skipped by PyTorch's own qualifiers"),
           ("expected:not-supported-by-design", "expected: not supported by design"),
           ("expected:missing-lowering", "expected: missing lowering"),
           ("expected:known-bug", "expected: known bug"),
           ("expected:test-assumes-cuda", "expected: test assumes CUDA"),
           ("expected:version-skew", "version skew"),
           ("crashed", "crashed"), ("timeout", "timed out"), ("stale", "stale expectations")]


def render(results: dict, expectations: Expectations, sources: dict, meta: dict,
           totals: dict | None = None) -> str:
    per_file, details, skip_reasons, fallback_tests = summarize(
        results, expectations, complete_files(results, totals or {}))
    total = Counter()
    for c in per_file.values():
        total.update(c)
    lines = [
        "# PyTorch's own test suite on neuron",
        "",
        "<!-- generated by `python -m tools.upstream` (`make upstream`); do not edit -->",
        "",
        "TorchNeuron states its quality as PyTorch's upstream device-generic tests run on the "
        "`neuron` device. The files below are PyTorch's own, unmodified; "
        "`instantiate_device_type_tests` builds their neuron classes from `PrivateUse1TestBase` "
        "(`PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`), with torchneuron registered before "
        "`common_device_type` builds its bases. Default settings: float64 runs as float32, ops "
        "without a lowering fall back to CPU with a warning (counted below).",
        "",
        f"Run: {meta.get('date', '?')}, torch {meta.get('torch', '?')}, jax {meta.get('jax', '?')}, "
        f"Python {meta.get('python', '?')}; per-test limit {meta.get('timeout', '?')} s.",
        "",
        "## Totals",
        "",
        f"- **{total['results']:,} results**: {total['passed']:,} passed "
        f"({total['passed-with-fallback']:,} of them used the CPU fallback for some op), "
        f"**{total['failed']:,} failed outside the expectations file**, "
        f"{total['skipped-upstream']:,} skipped by PyTorch's own qualifiers (CUDA-only, CPU-only, "
        f"native-device-only, dtype lists...), {total['expected']:,} expected failures or skips "
        f"with a reason in `tests/upstream/expectations.toml`, {total['crashed']:,} crashed, "
        f"{total['timeout']:,} timed out, {total['stale']:,} stale expectations.",
    ]
    for key, label in REASON_CLASSES.items():
        lines.append(f"  - {label}: {total['expected:' + key]:,}")
    totals = totals or {}
    complete = complete_files(results, totals)
    lines += ["", "## Per file", "",
              "| file | tests in its neuron classes | " + " | ".join(label for _, label in COLUMNS) + " | run |",
              "|---" * (len(COLUMNS) + 3) + "|"]
    for file in results:
        c = per_file[file]
        n = f"{totals[file]:,}" if totals.get(file) else "—"
        if not c["results"]:
            lines.append(f"| {file} | {n} | " + " | ".join("—" for _ in COLUMNS) + " | not run |")
            continue
        run = "complete" if file in complete else \
            f"sample ({100 * len(results[file]) / totals[file]:.1f}%{_time_left(results[file], totals[file])})" \
            if totals.get(file) else "sample"
        lines.append(f"| {file} | {n} | " + " | ".join(f"{c[k]:,}" for k, _ in COLUMNS) + f" | {run} |")
    lines.append(f"| **total** | **{sum(v for v in totals.values() if v):,}** | "
                 + " | ".join(f"**{total[k]:,}**" for k, _ in COLUMNS) + " | |")
    lines.append("")
    lines.append("A dash: the file was not run (see Sources). Where *results* is below the file's test "
                 "count, the complete run has not reached the rest yet (it resumes: `make upstream`); a "
                 "file's tests run in a fixed pseudo-random order, so its results so far are a uniform "
                 "sample of its classes, tests and ops. The classes run per file are listed in "
                 "`tools.upstream.FILES`." + _hours_left(results, totals, complete))
    lines += ["", "## Expectations by reason", ""]
    by_entry = defaultdict(Counter)
    for file, recs in results.items():
        for rec in recs.values():
            cat, rclass, pattern = classify(file, rec, expectations)
            if cat == "expected":
                by_entry[rclass][(file, pattern)] += 1
    for key, label in REASON_CLASSES.items():
        entries = by_entry.get(key)
        if not entries:
            continue
        lines += [f"### {label}", "", "| file | test or pattern | tests | reason |", "|---|---|---|---|"]
        # Tests that never ran and match no entry are counted under the design class, pattern None.
        for (file, pattern), n in sorted(entries.items(), key=lambda item: (item[0][0], item[0][1] or "")):
            entry = dict(expectations.entries[file])[pattern] if pattern else {"reason": "?"}
            lines.append(f"| {file} | `{pattern}` | {n} | {entry['reason']} |")
        lines.append("")
    for cat, title in (("failed", "Failing outside the expectations file"), ("crashed", "Crashed"),
                       ("timeout", "Timed out"), ("stale", "Stale expectations (now passing)")):
        if details.get(cat):
            lines += [f"## {title}", "", "| file | test | message |", "|---|---|---|"]
            for file, tid, _status, msg in details[cat][:300]:
                lines.append(f"| {file} | `{tid}` | {msg.replace('|', '/')[:200]} |")
            lines.append("")
    if fallback_tests:
        lines += ["## CPU fallbacks in passing tests", "",
                  "Ops that ran on the CPU fallback (no lowering, no decomposition) in passing tests, "
                  "by number of tests:", ""]
        lines.append(", ".join(f"`{op}` ({n})" for op, n in fallback_tests.most_common(40)))
        lines.append("")
    if skip_reasons:
        lines += ["## PyTorch's own skips, by reason", "", "| reason | tests |", "|---|---|"]
        for reason, n in skip_reasons.most_common(25):
            lines.append(f"| {reason.replace('|', '/')} | {n:,} |")
        lines.append("")
    lines += ["## Sources", "",
              "PyTorch's test files (BSD-3-Clause) as listed in the SOURCES.tsv beside them; the "
              "runner checks each file's git blob sha1 before running it.", "",
              "| file | upstream revision | blob sha1 | status |", "|---|---|---|---|"]
    for file in results:
        s = sources.get(file)
        if s and s["sha1"] != "-":
            lines.append(f"| {file} | {s['revision']} | `{s['sha1'][:12]}` | {s['status']} |")
        elif s:
            lines.append(f"| {file} | — | — | {s['status']} |")
        else:
            lines.append(f"| {file} | — | — | not available: {meta.get('missing', {}).get(file, 'not in the tests directory')} |")
    lines.append("")
    return "\n".join(lines)


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


def misclassified_skew(results: dict, cpu: dict, expectations: Expectations) -> list[tuple[str, str]]:
    """Tests the expectations call version skew that pass on CPU: a neuron problem after all."""
    wrong = []
    for file, recs in results.items():
        for tid, rec in recs.items():
            m = expectations.match(file, tid)
            if m and m[1]["class"] == "version-skew" and rec["status"] in FAILING \
                    and cpu.get(file, {}).get(tid, {}).get("status") == "passed":
                wrong.append((file, tid))
    return sorted(wrong)


# First guesses for --suggest, from the failure's message and the test's name: (class, reason,
# regex on "id: message"). A maintainer confirms each before it goes into the expectations file.
GUESSES = [
    ("not-supported-by-design", "sparse tensors are not supported on neuron", r"[Ss]parse|to_sparse|_csr|_coo"),
    ("not-supported-by-design", "quantized tensors are not supported on neuron", r"[Qq]uantized|quantize_per"),
    ("not-supported-by-design", "nested tensors are not supported on neuron", r"[Nn]ested"),
    ("not-supported-by-design", "forward-mode AD is not supported on neuron", r"forward_ad|fw_grad|make_dual|jvp"),
    ("not-supported-by-design", "the dtype is not supported on neuron (complex32, float8, uint16-64...)",
     r"is not supported on the neuron device"),
    ("known-bug", "issue 18: a CPU tensor where the op needs a neuron one (a device mismatch)",
     r"found at least two devices, neuron:0 and cpu"),
    ("known-bug", "issue 18: PyTorch's Python reference raises ValueError/IndexError/TypeError where CPU "
     "raises RuntimeError (check --cpu-check first: the file may fail on CPU too)", r"^[^:]*: (ValueError|IndexError): "),
    ("known-bug", "issue 18: an out=/in-place casting or argument check is missing",
     r"(out|_out_|casting|inplace|_).*RuntimeError not raised"),
    ("not-supported-by-design", "float64/complex128 run as float32/complex64 (TorchNeuron's dtype policy)",
     r"(float64|complex128|double).*(not close|not equal|dtype|do not match|mismatch)"),
]


def guess(tid: str, message: str) -> tuple[str, str]:
    text = f"{tid}: {message}"
    for cls, reason, pattern in GUESSES:
        if re.search(pattern, text):
            return cls, reason
    return "known-bug", "TODO (issue ?): " + message.replace('"', "'").replace("\\", "/")[:150]


def suggest(results, expectations, skew) -> str:
    """TOML lines for failures without an entry, with a first guess at their class."""
    out = []
    for file, recs in results.items():
        new = [(t, r) for t, r in sorted(recs.items())
               if r["status"] in FAILING and t != "<collection>" and not expectations.match(file, t)]
        if not new:
            continue
        out.append(f'\n["{file}"]')
        for t, r in new:
            if t in skew.get(file, ()):
                cls, reason = "version-skew", "fails on CPU too: " + r.get("message", "")[:120].replace('"', "'")
            else:
                cls, reason = guess(t, r.get("message", ""))
            out.append(f'"{t}" = {{ class = "{cls}", reason = "{reason}" }}')
    return "\n".join(out)


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
        return _run_worker(args)

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
          f"{total['skipped-upstream']} skipped by PyTorch, {total['expected']} expected, "
          f"{total['crashed']} crashed, {total['timeout']} timed out, {len(stale)} stale expectations")
    for cat in ("failed", "crashed", "timeout"):
        for file, tid, _status, msg in details.get(cat, [])[:50]:
            print(f"  {cat.upper()} {file}::{tid}: {msg[:200]}")
    for file, pattern, _, _ in stale:
        print(f"  STALE {file}::{pattern}: every matching test passes; remove the entry")
    bad = total["failed"] + total["crashed"] + total["timeout"] + len(stale)
    if args.cpu_check:
        wrong = misclassified_skew(results, load_results(results_dir, "cpu", shown), expectations)
        for file, tid in wrong:
            print(f"  NOT SKEW {file}::{tid}: classed version-skew but passes on CPU")
        bad += len(wrong)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
