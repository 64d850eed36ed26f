"""Adaptive eager isolates the ops a fused region cannot hold (eager/adaptive/isolate.py).

Faults are planted in the fused path only (the per-op executables plain eager uses stay right): a
mis-lowered op inside fused traces, a fused compile that fails on one op, a fused executable that
fails when it runs. Each time the region's results stay CPU's, the smallest failing group is named
with its call site, runs op by op from then on, and the rest of the region is fused again.
"""

import copy
import warnings

import pytest
import torch

import torchneuron
from torchneuron.eager import adaptive as adaptive_mode

_real_trace_op = adaptive_mode.compiler._trace_op
_real_fused = adaptive_mode.compiler._fused


@pytest.fixture
def adaptive(monkeypatch):
    adaptive_mode.wait_for_compiles()
    adaptive_mode.clear_region_cache()
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)
    torchneuron.metrics.reset()
    torchneuron.set_eager_mode("adaptive")
    yield
    torchneuron.set_eager_mode("plain")
    adaptive_mode.wait_for_compiles()
    adaptive_mode.clear_region_cache()


def m(name):
    return torchneuron.metrics()[name]


def step(x):
    y = x + 1
    z = y.sin()
    w = z * 3          # the op the faults are planted in
    v = w.exp()
    return (v - 2).sum()


def _mul_inside_fused_traces_is_off_by_one(exe, bufs, runtime):
    out = _real_trace_op(exe, bufs, runtime)
    return (out[0] + 1, *out[1:]) if exe.name.startswith("mul") else out


def _tanh_inside_fused_traces_is_off(exe, bufs, runtime):
    out = _real_trace_op(exe, bufs, runtime)
    return (out[0] * 1.5, *out[1:]) if exe.name == "tanh" else out


def _exp_does_not_compile_fused(exe, bufs, runtime):
    if exe.name == "exp":
        raise RuntimeError("planted: exp cannot be fused")
    return _real_trace_op(exe, bufs, runtime)


def _run(x, occurrences=6):
    """Run the step until its plan has been compiled, bisected and its sites named; every result
    must equal CPU's. Returns the warnings raised."""
    expected = step(x.cpu()).item()
    seen = []
    for _ in range(occurrences):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert step(x).item() == pytest.approx(expected, rel=1e-6)
            adaptive_mode.wait_for_compiles()
        seen += [str(w.message) for w in caught if "fused group" in str(w.message)]
    return seen


def _segments():
    (plan,) = adaptive_mode.plans.table.values()
    return [([exe.name for exe, *_ in s.ops], s.state) for s in plan.segments]


