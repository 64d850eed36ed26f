"""What a run of PyTorch's upstream tests covers and records (``tools/upstream.py`` runs it): the
files and their device-generic classes, a test's device-neutral id and the order tests run in, the
expectations file, and the results files (one JSON line per test).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from collections import defaultdict
from pathlib import Path

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
    "missing-feature": "missing feature (an API or class the device does not provide yet)",
    "known-bug": "known bug (with its issue)",
    "test-assumes-cuda": "test assumes CUDA (or a native in-tree device)",
    "version-skew": "version skew: fails on CPU with the same files and the pinned torch",
}
ACTIONS = ("xfail", "skip")
SKIP_CAUSES = ("crashed", "timeout")   # the recorded statuses a skip entry may stand for
DEVICE_ENV = {"neuron": "privateuse1", "cpu": "cpu"}
# instantiate_device_type_tests names a class after PrivateUse1TestBase.device_type, which its
# setUpClass renames from "privateuse1" to "neuron": later files' classes end in NEURON.
CLASS_SUFFIXES = {"neuron": ("PRIVATEUSE1", "NEURON"), "cpu": ("CPU",)}
RECYCLE_EXIT = 3              # a worker over its memory budget exits with this and is restarted
MAX_WORKER_RSS = 4 << 30      # bytes (executables and samples pile up over thousands of tests)


# -- identifiers ------------------------------------------------------------------------------------
def neutral_name(cls_name: str, method: str, device: str) -> str:
    """``TestFooPRIVATEUSE1.test_bar_neuron_float32`` -> ``TestFoo.test_bar_float32``: the same
    identifier for the neuron and the CPU instantiation of one test."""
    generic = generic_class(cls_name, device) or cls_name
    i = method.rfind("_" + device)
    if i >= 0 and (i + len(device) + 1 == len(method) or method[i + len(device) + 1] == "_"):
        method = method[:i] + method[i + len(device) + 1:]
    return f"{generic}.{method}"


def generic_class(cls_name: str, device: str) -> str | None:
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
    ``{ class = "...", reason = "...", action = "xfail" | "skip", match = "...", cause = "..." }``.

    An ``xfail`` entry (the default) runs its tests and expects each to fail with a failure text
    that ``match`` (a regular expression, searched in the recorded message) finds; a failure with
    another text is unexpected, and so is a crash or a timeout. A ``skip`` entry does not run its
    tests (they hang or kill the process); its ``cause`` ("crashed" or "timeout") is what was
    measured, and ``--retry-skips`` runs them again to check it still holds."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        if path and path.exists():
            data = tomllib.loads(path.read_text())
            for file, table in data.items():
                for pattern, entry in table.items():
                    self.entries[file].append((pattern, self._checked(path, file, pattern, entry)))

    @staticmethod
    def _checked(path, file: str, pattern: str, entry: dict) -> dict:
        where = f"{path}: [{file}] {pattern!r}"
        if entry.get("class") not in REASON_CLASSES:
            raise ValueError(f"{where}: class must be one of "
                             f"{sorted(REASON_CLASSES)}, got {entry.get('class')!r}")
        if not entry.get("reason"):
            raise ValueError(f"{where} has no reason")
        if entry.get("class") == "known-bug" and not re.search(r"issue \d+", entry["reason"]):
            raise ValueError(f"{where}: a known bug names its issue")
        action = entry.get("action", "xfail")
        if action not in ACTIONS:
            raise ValueError(f"{where}: action must be one of {ACTIONS}, got {action!r}")
        unknown = set(entry) - {"class", "reason", "action", "match", "cause"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if action == "skip":
            if entry.get("cause") not in SKIP_CAUSES:
                raise ValueError(f"{where}: a skip entry gives the measured cause, "
                                 f"cause = one of {SKIP_CAUSES}, got {entry.get('cause')!r}")
            if "match" in entry:
                raise ValueError(f"{where}: a skip entry has a cause, not a match")
        else:
            if "cause" in entry:
                raise ValueError(f"{where}: an xfail entry has a match, not a cause "
                                 "(a crash or a timeout needs action = \"skip\")")
            if not entry.get("match"):
                raise ValueError(f"{where}: an xfail entry gives match = a regular expression "
                                 "found in the failure's recorded text")
            else:
                try:
                    re.compile(entry["match"])
                except re.error as e:
                    raise ValueError(f"{where}: match is not a regular expression: {e}") from None
        return dict(entry, action=action)

    def match(self, file: str, test: str) -> tuple[str, dict] | None:
        exact = None
        for pattern, entry in self.entries.get(file, ()):
            if pattern == test:
                return pattern, entry
            if exact is None and fnmatch.fnmatchcase(test, pattern):
                exact = (pattern, entry)
        return exact

    def entry(self, file: str, pattern: str) -> dict:
        return dict(self.entries[file])[pattern]

    def skip_patterns(self, file: str) -> list[str]:
        return [p for p, e in self.entries.get(file, ()) if e["action"] == "skip"]

    @staticmethod
    def matches_failure(entry: dict, message: str) -> bool:
        """Whether an xfail entry's ``match`` finds the failure text."""
        return re.search(entry["match"], message or "") is not None


def records(path: Path):
    """The JSON lines of a results file, one per line ({} for a line cut short by a crash)."""
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield {}


def results_path(results_dir: Path, device: str, file: str) -> Path:
    return results_dir / device / (file.replace("/", "__") + ".jsonl")


def collected(results_dir: Path, device: str, file: str) -> int | None:
    """How many tests the file's device-generic classes hold (written when a worker collects)."""
    path = Path(str(results_path(results_dir, device, file)) + ".total")
    return int(path.read_text()) if path.exists() else None


def load_results(results_dir: Path, device: str, files) -> dict[str, dict[str, dict]]:
    """file -> test id -> its last record (a re-run test's newer record wins)."""
    return {file: {r["id"]: r for r in records(results_path(results_dir, device, file)) if "id" in r}
            for file in files}


FAILING = ("failed", "error", "crashed", "timeout")
