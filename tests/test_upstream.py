"""PyTorch's own device-generic tests on neuron (tools/upstream.py).

The runner's machinery (ids, expectations, crash and timeout recovery, stale entries) is tested on
a small device-generic file written here; the CI slice runs a deterministic sample of the real
upstream files when they are present (``tests/upstream/pytorch`` or ``../shared/upstream-tests``).
The complete run is ``make upstream``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tools import upstream, upstream_report, upstream_results, upstream_worker

REPO = upstream.REPO


def _run(*args, timeout=1800):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-m", "tools.upstream", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_neutral_names_match_neuron_and_cpu_instantiations():
    assert upstream_results.neutral_name("TestShapeOpsPRIVATEUSE1", "test_flip_neuron_float32", "neuron") == \
        "TestShapeOps.test_flip_float32"
    assert upstream_results.neutral_name("TestCommonNEURON", "test_out_abs_neuron_float32", "neuron") == \
        "TestCommon.test_out_abs_float32"
    assert upstream_results.neutral_name("TestShapeOpsCPU", "test_flip_cpu_float32", "cpu") == \
        "TestShapeOps.test_flip_float32"
    # Only the device token is removed, not a "cpu" inside the test's own name.
    assert upstream_results.neutral_name("TestFooCPU", "test_to_cpu_cpu", "cpu") == "TestFoo.test_to_cpu"
    assert upstream_results.neutral_name("TestFooNEURON", "test_neuronx_neuron", "neuron") == "TestFoo.test_neuronx"


def test_sample_is_deterministic_and_bounded():
    ids = [f"TestX.test_{i}" for i in range(500)]
    a = upstream_results.sample_ids("f.py", ids, 20)
    assert a == upstream_results.sample_ids("f.py", list(reversed(ids)), 20) and len(a) == 20
    assert upstream_results.sample_ids("g.py", ids, 20) != a


def test_expectations_need_a_class_and_a_reason(tmp_path):
    bad = tmp_path / "e.toml"
    bad.write_text('["f.py"]\n"TestX.test_a" = { class = "flaky", reason = "x" }\n')
    with pytest.raises(ValueError, match="class must be one of"):
        upstream_results.Expectations(bad)
    bad.write_text('["f.py"]\n"TestX.test_a" = { class = "known-bug", reason = "wrong values" }\n')
    with pytest.raises(ValueError, match="names its issue"):
        upstream_results.Expectations(bad)


def test_expectations_xfail_needs_a_match_and_skip_a_cause(tmp_path):
    bad = tmp_path / "e.toml"
    for body, error in [
        ('{ class = "known-bug", reason = "issue 1: x" }', "xfail entry gives match"),
        ('{ class = "known-bug", reason = "issue 1: x", match = "(" }', "not a regular expression"),
        ('{ class = "known-bug", reason = "issue 1: x", action = "skip" }', "measured cause"),
        ('{ class = "known-bug", reason = "issue 1: x", action = "skip", cause = "slow" }', "measured cause"),
        ('{ class = "known-bug", reason = "issue 1: x", match = "y", cause = "timeout" }', "needs action"),
        ('{ class = "known-bug", reason = "issue 1: x", action = "never" }', "action must be"),
        ('{ class = "known-bug", reason = "issue 1: x", match = "y", mtach = "z" }', "unknown fields"),
    ]:
        bad.write_text(f'["f.py"]\n"TestX.test_a" = {body}\n')
        with pytest.raises(ValueError, match=error):
            upstream_results.Expectations(bad)


CLASSIFIER_ENTRIES = '''
["f.py"]
"T.test_x_*" = { class = "known-bug", reason = "issue 1: wrong sums", match = "Scalars are not equal" }
"T.test_slow" = { class = "known-bug", reason = "issue 1: compile-bound", action = "skip", cause = "timeout" }
"T.test_abort" = { class = "known-bug", reason = "issue 1: aborts", action = "skip", cause = "crashed" }
'''


@pytest.fixture
def classifier_expectations(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text(CLASSIFIER_ENTRIES)
    return upstream_results.Expectations(path)


@pytest.mark.parametrize("tid,status,message,category", [
    # an xfail entry covers only the failure its match finds
    ("T.test_x_a", "failed", "AssertionError: Scalars are not equal! 2 != 3", "expected"),
    ("T.test_x_a", "error", "RuntimeError: something else", "mismatch"),
    ("T.test_x_a", "failed", "", "mismatch"),
    # a crash or a timeout is never an xfail: only a skip entry with that measured cause
    ("T.test_x_a", "crashed", "the process died (exit status 134)", "crashed"),
    ("T.test_x_a", "timeout", "ran past the 180 s per-test limit", "timeout"),
    ("T.test_slow", "timeout", "ran past the 180 s per-test limit", "expected"),
    ("T.test_slow", "crashed", "the process died (exit status 134)", "crashed"),
    ("T.test_abort", "crashed", "the process died (exit status 134)", "expected"),
    ("T.test_abort", "timeout", "ran past the 180 s per-test limit", "timeout"),
    ("T.test_abort", "failed", "AssertionError: x", "mismatch"),
    # no entry
    ("T.test_other", "crashed", "the process died (exit status 134)", "crashed"),
    ("T.test_other", "failed", "AssertionError: x", "failed"),
    # not run: expected under a skip entry; without one it is reported as not run, not "by design"
    ("T.test_slow", "not-run", "skipped by the expectations file (action = skip)", "expected"),
    ("T.test_other", "not-run", "skipped by the expectations file (action = skip)", "not-run"),
    ("T.test_x_a", "not-run", "skipped by the expectations file (action = skip)", "not-run"),
    ("T.test_x_a", "passed", "", "passed"),
])
def test_classify(classifier_expectations, tid, status, message, category):
    rec = {"id": tid, "status": status, "message": message}
    assert upstream_report.classify("f.py", rec, classifier_expectations)[0] == category


def test_summary_counts_mismatches_crashes_and_unentered_not_run(classifier_expectations):
    recs = {t: {"id": t, "status": s, "message": m} for t, s, m in [
        ("T.test_x_a", "failed", "AssertionError: Scalars are not equal!"),
        ("T.test_x_b", "error", "TypeError: another failure"),
        ("T.test_x_c", "crashed", "the process died (exit status 134)"),
        ("T.test_y", "not-run", "skipped by the expectations file (action = skip)"),
        ("T.test_slow", "not-run", "skipped by the expectations file (action = skip)"),
    ]}
    per_file, details, _, _ = upstream_report.summarize({"f.py": recs}, classifier_expectations)
    c = per_file["f.py"]
    assert (c["expected"], c["mismatch"], c["crashed"], c["not-run"], c["stale"]) == (2, 1, 1, 1, 0)
    assert c["expected:not-supported-by-design"] == 0 and c["expected:known-bug"] == 2
    (_, tid, _, msg), = details["mismatch"]
    assert tid == "T.test_x_b" and "Scalars are not equal" in msg and "another failure" in msg
    assert [d[1] for d in details["not-run"]] == ["T.test_y"]
    assert upstream_report.never_retried({"f.py": recs}, classifier_expectations) == [("f.py", "T.test_slow")]


def test_stale_entries_judge_failure_texts_and_retried_skips(classifier_expectations):
    def stale(recs, complete=None):
        return [(p, why) for _, p, why in upstream_report.stale_entries(
            {"f.py": {t: {"id": t, "status": s, "message": m} for t, s, m in recs}},
            classifier_expectations, complete)]
    wrong = [("T.test_x_a", "error", "TypeError: other"), ("T.test_x_b", "passed", "")]
    # a pattern none of whose failures is the one it names is stale (on a complete file)...
    (pattern, why), = stale(wrong)
    assert pattern == "T.test_x_*" and "none of the 2 results" in why
    # ...but not on a sample with fewer than STALE_SAMPLE_MIN of its results
    assert stale(wrong, complete=set()) == []
    many = [(f"T.test_x_{i}", "passed", "") for i in range(upstream_report.STALE_SAMPLE_MIN)]
    assert [p for p, _ in stale(many, complete=set())] == ["T.test_x_*"]
    assert stale(wrong + [("T.test_x_c", "failed", "AssertionError: Scalars are not equal!")]) == []
    # a skip entry run again (--retry-skips): stale when it no longer crashes or times out as it says
    assert stale([("T.test_slow", "not-run", "")]) == []
    assert stale([("T.test_slow", "timeout", "ran past")]) == []
    assert [p for p, _ in stale([("T.test_slow", "passed", "")])] == ["T.test_slow"]
    assert [p for p, _ in stale([("T.test_abort", "timeout", "ran past")])] == ["T.test_abort"]


def test_the_project_expectations_file_is_valid():
    e = upstream_results.Expectations(upstream.DEFAULT_EXPECTATIONS)
    for file, entries in e.entries.items():
        assert file in upstream_results.FILES, file
        for pattern, entry in entries:
            assert entry["reason"].strip() and not entry["reason"].startswith("TODO"), (file, pattern)


def test_a_later_collection_supersedes_a_collection_error():
    exp = upstream_results.Expectations(None)
    recs = {"<collection>": {"id": "<collection>", "status": "error", "message": "ImportError"},
            "T.test_a": {"id": "T.test_a", "status": "passed", "message": ""}}
    per_file, details, _, _ = upstream_report.summarize({"f.py": recs}, exp)
    assert per_file["f.py"]["collection-error"] == 1 and details["failed"]
    recs["<collection>"] = {"id": "<collection>", "status": "collected"}
    per_file, details, _, _ = upstream_report.summarize({"f.py": recs}, exp)
    assert per_file["f.py"]["collection-error"] == 0 and not details["failed"]
    assert upstream_report.complete_files({"f.py": recs}, {"f.py": 1}) == {"f.py"}
    assert upstream_report.complete_files({"f.py": recs}, {"f.py": 2}) == set()


def test_compats_let_older_files_load_under_the_pinned_torch():
    """Names and idioms of the obtained files' revisions that torch 2.13 changed."""
    import torch
    from torch.testing._internal import common_cuda, common_methods_invocations, common_utils
    upstream_worker._install_compat()
    assert common_methods_invocations.binary_ufuncs_and_refs is common_methods_invocations.binary_ufuncs
    assert common_utils.skipIfMps is common_utils.skipIfMPS
    assert callable(common_cuda.tf32_is_not_fp32)

    def test_bare(self):
        return 1
    assert common_utils.skipIfTorchDynamo(test_bare)(None) is None     # a bare decorator
    assert callable(common_utils.skipIfTorchDynamo("why")(test_bare))

    class TestLinalg(common_utils.TestCase):
        def setUp(self):
            super(self.__class__, self).setUp()     # test_linalg's idiom

    class Device(TestLinalg):                       # what instantiate_device_type_tests builds
        def test_x(self):
            pass

    module = type(sys)("m")
    module.TestLinalgCPU = Device                   # the generic class is not in the module
    upstream_worker._fix_super_self_class(module, "TestLinalg")
    torch.backends.cuda.matmul.allow_tf32 = True
    case = Device("test_x")
    case.setUp()                                    # recursed forever before
    assert torch.backends.cuda.matmul.allow_tf32 is False
    case.tearDown()
    assert torch.backends.cuda.matmul.allow_tf32 is True


