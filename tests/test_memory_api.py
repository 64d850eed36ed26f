"""torch.neuron.memory: torch.cuda.memory's functions, statistics and snapshots PyTorch's visualizer reads."""

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.cuda import _memory_viz

import torchneuron
from torchneuron.runtime import memory as runtime_memory


@pytest.fixture
def history():
    torch.neuron.memory._record_memory_history(enabled="all", context="all", stacks="python")
    yield
    torch.neuron.memory._record_memory_history(enabled=None)


def test_public_memory_module_hides_allocator_internals():
    mem = torch.neuron.memory
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "memory_stats", "memory_summary", "mem_get_info", "reset_peak_memory_stats",
                 "empty_cache", "_record_memory_history", "_snapshot", "_dump_snapshot"):
        assert callable(getattr(mem, name)), name
        # The same names exist on torch.cuda.memory: users' code ports by changing "cuda" only.
        assert hasattr(torch.cuda.memory, name), name
    for internal in ("_Allocator", "_DLManagedTensor", "allocator", "StorageRecord", "new_tensor"):
        assert not hasattr(mem, internal), internal
    from torch.neuron.memory import memory_allocated
    assert memory_allocated is torch.neuron.memory_allocated


def test_memory_stats_track_allocations_and_frees():
    mem = torch.neuron.memory
    mem.reset_accumulated_memory_stats()
    mem.reset_peak_memory_stats()
    before = mem.memory_allocated()
    x = torch.empty(1000, device="neuron")          # 4000 bytes
    y = torch.empty(250, device="neuron")           # 1000 bytes
    stats = mem.memory_stats()
    assert stats["allocated_bytes.all.current"] == before + 5000 == mem.memory_allocated()
    assert stats["reserved_bytes.all.current"] == mem.memory_reserved()
    assert stats["allocated_bytes.all.allocated"] == 5000
    assert stats["allocation.all.allocated"] == 2 and stats["segment.all.allocated"] == 2
    del x
    stats = mem.memory_stats()
    assert stats["allocated_bytes.all.current"] == before + 1000
    assert stats["allocated_bytes.all.freed"] == 4000 and stats["allocation.all.freed"] == 1
    assert stats["allocated_bytes.all.peak"] == before + 5000 == mem.max_memory_allocated()
    assert stats["num_alloc_retries"] == 0 and stats["num_ooms"] == 0
    # Every key torch.cuda.memory_summary reads for the "all" rows is there.
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                   "inactive_split_bytes", "allocation", "active", "segment", "inactive_split"):
        for field in ("current", "peak", "allocated", "freed"):
            assert f"{metric}.all.{field}" in stats
    mem.reset_peak_memory_stats()
    assert mem.max_memory_allocated() == before + 1000
    summary = mem.memory_summary()
    assert "Allocated memory" in summary and "Tot Freed" in summary and "neuron:0" in summary
    del y


def test_mem_get_info_free_and_total():
    free, total = torch.neuron.memory.mem_get_info()
    assert total == torch.neuron.get_device_properties().total_memory
    x = torch.empty(1 << 20, device="neuron")
    free_after, _ = torch.neuron.memory.mem_get_info()
    assert free_after <= free - x.nbytes or runtime_memory.pjrt.device(0).memory_stats()


def _make_weights():
    return torch.randn(64, 64, device="neuron")   # the allocation the snapshot must point at


def test_snapshot_renders_with_pytorchs_visualizer(history, tmp_path):
    w = _make_weights()
    tmp = torch.ones(128, device="neuron")
    del tmp
    snap = torch.neuron.memory._snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    seg = next(s for s in snap["segments"] if s["address"] == w.untyped_storage().data_ptr())
    assert seg["total_size"] == w.nbytes and seg["blocks"][0]["state"] == "active_allocated"
    frames = seg["blocks"][0]["frames"]
    assert frames[0]["filename"] == __file__ and frames[0]["name"] == "_make_weights"
    assert not any("torchneuron" in f["filename"] and "/src/" in f["filename"] for f in frames)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert "alloc" in actions and "free_completed" in actions
    freed = [e for e in snap["device_traces"][0] if e["action"] == "free_completed"]
    assert any(e["size"] == 128 * 4 for e in freed)
    # PyTorch's own renderers read it.
    text = _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "_make_weights" in text and "active_allocated" in text
    assert "_make_weights" in _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert "segments:" in _memory_viz.segsum(snap)
    trace = _memory_viz.trace(snap)
    assert "free completed" in trace and "Device 0" in trace
    assert "MemoryViz.js" in _memory_viz.trace_plot(snap) and "MemoryViz.js" in _memory_viz.segment_plot(snap)
    path = tmp_path / "snap.pickle"
    torch.neuron.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert loaded["segments"] and "_make_weights" in _memory_viz.segments(loaded, format_flamegraph=str)


