"""The worker of ``tools/upstream.py``: one process runs one upstream file's tests, each recorded as
a JSON line; it writes the test it is on to a heartbeat file, so the parent's supervisor
(``sweep.supervise``) can kill it past the per-test limit and a new worker resume after it. The
compats let older revisions of the files load under the pinned torch.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import time
from pathlib import Path

from .upstream_results import (
    FILES,
    MAX_WORKER_RSS,
    RECYCLE_EXIT,
    generic_class,
    neutral_name,
    records,
    run_order,
)


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
        generic = generic_class(cls_name, device)
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


def run_worker(args) -> int:
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
        last = [r.get("status") for r in records(out) if r.get("id") == "<collection>"][-1:]
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


def _done_ids(out: Path, from_line: int = 0) -> set:
    return {r["id"] for n, r in enumerate(records(out)) if "id" in r and n >= from_line}
