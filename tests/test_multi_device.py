"""Several neuron devices in one process (the CPU client with forced devices, as a multi-GPU or
multi-core Trainium host has): graphs and eager ops on neuron:1 and neuron:0, compiled in one
process and loaded warm from the persistent cache in the next, equal to CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_RUN = textwrap.dedent("""
    import json, torch, torchneuron

    def f(x, w):
        return torch.relu(x @ w).sum(0) * 2

    cf = torch.compile(f, backend="neuron")
    x_cpu, w_cpu = torch.arange(12.0).reshape(3, 4) - 5, torch.linspace(-1, 1, 8).reshape(4, 2)
    out = {"cpu": f(x_cpu, w_cpu).tolist()}
    for dev in ("neuron:1", "neuron:0"):
        x, w = x_cpu.to(dev), w_cpu.to(dev)
        y = cf(x, w)
        e = (x * 3 - w.sum()).exp().mean(1)          # eager ops on the same device
        assert y.device == torch.device(dev) and e.device == torch.device(dev), (y.device, e.device)
        out[dev] = y.cpu().tolist()
        out[dev + " eager"] = e.cpu().tolist()
    out["cpu eager"] = (x_cpu * 3 - w_cpu.sum()).exp().mean(1).tolist()
    m = torchneuron.metrics()
    print("RESULT" + json.dumps({"out": out, "graphs_compiled": m["graphs_compiled"],
                                 "graph_loads": m["extra"].get("graph_index_hits", 0),
                                 "eager_compiled": m["executables_compiled"] - m["graphs_compiled"],
                                 "eager_loads": m["eager_cache_loads"]}))
""")


def _run(env):
    proc = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT"):])


def _close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


def test_a_warm_cache_serves_graphs_and_eager_ops_on_every_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"))
    cold = _run(env)
    warm = _run(env)   # died with "Expected args to execute_sharded_on_local_devices to have 2 shards"
    for run in (cold, warm):
        out = run["out"]
        for dev in ("neuron:1", "neuron:0"):
            assert _close(out[dev], out["cpu"]) and _close(out[dev + " eager"], out["cpu eager"])
        assert out["neuron:1"] == out["neuron:0"]
    assert cold["graphs_compiled"] == 2 and cold["graph_loads"] == 0
    assert warm["out"] == cold["out"]
    assert warm["graphs_compiled"] == 0 and warm["graph_loads"] == 2
    assert warm["eager_compiled"] == 0 and warm["eager_loads"] == cold["eager_compiled"] > 0