FAKE = '''
import os, time, torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase, run_tests

class TestFake(TestCase):
    def test_add(self, device):
        self.assertEqual((torch.ones(3, device=device) + 1).cpu(), torch.full((3,), 2.0))

    def test_wrong(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 3.0)

    def test_crash(self, device):
        os._exit(7)

    def test_hang(self, device):
        time.sleep(600)

    def test_stale(self, device):
        pass

    def test_zz_after(self, device):
        self.assertEqual(torch.zeros(1, device=device).item(), 0.0)

instantiate_device_type_tests(TestFake, globals())

if __name__ == "__main__":
    run_tests()
'''


@pytest.fixture
def fake_tests(tmp_path):
    d = tmp_path / "tests"
    d.mkdir()
    data = FAKE.encode()
    (d / "test_fake.py").write_bytes(data)
    (d / "SOURCES.tsv").write_text(
        f"test_fake.py\ttest/test_fake.py\tlocal\t{len(data)}\t{upstream.git_blob_sha1(data)}\twritten by the test\n")
    exp = tmp_path / "expectations.toml"
    exp.write_text(textwrap.dedent('''
        ["test_fake.py"]
        "TestFake.test_wrong" = { class = "known-bug", reason = "issue 0: a sum that is wrong on purpose", match = "Scalars are not close" }
        "TestFake.test_stale" = { class = "known-bug", reason = "issue 0: passes, so this entry is stale", match = "x" }
        "TestFake.test_crash" = { class = "known-bug", reason = "issue 0: an xfail entry does not cover a crash", match = "died" }
    '''))
    return d, exp