def test_history_off_records_nothing():
    torch.neuron.memory._record_memory_history(enabled=None)
    assert runtime_memory.history is None
    x = torch.ones(16, device="neuron")
    snap = torch.neuron.memory._snapshot()
    assert all(not t for t in snap["device_traces"])
    seg = next(s for s in snap["segments"] if s["address"] == x.untyped_storage().data_ptr())
    assert seg["blocks"][0]["frames"] == []


def test_history_max_entries_keeps_newest():
    torch.neuron.memory._record_memory_history(enabled="all", max_entries=4)
    try:
        for _ in range(10):
            torch.ones(8, device="neuron")
        assert len(torch.neuron.memory._snapshot()["device_traces"][0]) == 4
    finally:
        torch.neuron.memory._record_memory_history(enabled=None)
    with pytest.raises(ValueError, match="enabled"):
        torch.neuron.memory._record_memory_history(enabled="yes")
    torch.neuron.memory._record_memory_history(True)     # the boolean form torch.cuda also takes
    assert runtime_memory.history is not None
    torch.neuron.memory._record_memory_history(False)
    assert runtime_memory.history is None


OOM_SCRIPT = r"""
import pickle, sys, torch, torchneuron
torch.neuron.memory._record_memory_history()
keep = torch.ones(256, device="neuron")
total = torch.neuron.get_device_properties().total_memory
try:
    torch.empty(total, device="neuron")
except torch.OutOfMemoryError:
    pass
else:
    sys.exit("no OOM")
assert torch.neuron.memory.memory_stats()["num_ooms"] == 1
snap = pickle.load(open(sys.argv[1], "rb"))
ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
assert ooms and ooms[0]["size"] == total * 4, ooms
assert any(s["address"] == keep.untyped_storage().data_ptr() for s in snap["segments"])
print("ok")
"""


