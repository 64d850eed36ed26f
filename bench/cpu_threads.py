"""Sizes of XLA's CPU intra-op pool (``config.cpu_intra_op_threads``), measured side by side.

XLA reads the size when its CPU client starts, so each size runs in a fresh process; the sizes take
turns, round after round, and each ratio is the median of the ratios of processes that ran back to
back (a load change between rounds cancels out). Every process times, after a warm-up:

- ``compiled-train``/``compiled-fwd``: the torch.compile(backend="neuron") train step (forward,
  backward, AdamW in one graph) and forward of the GPT of bench/compile.py at its defaults (the tied
  LM head is a 1024x256 by 256x8192 matmul, the largest in the step);
- ``plain-mlp``/``plain-gpt``: plain eager train steps of bench/adaptive.py's ``mlp`` and ``gpt``
  loops (a loss read every step);
- ``adaptive-mlp``/``adaptive-gpt``: the same loops in adaptive eager, after their regions compiled.

Wall time per step, and the process's CPU time per step (all threads) on a second line.

    .venv/bin/python bench/cpu_threads.py [--threads 2,1] [--rounds 4] [--blocks 3]
        [--workloads compiled-train,compiled-fwd,plain-mlp,plain-gpt,adaptive-mlp,adaptive-gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("compiled-train", "compiled-fwd", "plain-mlp", "plain-gpt", "adaptive-mlp", "adaptive-gpt")
# Steps per timed block: about half a second each on 2 cores.
STEPS = {"compiled-train": 2, "compiled-fwd": 5, "plain-mlp": 50, "plain-gpt": 10, "adaptive-mlp": 100,
         "adaptive-gpt": 20}


def _workload(name):
    """A function running one step of workload ``name`` and waiting for its result."""
    import torch

    import torchneuron

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import adaptive as loops
    import compile as gpt_bench

    kind, _, loop = name.partition("-")
    if kind == "compiled":
        args = gpt_bench.parse([])
        model, opt, idx, tgt = gpt_bench.make(args, "neuron")
        if loop == "train":
            step = torch.compile(gpt_bench.train_step_fn(model, opt), backend="neuron")
            return lambda i: step(idx, tgt).item()
        fwd = torch.compile(model, backend="neuron")

        def forward(i):
            with torch.no_grad():
                out = fwd(idx)
            gpt_bench.sync("neuron", out)
        return forward
    with torchneuron.eager_mode(kind):
        step = loops.make_loop(loop, "neuron", argparse.Namespace(gpt_layers=2))

    def eager(i):   # the loops read the loss every step
        with torchneuron.eager_mode(kind):
            step(i)
    return eager


def child(names, blocks):
    import torchneuron
    from torchneuron.eager import adaptive
    from torchneuron.runtime import pjrt

    torchneuron.config.adaptive_compile_budget = 1.0   # steady state: every region compiled
    out = {"pool": pjrt.describe_intra_op_pool()}
    for name in names:
        step = _workload(name)
        for i in range(3):
            step(i)
        adaptive.wait_for_compiles()
        for i in range(3):
            step(i)
        walls, cpus = [], []
        for _ in range(blocks):
            time.sleep(0.2)   # the previous workload's pool threads go idle
            start, cpu_start = time.perf_counter(), time.process_time()
            for i in range(STEPS[name]):
                step(i)
            walls.append((time.perf_counter() - start) / STEPS[name])
            cpus.append((time.process_time() - cpu_start) / STEPS[name])
        out[name] = (statistics.median(walls), statistics.median(cpus))
    print("RESULT" + json.dumps(out), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2,1", help="pool sizes (or auto), compared to the first")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.workloads.split(",")
    if args.child:
        child(names, args.blocks)
        return
    sizes = args.threads.split(",")
    print(f"cores {len(os.sched_getaffinity(0))}; load average at start {os.getloadavg()[0]:.2f}; pool sizes "
          f"{', '.join(sizes)}, each in its own process, {args.rounds} interleaved rounds", flush=True)
    runs = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory(prefix="tn-threads-cache-") as cache_dir:
        env = {k: v for k, v in os.environ.items() if k != "NPROC"}
        env["TORCHNEURON_CACHE_DIR"] = cache_dir   # shared: only the first process compiles the GPT graphs
        for _ in range(args.rounds):
            for size in sizes:
                env["TORCHNEURON_CPU_INTRA_OP_THREADS"] = size
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--blocks", str(args.blocks),
                       "--workloads", args.workloads]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
                if line is None:
                    raise RuntimeError(f"pool size {size} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                runs[size].append(json.loads(line[len("RESULT"):]))
            print(f"  round done, load average {os.getloadavg()[0]:.2f}", flush=True)
    base = sizes[0]
    print("pools: " + ", ".join(f"{size} -> {runs[size][0]['pool']}" for size in sizes))
    print(f"{'':15}" + "".join(f"{'pool ' + size:>14}" for size in sizes)
          + "".join(f"{base + ' / ' + size:>12}" for size in sizes[1:]) + f"   (ms per step; ratios: time with pool {base} / time with the other, above 1: the other is faster)")
    for name in names:
        for field in (0, 1):   # wall time, CPU time
            row = f"{name:15}" if field == 0 else f"{'  cpu time':15}"
            row += "".join(f"{statistics.median(r[name][field] for r in runs[size]) * 1e3:14.2f}" for size in sizes)
            row += "".join(f"{statistics.median(a[name][field] / b[name][field] for a, b in zip(runs[base], runs[size])):11.2f}x"
                           for size in sizes[1:])
            print(row)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
