"""The neuron lane of torch.profiler traces (activities=[CPU, PrivateUse1]) and timing events."""

from __future__ import annotations

import copy
import gzip
import json
import warnings

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity

import torchneuron
from torchneuron.eager import adaptive as adaptive_mode
from torchneuron.eager import kernel as kernel_mod

from conftest import cpu_only


def _trace(tmp_path, activities, name="trace.json"):
    kernel_mod.clear_cache()      # so the session compiles
    layer = torch.nn.Linear(5, 3).to("neuron")
    x = torch.randn(7, 5)
    with torch.profiler.profile(activities=activities) as prof:
        y = layer(x.to("neuron"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_only(y.detach(), 4)
        y.sum().item()
    path = tmp_path / name
    prof.export_chrome_trace(str(path))
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_trace_has_a_neuron_lane_linked_to_cpu_ranges(tmp_path):
    events = _trace(tmp_path, [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])
    lane = next(e["pid"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
                and e["args"]["name"] == "neuron:0")
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == lane}
    assert set(tracks.values()) == {"executions", "compiles", "host<->device transfers", "CPU fallbacks", "regions"}
    _check_chrome_trace(events)
    slices = [e for e in events if e.get("ph") == "X" and e.get("pid") == lane]
    by_track = {}
    for e in slices:
        by_track.setdefault(tracks[e["tid"]], []).append(e)
    executed = {e["name"] for e in by_track["executions"]}
    assert {"addmm", "sum"} <= executed
    assert "addmm" in {e["name"] for e in by_track["compiles"]}
    h2d = [e for e in by_track["host<->device transfers"] if e["name"] == "h2d"]
    assert sum(e["args"]["bytes"] for e in h2d) >= 7 * 5 * 4
    assert any(e["name"] == "d2h" and e["args"]["bytes"] == 4 for e in by_track["host<->device transfers"])
    fallback = next(e for e in by_track["CPU fallbacks"] if e["name"] == "torchneuron_test::cpu_only")
    assert fallback["args"]["call_site"].endswith(" in _trace"), fallback   # the user line that called it
    assert "test_profiler_device.py:" in fallback["args"]["call_site"]
    # An execution starts after the compile its call made, and within the CPU range that issued it.
    addmm_cpu = next(e for e in events if e.get("ph") == "X" and e["name"] == "neuron::addmm")
    addmm_exec = next(e for e in by_track["executions"] if e["name"] == "addmm")
    addmm_compile = next(e for e in by_track["compiles"] if e["name"] == "addmm")
    assert addmm_compile["ts"] + addmm_compile["dur"] <= addmm_exec["ts"] + 1
    assert addmm_cpu["ts"] - 50 <= addmm_exec["ts"] <= addmm_cpu["ts"] + addmm_cpu["dur"] + 50
    # Flow arrows: each starts inside a neuron:: CPU range on the issuing thread, ends on a lane slice.
    starts = {e["id"]: e for e in events if e.get("ph") == "s" and e.get("cat") == "neuron_flow"}
    ends = {e["id"]: e for e in events if e.get("ph") == "f" and e.get("cat") == "neuron_flow"}
    assert starts and set(starts) == set(ends)
    cpu_ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name")).startswith("neuron::")]
    for fid, s in starts.items():
        assert any(r["tid"] == s["tid"] and r["ts"] <= s["ts"] <= r["ts"] + r["dur"] for r in cpu_ranges), s
        assert ends[fid]["pid"] == lane and ends[fid]["bp"] == "e"
    issued = next(s for s in starts.values() if ends[s["id"]]["ts"] == addmm_exec["ts"]
                  and ends[s["id"]]["tid"] == addmm_exec["tid"])
    assert addmm_cpu["ts"] <= issued["ts"] <= addmm_cpu["ts"] + addmm_cpu["dur"]


def test_cpu_only_trace_has_no_lane_and_gz_export_has_one(tmp_path):
    events = _trace(tmp_path, [ProfilerActivity.CPU])
    assert not any(e.get("cat") == "neuron" for e in events)
    assert any(e.get("name") == "neuron::addmm" for e in events)
    gz = _trace(tmp_path, [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], "trace.json.gz")
    assert any(e.get("cat") == "neuron" and e["name"] == "addmm" for e in gz)


def _timed(a, b, repeats):
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    c = a
    for _ in range(repeats):
        c = (c @ b) * 1e-3
    end.record()
    return start.elapsed_time(end), c


def test_event_elapsed_time_scales_with_work():
    a = torch.randn(1024, 1024, device="neuron")
    b = torch.randn(1024, 1024, device="neuron")
    _timed(a, b, 1)                                      # compiles
    once = min(_timed(a, b, 1)[0] for _ in range(3))     # noise only ever lengthens a run
    ten, c = _timed(a, b, 10)
    assert once > 0 and ten >= 5 * once, (once, ten)
    assert torch.isfinite(c).all()


_PHASES = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"),
           "s": ("id", "ts", "pid", "tid"), "f": ("id", "ts", "pid", "tid")}


def _check_chrome_trace(events):
    """The Trace Event Format fields Perfetto's JSON importer reads, for the phases the lane uses."""
    for e in events:
        assert "ph" in e, e
        ours = e.get("cat") in ("neuron", "neuron_flow") or (isinstance(e.get("pid"), int) and e["pid"] >= 1 << 24)
        if not ours:
            continue
        assert e["ph"] in _PHASES, e
        assert all(k in e for k in _PHASES[e["ph"]]), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] > 0 and isinstance(e["args"], dict), e
        if e["ph"] == "f":
            assert e["bp"] == "e", e
    json.dumps(events, allow_nan=False)   # plain JSON: no NaN or Infinity


