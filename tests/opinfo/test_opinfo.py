"""PyTorch's OpInfo database on neuron against CPU (see ``harness.py`` for what a pass means).

Two layers:

* ``test_slice`` (default, CI): a deterministic slice sized for the 2-core CI machine -- the first
  float32 forward samples of every OpInfo entry, the first float32 gradient sample of every
  autograd-capable entry, and every ``SLICE_STRIDE``-th entry in bfloat16 / int64 / bool.
* ``test_sweep`` (``-m slow``): every sample of every entry, dtype and check. Its totals are what
  ``python -m tools.coverage`` writes to ``docs/coverage.md``.

A failing sample that is not in ``expectations.py`` fails the test with the list of mismatches.
"""

from __future__ import annotations

import pytest
import torch

from . import harness

SLICE_FORWARD = 1      # leading float32 forward samples per entry in the CI slice
SLICE_GRAD = 1         # leading float32 gradient samples per autograd-capable entry
SLICE_STRIDE = 8       # every n-th entry also runs its first sample in the other dtypes


def _dname(dtype):
    return str(dtype).replace("torch.", "")


def _slice_params():
    params = []
    for i, (name, op) in enumerate(harness.OPS.items()):
        for check, limit in (("forward", SLICE_FORWARD), ("grad", SLICE_GRAD)):
            for dtype in harness.dtypes_for(op, check):
                if dtype == torch.float32 or (i % SLICE_STRIDE == 0 and check == "forward"):
                    params.append(pytest.param(name, dtype, check, limit,
                                               id=f"{name}-{_dname(dtype)}-{check}"))
    return params


def _sweep_params():
    return [pytest.param(name, dtype, check, id=f"{name}-{_dname(dtype)}-{check}")
            for name, op in harness.OPS.items()
            for check in ("forward", "grad")
            for dtype in harness.dtypes_for(op, check)]


def _check(name, dtype, check, limit=None):
    op = harness.OPS[name]
    try:
        results = list(harness.run(op, dtype, check, limit=limit))
    finally:
        harness.clear_caches()
    failures = [r for r in results if r.status == "fail"]
    if failures:
        lines = [f"sample {r.index} {r.desc}: {r.detail}" for r in failures[:10]]
        more = f"\n... and {len(failures) - 10} more" if len(failures) > 10 else ""
        pytest.fail(f"{len(failures)} of {len(results)} samples of {name} ({_dname(dtype)}, {check}) "
                    "failed on neuron and are not in tests/opinfo/expectations.py:\n  "
                    + "\n  ".join(lines) + more, pytrace=False)


@pytest.mark.parametrize("name,dtype,check,limit", _slice_params())
def test_slice(name, dtype, check, limit):
    _check(name, dtype, check, limit)


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,check", _sweep_params())
def test_sweep(name, dtype, check):
    _check(name, dtype, check)


def test_expectations_name_real_ops():
    """Every expectations/tolerance entry names an OpInfo entry (catches typos and renames)."""
    from . import expectations
    unknown = sorted({e.op for e in expectations.EXPECTATIONS} - set(harness.OPS))
    unknown += sorted({op for op, _ in expectations.TOLERANCES} - set(harness.OPS))
    assert not unknown, f"expectations for unknown OpInfo entries: {unknown}"
    assert all(e.reason.strip() for e in expectations.EXPECTATIONS)


def test_wrong_answer_is_a_failure():
    """The comparison itself: a mismatch must never pass."""
    a = torch.ones(3, device="neuron")
    assert harness.compare(a, torch.ones(3)) is None
    assert harness.compare(a * 2, torch.ones(3)) is not None
    assert harness.compare(a.to(torch.int64), torch.ones(3)) is not None        # dtype
    assert harness.compare(a[:2], torch.ones(3)) is not None                     # shape
    assert harness.compare((a, a), (torch.ones(3), torch.zeros(3))) is not None  # any output
    assert harness.compare(a.bool(), torch.tensor([True, False, True])) is not None


def test_a_sample_cpu_rejects_must_be_rejected_on_neuron_too():
    """Error parity: a sample CPU rejects was not counted whatever neuron did with it."""
    from torch.testing._internal.opinfo.core import SampleInput

    def only_neuron_runs(x):
        if x.device.type == "cpu":
            raise RuntimeError("invalid on CPU")
        return x + 1

    def nobody_runs(x):
        raise RuntimeError("invalid everywhere")

    sample = SampleInput(torch.ones(3))
    status, detail, _ = harness._error_parity(only_neuron_runs, sample, "fake", RuntimeError("invalid on CPU"))
    assert status == "fail" and "CPU rejects the sample" in detail and "neuron ran it" in detail
    status, _, _ = harness._error_parity(nobody_runs, sample, "fake", RuntimeError("invalid everywhere"))
    assert status == "cpu_error"
