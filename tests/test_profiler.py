"""torch.profiler integration: neuron ranges in traces, and torchneuron.profiler.summary()."""

from __future__ import annotations

import io
import json
import warnings

import pytest
import torch

import torchneuron
from torchneuron import profiler
from torchneuron.eager import kernel as kernel_mod

from conftest import cpu_only


def _untraced():
    return torchneuron.metrics.tracer is None and kernel_mod.Kernel.__call__ is kernel_mod._plain_call


def test_chrome_trace_has_neuron_ops_compiles_copies_and_fallbacks(tmp_path):
    kernel_mod.clear_cache()      # so this session compiles
    layer = torch.nn.Linear(5, 3).to("neuron")
    x = torch.randn(7, 5)
    assert _untraced()
    with torch.profiler.profile() as prof:
        y = layer(x.to("neuron"))
        y.sum().backward()          # backward ops run on the autograd engine's thread
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_only(y.detach(), 4)
        value = y.sum().item()
    assert _untraced()              # nothing stays hooked once the session ends
    assert isinstance(value, float)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    for name in ("neuron::addmm", "neuron::compile::addmm", "neuron::h2d", "neuron::d2h",
                 "neuron::fallback::torchneuron_test::cpu_only", "neuron::mm", "neuron::sum"):
        assert name in names, sorted(n for n in names if n.startswith("neuron::"))
    threads = {e["tid"] for e in events if e.get("name") == "neuron::mm"}
    addmm_threads = {e["tid"] for e in events if e.get("name") == "neuron::addmm"}
    assert threads and threads.isdisjoint(addmm_threads)   # mm ran in backward, on another thread
    # Ranges nest: the compile of addmm lies inside the addmm op.
    op = next(e for e in events if e.get("name") == "neuron::addmm")
    comp = next(e for e in events if e.get("name") == "neuron::compile::addmm")
    assert op["ts"] <= comp["ts"] and comp["ts"] + comp["dur"] <= op["ts"] + op["dur"] + 1

    rows = {(r["op"], r["path"]): r for r in profiler.stats()}
    assert rows[("addmm", "native")]["calls"] == 1 and rows[("addmm", "native")]["compiles"] == 1
    assert rows[("torchneuron_test::cpu_only", "cpu")]["calls"] == 1
    assert rows[("h2d", "copy")]["bytes"] >= 7 * 5 * 4
    assert rows[("d2h", "copy")]["calls"] >= 2   # cpu_only's input and the item()


def test_summary_table_counts_calls_and_compiles():
    kernel_mod.clear_cache()
    a = torch.randn(3, 11).to("neuron")
    b = torch.randn(3, 11).to("neuron")
    profiler.enable()
    try:
        profiler.reset()
        for _ in range(4):
            a + b
        a * b
    finally:
        profiler.disable()
    assert _untraced()
    out = io.StringIO()
    text = profiler.summary(file=out)
    assert out.getvalue().strip() == text.strip()
    header, rule, *rows = text.splitlines()
    assert header.split()[:3] == ["op", "path", "calls"]
    by_op = {line.split()[0]: line.split() for line in rows}
    assert by_op["add.Tensor"][1:3] == ["native", "4"] and by_op["add.Tensor"][5] == "1"   # 4 calls, 1 compile
    assert by_op["mul.Tensor"][1:3] == ["native", "1"]
    stats = {r["op"]: r for r in profiler.stats()}
    assert stats["add.Tensor"]["mean_us"] == pytest.approx(stats["add.Tensor"]["total_ms"] * 1e3 / 4)


def test_no_session_no_hooks_and_empty_summary():
    profiler.reset()
    (torch.ones(2).to("neuron") + 1).sum()
    assert _untraced() and profiler.stats() == []
    assert "no neuron activity" in profiler.summary(file=None)


def test_torch_compile_graphs_appear_as_ranges(tmp_path):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()).to("neuron")
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    x = torch.randn(2, 6).to("neuron")
    with torch.profiler.profile() as prof, torch.no_grad():
        compiled(x)
        compiled(x)
    assert _untraced()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}
    graphs = {n for n in names if n.startswith("neuron::graph::")}
    assert len(graphs) == 1, sorted(n for n in names if n.startswith("neuron::"))
    (graph,) = graphs
    assert "neuron::compile::" + graph.removeprefix("neuron::") in names
    assert "neuron::addmm" not in names          # the Linear ran inside the graph, not op by op
    (row,) = [r for r in profiler.stats() if r["path"] == "graph"]
    assert row["calls"] == 2 and row["compiles"] == 1