@pytest.fixture
def adaptive(monkeypatch):
    adaptive_mode.wait_for_compiles()
    adaptive_mode.clear_region_cache()
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)   # compile when repeated
    torchneuron.set_eager_mode("adaptive")
    yield
    torchneuron.set_eager_mode("plain")
    adaptive_mode.wait_for_compiles()


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("overlap", [False, True], ids=["at-the-cut", "overlapped"])
def test_adaptive_regions_on_the_lane_with_op_counts_and_flows(tmp_path, overlap, monkeypatch):
    # Overlapped: fused runs on the worker thread flow from the cut on the user's thread.
    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", overlap)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cpu_model = copy.deepcopy(model)
    model.to("neuron")
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    xn, yn = x.to("neuron"), y.to("neuron")
    losses = []

    def step(m, opt, a, b):
        opt.zero_grad()
        loss = ((m(a) - b) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        for i in range(4):
            losses.append(step(model, opt, xn, yn))
            if i == 1:
                adaptive_mode.wait_for_compiles()   # the later steps run fused
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    expected = [step(cpu_model, cpu_opt, x, y) for _ in range(4)]
    assert losses == pytest.approx(expected, rel=1e-5)
    path = tmp_path / "adaptive.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    _check_chrome_trace(events)
    lane = next(e["pid"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
                and e["args"]["name"] == "neuron:0")
    regions_tid = next(e["tid"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
                       and e["pid"] == lane and e["args"]["name"] == "regions")
    regions = [e for e in events if e.get("ph") == "X" and e["pid"] == lane and e["tid"] == regions_tid]
    fused = [r for r in regions if r["args"]["fused"]]
    by_op = [r for r in regions if not r["args"]["fused"]]
    assert fused and by_op
    for r in regions:
        assert r["dur"] > 0 and r["args"]["ops"] == len(r["args"]["op_names"]) > 0
        assert r["args"]["cut"] in ("backward end", "optimizer step")
    # the backward region holds the forward and backward ops; the optimizer's its foreach update
    backward = next(r for r in fused if r["args"]["cut"] == "backward end")
    assert {"addmm", "relu", "mm", "threshold_backward"} <= set(backward["args"]["op_names"])
    # op by op: the region's ops' executions lie within its slice, on the executions track
    execs_tid = next(e["tid"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
                     and e["pid"] == lane and e["args"]["name"] == "executions")
    first = by_op[-1]
    inside = [e["name"] for e in events if e.get("ph") == "X" and e["pid"] == lane and e["tid"] == execs_tid
              and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
    assert sorted(inside) == sorted(first["args"]["op_names"])
    # each region's flow starts in a CPU range of the thread that cut it
    ends = {e["id"]: e for e in events if e.get("ph") == "f" and e["pid"] == lane and e["tid"] == regions_tid}
    starts = {e["id"]: e for e in events if e.get("ph") == "s" and e["id"] in ends}
    assert len(ends) == len(regions) and set(starts) == set(ends)
    cpu = [e for e in events if e.get("ph") == "X" and e.get("pid") != lane and e.get("cat") != "neuron"]
    for s in starts.values():
        assert any(r["tid"] == s["tid"] and r["ts"] <= s["ts"] <= r["ts"] + r["dur"] for r in cpu), s
    step_flows = [s for fid, s in starts.items() if any(
        r["name"].startswith("Optimizer.step") and r["tid"] == s["tid"] and r["ts"] <= s["ts"] <= r["ts"] + r["dur"]
        for r in cpu)]
    assert len(step_flows) == sum(r["args"]["cut"] == "optimizer step" for r in regions)


def test_key_averages_carry_neuron_device_time():
    a = torch.randn(1024, 1024, device="neuron")
    small = torch.randn(4, device="neuron")
    (a @ a).sum().item()
    (small + 1).sum().item()      # compiled before the session
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        for _ in range(3):
            b = a @ a
            c = small + 1
        b.sum().item()
        c.sum().item()
    rows = {r.key: r for r in prof.key_averages()}
    mm, add = rows["neuron::mm"], rows["neuron::add.Tensor"]
    assert mm.self_device_time_total > add.self_device_time_total > 0
    assert mm.device_time_total >= mm.self_device_time_total
    # the device events of their own, as CUDA kernels are: what the table's device total adds up
    assert rows["mm"].device_type == DeviceType.PrivateUse1 and rows["mm"].count == 3
    assert rows["mm"].self_device_time_total == pytest.approx(mm.self_device_time_total)
    table = prof.key_averages().table(sort_by="self_device_time_total")
    assert "Self NEURON" in table and "Self NEURON time total" in table
    assert table.index("neuron::mm") < table.index("neuron::add.Tensor")   # sorted by device time
    # a CPU-only session has none
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as cpu_prof:
        (a @ a).sum().item()
    assert all(r.self_device_time_total == 0 for r in cpu_prof.key_averages())


def test_device_time_goes_to_its_op_when_the_clocks_disagree_by_some_ms():
    # PyTorch's profiler clock and the wall clock the lane reads can be ms apart on a loaded
    # machine: an execution issued "before" its range still counts for that range, not for the
    # range that ended before it.
    def cpu_range(i, name, start, end):
        return FunctionEvent(id=i, name=name, thread=1, start_us=start, end_us=end, device_type=DeviceType.CPU,
                             use_device="neuron",
                             trace_name=name, stack=[], input_shapes=[], overload_name="")

    add = cpu_range(1, "neuron::add.Tensor", 0, 100)
    mm = cpu_range(2, "neuron::mm", 5_000, 25_000)
    events = [add, mm]
    base = 1_000_000_000
    issued = base + 3_000 * 1000            # 2 ms before the mm range starts
    lane = [("execute", "mm", issued, issued + 15_000_000, 1, None, 0, issued)]
    torchneuron.profiler.add_device_times(events, lane, base)
    assert mm.self_device_time_total == pytest.approx(15_000)
    assert add.self_device_time_total == 0
