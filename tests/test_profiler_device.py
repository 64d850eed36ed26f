"""The neuron lane of torch.profiler traces (activities=[CPU, PrivateUse1]) and timing events."""

from __future__ import annotations

import gzip
import json
import warnings

import torch
from torch.profiler import ProfilerActivity

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
    assert set(tracks.values()) == {"executions", "compiles", "host<->device transfers", "CPU fallbacks"}
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
    assert any(e["name"] == "torchneuron_test::cpu_only" for e in by_track["CPU fallbacks"])
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