@pytest.mark.usefixtures("adaptive")
def test_a_fused_group_that_differs_from_its_ops_one_by_one_is_isolated(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_verify_fusion", True)
    monkeypatch.setattr(adaptive_mode.compiler, "_trace_op", _mul_inside_fused_traces_is_off_by_one)
    said = _run(torch.arange(8.0).to("neuron"))
    assert _segments() == [(["add.Tensor", "sin"], "ready"), (["mul.Tensor"], "differs"),
                           (["exp", "sub.Tensor", "sum"], "ready")]
    (entry,) = m("fusion_isolated")
    assert entry["ops"] == ["mul.Tensor"] and entry["reason"] == "differs" and entry["region_ops"] == 6
    assert "mul.Tensor" in entry["error"] and "one by one" in entry["error"]
    assert entry["sites"][0]["code"].startswith("w = z * 3")
    assert len(said) == 1 and "mul.Tensor" in said[0] and "test_adaptive_isolate.py" in said[0]
    assert m("region_unfused")["differs"] >= 2    # the isolated op keeps running alone...
    assert m("region_cache_hits") >= 4            # ...between the two fused groups
    assert "isolated from fusion : 1 group(s): mul.Tensor (differs)" in torchneuron.metrics.summary()


@pytest.mark.usefixtures("adaptive")
def test_without_verification_the_fused_result_is_not_compared(monkeypatch):
    # What verification costs is an op-by-op run per compile: off by default, nothing is compared.
    monkeypatch.setattr(adaptive_mode.compiler, "_trace_op", _mul_inside_fused_traces_is_off_by_one)
    x = torch.arange(8.0).to("neuron")
    for _ in range(3):
        step(x).item()
        adaptive_mode.wait_for_compiles()
    assert _segments() == [(["add.Tensor", "sin", "mul.Tensor", "exp", "sub.Tensor", "sum"], "ready")]
    assert m("fusion_isolated") == []


@pytest.mark.usefixtures("adaptive")
def test_an_op_that_fails_to_compile_fused_runs_alone_and_the_rest_stays_fused(monkeypatch):
    monkeypatch.setattr(adaptive_mode.compiler, "_trace_op", _exp_does_not_compile_fused)
    said = _run(torch.linspace(-1, 1, 7).to("neuron"))
    assert _segments() == [(["add.Tensor", "sin", "mul.Tensor"], "ready"), (["exp"], "compile failed"),
                           (["sub.Tensor", "sum"], "ready")]
    (entry,) = m("fusion_isolated")
    assert entry["reason"] == "compile failed" and "planted: exp cannot be fused" in entry["error"]
    assert entry["sites"][0]["code"] == "v = w.exp()"
    assert len(said) == 1 and "failed to compile" in said[0]


@pytest.mark.usefixtures("adaptive")
def test_a_fused_executable_that_fails_when_it_runs_falls_back_then_is_bisected(monkeypatch):
    armed = [False]

    def fused(seg, device, donated=()):
        fn = _real_fused(seg, device, donated)
        if not any(exe.name == "exp" for exe, *_ in seg.ops):
            return fn

        def run(*args):
            if armed[0]:
                raise RuntimeError("planted: the fused executable failed on the device")
            return fn(*args)
        return run

    monkeypatch.setattr(adaptive_mode.compiler, "_fused", fused)
    x = torch.arange(5.0).to("neuron")
    _run(x, occurrences=3)
    assert _segments() == [(["add.Tensor", "sin", "mul.Tensor", "exp", "sub.Tensor", "sum"], "ready")]
    armed[0] = True
    said = _run(x)     # the failing run's results come from its ops run one by one: still CPU's
    assert _segments() == [(["add.Tensor", "sin", "mul.Tensor"], "ready"), (["exp"], "run failed"),
                           (["sub.Tensor", "sum"], "ready")]
    (entry,) = m("fusion_isolated")
    assert entry["reason"] == "run failed" and "planted: the fused executable failed" in entry["error"]
    assert len(said) == 1 and "failed when it ran" in said[0]


@pytest.mark.usefixtures("adaptive")
def test_an_error_of_the_ops_themselves_is_raised_as_plain_eager_raises_it(monkeypatch):
    x = torch.arange(5.0).to("neuron")
    _run(x, occurrences=3)

    def failing(exe, bufs, runtime):
        raise RuntimeError("the device is gone")

    def broken_fused(*args):
        raise RuntimeError("fused run failed")

    (plan,) = adaptive_mode.plans.table.values()
    monkeypatch.setattr(plan.segments[0], "fn", broken_fused)
    monkeypatch.setattr(adaptive_mode.run, "run_op", failing)
    with pytest.raises(RuntimeError, match="the device is gone"):
        step(x).item()
    assert m("fusion_isolated") == []


@pytest.mark.usefixtures("adaptive")
def test_isolation_with_overlapped_fused_runs_keeps_training_exact(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", True)
    monkeypatch.setattr(torchneuron.config, "adaptive_verify_fusion", True)
    monkeypatch.setattr(adaptive_mode.compiler, "_trace_op", _tanh_inside_fused_traces_is_off)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    data, target = torch.randn(12, 6), torch.randn(12, 1)

    def train(model, device):
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data.to(device)), target.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            adaptive_mode.wait_for_compiles()
        return losses

    expected = train(copy.deepcopy(model), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = train(model, "neuron")
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)
    isolated = m("fusion_isolated")
    assert [(e["ops"], e["reason"]) for e in isolated] == [(["tanh"], "differs")]
    assert m("region_cache_hits") > 0