def test_oom_writes_snapshot_when_configured(tmp_path):
    path = tmp_path / "oom.pickle"
    src = os.path.dirname(os.path.dirname(os.path.abspath(torchneuron.__file__)))
    env = dict(os.environ, TORCHNEURON_OOM_SNAPSHOT=str(path),
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", OOM_SCRIPT, str(path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    assert torchneuron.config.oom_snapshot == ""


# torch.cuda.memory_stats()'s documented core statistics, each "<metric>.{all,large_pool,small_pool}.
# {current,peak,allocated,freed}" (PyTorch's docs: "allocated." names the count whose key is
# "allocation."; requested_bytes is documented with torch.xpu / torch.accelerator's memory_stats).
_CORE = ("allocation", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
         "inactive_split", "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "large_pool", "small_pool")
_FIELDS = ("current", "peak", "allocated", "freed")


def test_memory_stats_pools_split_by_size_and_add_up():
    mem = torch.neuron.memory
    expected = {f"{m}.{p}.{f}" for m in _CORE for p in _POOLS for f in _FIELDS}
    stats = mem.memory_stats()
    assert {k for k in stats if k.split(".")[1:2] and k.split(".")[1] in _POOLS} == expected
    mem.reset_accumulated_memory_stats()
    mem.reset_peak_memory_stats()
    before = mem.memory_stats()
    small = torch.empty(1000, device="neuron")              # 4000 bytes: small pool
    edge = torch.empty(1 << 18, device="neuron")             # exactly 1 MiB: still small
    large = torch.empty(300_000, device="neuron")            # 1.2 MB: large pool
    large2 = torch.empty(2, 300_000, device="neuron")        # 2.4 MB: large pool
    del small, large2
    stats = mem.memory_stats()
    for m in _CORE:
        for f in _FIELDS:
            if f != "peak":
                assert stats[f"{m}.small_pool.{f}"] + stats[f"{m}.large_pool.{f}"] == stats[f"{m}.all.{f}"], (m, f)
    assert stats["allocated_bytes.small_pool.allocated"] == 4000 + (1 << 20)
    assert stats["allocated_bytes.small_pool.freed"] == 4000
    assert stats["allocated_bytes.large_pool.allocated"] == 1_200_000 + 2_400_000
    assert stats["allocated_bytes.large_pool.freed"] == 2_400_000
    assert stats["allocation.large_pool.allocated"] == 2 and stats["allocation.large_pool.freed"] == 1
    assert stats["segment.small_pool.current"] - before["segment.small_pool.current"] == 1
    assert (stats["allocated_bytes.large_pool.current"] - before["allocated_bytes.large_pool.current"]
            == 1_200_000 == large.untyped_storage().nbytes())
    assert stats["allocated_bytes.large_pool.peak"] - before["allocated_bytes.large_pool.current"] == 3_600_000
    assert stats["allocated_bytes.small_pool.peak"] - before["allocated_bytes.small_pool.current"] == 4000 + (1 << 20)
    summary = mem.memory_summary()
    assert "from large pool" in summary and "from small pool" in summary
    assert "from large pool" not in mem.memory_summary(abbreviated=True)
    del edge, large


# What the CUDA PJRT client's BFC allocator reports (key names of xla::PjRtDevice::GetAllocatorStats).
_GPU_STATS = {"bytes_in_use": 3 << 20, "peak_bytes_in_use": 5 << 20, "bytes_limit": 64 << 30,
              "pool_bytes": 48 << 30, "peak_pool_bytes": 48 << 30, "num_allocs": 12,
              "largest_alloc_size": 1 << 20}


def test_reserved_memory_and_free_memory_come_from_pjrt_where_the_platform_has_them(monkeypatch):
    mem = torch.neuron.memory
    assert runtime_memory.pjrt.memory_stats(0) == {}    # the CPU client keeps none
    x = torch.ones(1000, device="neuron")
    assert mem.memory_reserved() == mem.memory_allocated() >= x.nbytes
    monkeypatch.setattr(runtime_memory.pjrt, "memory_stats", lambda index: dict(_GPU_STATS))
    assert mem.memory_reserved() == 48 << 30
    assert mem.max_memory_reserved() == 48 << 30
    assert mem.memory_allocated() < 48 << 30             # still what live tensors hold
    stats = mem.memory_stats()
    assert stats["reserved_bytes.all.current"] == 48 << 30
    assert stats["pjrt.bytes_in_use"] == 3 << 20 and stats["pjrt.num_allocs"] == 12
    assert mem.mem_get_info() == ((64 << 30) - (3 << 20), 64 << 30)


def test_the_device_running_out_of_memory_in_a_call_is_torch_out_of_memory_error(monkeypatch):
    """PJRT's allocator failing inside an executable (RESOURCE_EXHAUSTED, as the GPU client reports
    it) reaches the user as torch.OutOfMemoryError, counted in num_ooms, for eager ops and graphs."""
    import jax

    from torchneuron.eager import kernel

    def exhausted(*args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40000 bytes.")

    x = torch.arange(10_000.0, device="neuron")
    (x * 3).cpu()                                        # compiles the op's executable
    [exe] = [e for k, e in kernel._cache.items()
             if k[0].short_name == "mul.Tensor" and k[3] == ((10_000, torch.float32),) and e.call is not None]
    monkeypatch.setattr(exe, "call", exhausted)
    monkeypatch.setattr(runtime_memory.pjrt, "memory_stats", lambda index: dict(_GPU_STATS))
    ooms = torch.neuron.memory.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError, match=r"neuron:0.*Out of memory while trying to allocate 40000"
                       r".*TORCHNEURON_GPU_MEMORY_FRACTION") as info:
        x * 3
    assert "0.00 GiB in use of 64.00 GiB" in str(info.value)
    assert torch.neuron.memory.memory_stats()["num_ooms"] == ooms + 1
    monkeypatch.setattr(exe, "call", lambda *a: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL: other")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: other"):   # any other error unchanged
        x * 3