def test_runner_records_crashes_and_timeouts_and_resumes(fake_tests, tmp_path):
    tests_dir, exp = fake_tests
    out, results = tmp_path / "upstream.md", tmp_path / "results"
    r = _run("--tests-dir", str(tests_dir), "--files", "test_fake.py", "--results", str(results),
             "--expectations", str(exp), "--output", str(out), "--timeout", "15")
    recs = {json.loads(line)["id"]: json.loads(line)
            for line in (results / "neuron" / "test_fake.py.jsonl").read_text().splitlines()}
    status = {k: v["status"] for k, v in recs.items()}
    assert status == {"TestFake.test_add": "passed", "TestFake.test_wrong": "failed",
                      "TestFake.test_crash": "crashed", "TestFake.test_hang": "timeout",
                      "TestFake.test_stale": "passed", "TestFake.test_zz_after": "passed"}, r.stderr
    # Crash and timeout fail the run; so does the stale entry; the expected failure does not.
    assert r.returncode == 1
    # The crash is a crash although an xfail entry names the test.
    assert "CRASHED test_fake.py::TestFake.test_crash" in r.stdout
    assert "TIMEOUT test_fake.py::TestFake.test_hang" in r.stdout
    assert "STALE test_fake.py::TestFake.test_stale" in r.stdout
    assert "test_wrong" not in r.stdout
    md = out.read_text()
    assert "| test_fake.py | 6 | 6 | 3 | 0 |" in md   # tests, results, passed, failed outside expectations
    assert [ln for ln in md.splitlines() if ln.startswith("| test_fake.py |")][0].endswith("| complete |")
    # Resuming runs nothing again (no worker starts: a second crash would be recorded twice).
    r2 = _run("--tests-dir", str(tests_dir), "--files", "test_fake.py", "--results", str(results),
              "--expectations", str(exp), "--output", str(out), "--timeout", "15")
    lines = (results / "neuron" / "test_fake.py.jsonl").read_text().splitlines()
    assert len(lines) == 6, lines
    assert r2.returncode == 1
    # --rerun runs chosen tests again (once each: the crash is not retried forever); the new
    # results replace the old.
    r3 = _run("--tests-dir", str(tests_dir), "--files", "test_fake.py", "--results", str(results),
              "--expectations", str(exp), "--output", str(out), "--timeout", "15",
              "--rerun", "TestFake.test_wrong,TestFake.test_cr*")
    assert "running 2 tests again" in r3.stdout, r3.stdout
    lines = (results / "neuron" / "test_fake.py.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines[6:]] == ["TestFake.test_crash", "TestFake.test_wrong"] \
        or [json.loads(line)["id"] for line in lines[6:]] == ["TestFake.test_wrong", "TestFake.test_crash"], lines


def test_runner_refuses_a_file_whose_hash_does_not_match(fake_tests, tmp_path):
    tests_dir, exp = fake_tests
    (tests_dir / "test_fake.py").write_text(FAKE + "\n# edited\n")
    r = _run("--tests-dir", str(tests_dir), "--files", "test_fake.py", "--results", str(tmp_path / "r"),
             "--expectations", str(exp), "--no-render")
    assert "matches no row of SOURCES.tsv; not run" in r.stdout


UPSTREAM_DIR = upstream.find_tests_dir(None)


@pytest.mark.skipif(UPSTREAM_DIR is None, reason="PyTorch's upstream test files are not present")
def test_upstream_sample_has_no_unexpected_failures(tmp_path):
    """A deterministic sample of every available upstream file: nothing fails outside the
    expectations file, nothing crashes, no expectation is stale."""
    r = _run("--ci-sample", "--results", str(tmp_path / "results"),
             "--no-render", "--timeout", "600", "--jobs", "2")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " 0 failed unexpectedly" in r.stdout
