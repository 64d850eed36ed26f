"""Adaptive eager vs plain eager vs CPU eager, measured side by side.

Loops (each a training step: zero_grad, forward, cross-entropy, backward, AdamW):

- ``mlp``: a small-op-heavy MLP that reads ``loss.item()`` every step,
- ``mlp-read10``: the same MLP reading the loss every 10th step (how most scripts log),
- ``mlp-noread``: the same MLP reading nothing until the end,
- ``gpt``: the GPT-style model from bench/compile.py, reading the loss every step.

Two measurements per loop and configuration:

- steady state: seconds per step, median of ``--repeats`` blocks of ``--steps`` steps, after a
  warm-up that compiles everything (for adaptive, also its background region compiles, with the
  compile budget lifted for the warm-up); the three
  configurations run in one process, block by block interleaved, and each ratio is the median of
  the ratios of blocks that ran back to back (robust to the load changing between rounds); wall
  time, and the process's CPU time (all threads) on a second line, which a loaded machine inflates
  far less;
- first steps: the first ``--first`` steps of a fresh process (compiles included, default
  settings), each configuration in its own child process, ``--first-repeats`` times interleaved,
  median; wall time, and the process's CPU time (all threads, background compiles included) on a
  second line.

    .venv/bin/python bench/adaptive.py [--steps 10] [--repeats 15] [--first 20] [--first-repeats 1]
        [--loops mlp,mlp-read10,mlp-noread,gpt] [--gpt-layers 2] [--skip-first] [--breakdown] [--recording]
        [--configs cpu,plain,adaptive[,adaptive-sync]] [--cpu-threads N]

On a loaded machine, CPU eager's OpenMP threads spin while they wait and lose most of their time
(a 2 ms step took 100-200 ms at load average 10): measure with OMP_WAIT_POLICY=PASSIVE there, or
with --cpu-threads 1, and say which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from torchneuron.eager import adaptive
from torchneuron.runtime import pjrt

sys.path.insert(0, os.path.dirname(__file__))
from compile import GPT  # noqa: E402  (the shared GPT-style model)

CONFIGS = ("cpu", "plain", "adaptive", "adaptive-sync")   # adaptive-sync: config.adaptive_overlap off


def mlp_workload(device, read_every):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)

    def step(i):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if read_every and i % read_every == 0:
            loss.item()   # a host read, as in a loop that logs the loss
        return loss

    return step


def gpt_workload(device, layers):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(vocab=512, d=128, heads=4, layers=layers, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 512, (4, 64), generator=g).to(device)
    tgt = torch.randint(0, 512, (4, 64), generator=g).to(device)

    def step(i):
        opt.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))
        loss.backward()
        opt.step()
        loss.item()
        return loss

    return step


def make_loop(name, device, args):
    if name == "gpt":
        return gpt_workload(device, args.gpt_layers)
    read_every = {"mlp": 1, "mlp-read10": 10, "mlp-noread": 0}[name]
    return mlp_workload(device, read_every)


def run_steps(step, start, count):
    """``count`` steps, then read the last loss: pending work is part of the time."""
    loss = None
    for i in range(start, start + count):
        loss = step(i)
    loss.item()


class Config:
    def __init__(self, name, loop, args):
        self.name = name
        self.mode = "plain" if name == "cpu" else "adaptive" if name.startswith("adaptive") else name
        self.overlap = name != "adaptive-sync"
        with torchneuron.eager_mode(self.mode):
            self.step = make_loop(loop, "cpu" if name == "cpu" else "neuron", args)
        self.done = 0
        self.samples = []
        self.cpu_samples = []     # process CPU time (all threads) per step

    def run(self, count, record):
        torchneuron.config.adaptive_overlap = self.overlap
        with torchneuron.eager_mode(self.mode):
            time.sleep(0.2)   # let the previous configuration's worker threads go idle
            start, cpu_start = time.perf_counter(), time.process_time()
            run_steps(self.step, self.done, count)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        self.done += count
        if record:
            self.samples.append(elapsed / count)
            self.cpu_samples.append(cpu / count)


def steady(loop, args):
    configs = [Config(name, loop, args) for name in args.configs]
    # Steady state is after every region compiled: lift the compile budget for the warm-up.
    budget = torchneuron.config.adaptive_compile_budget
    torchneuron.config.adaptive_compile_budget = 1.0
    for c in configs:
        c.run(5, False)
        if c.mode == "adaptive":
            adaptive.wait_for_compiles()
            c.run(5, False)
    torchneuron.config.adaptive_compile_budget = budget
    torchneuron.metrics.reset()
    for _ in range(args.repeats):
        for c in configs:
            c.run(args.steps, True)
    m = torchneuron.metrics()
    return _summary(configs, "samples"), _summary(configs, "cpu_samples"), m


def _summary(configs, field):
    times = {c.name: statistics.median(getattr(c, field)) for c in configs}
    # Ratios from the blocks that ran back to back: a load change between rounds cancels out.
    by_name = {c.name: getattr(c, field) for c in configs}
    for fast in ("adaptive", "adaptive-sync"):
        if fast in by_name:
            for name in ("plain", "cpu"):
                if name in by_name:
                    times[f"{name}/{fast}"] = statistics.median(
                        a / b for a, b in zip(by_name[name], by_name[fast]))
    return times


def breakdown(loop, args):
    """Where an adaptive step's time goes: each region's fused executable timed alone (inputs
    ready, waiting for its results), next to the whole step and to CPU eager's step."""
    import jax

    budget = torchneuron.config.adaptive_compile_budget
    torchneuron.config.adaptive_compile_budget = 1.0
    c = Config("adaptive-sync", loop, args)   # the default: config.adaptive_overlap off
    c.run(5, False)
    adaptive.wait_for_compiles()
    c.run(5, False)
    torchneuron.config.adaptive_compile_budget = budget
    captured = []
    run = adaptive.run.run_region

    def capture(plan, external, runtime, outcomes):
        captured.append((plan, list(external), list(runtime)))
        return run(plan, external, runtime, outcomes)

    adaptive.run.run_region = capture
    overlap = torchneuron.config.adaptive_overlap
    torchneuron.config.adaptive_overlap = False   # every region through run_region, at its cut
    try:
        c.run(1, False)
    finally:
        adaptive.run.run_region = run
        torchneuron.config.adaptive_overlap = overlap
    rows = []
    for plan, external, runtime in captured:
        seg = plan.direct
        if seg is None or seg.fn is None:
            rows.append((len(plan.ops), None))
            continue
        jax.block_until_ready(external)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(seg.fn(*external, *runtime))
            times.append(time.perf_counter() - start)
        rows.append((len(plan.ops), min(times)))
    cpu, plain = Config("cpu", loop, args), Config("plain", loop, args)
    cpu.run(5, False)
    plain.run(5, False)
    # The same adaptive step with every fused run answered by the results of its first run (timing
    # only, the values go stale): what the step costs without executing its regions, i.e. the
    # recording, PyTorch's own Python and autograd engine, and the cuts.
    skipped = Config("adaptive-sync", loop, args)
    memo = {}

    def no_execution(plan, external, runtime, outcomes):
        if id(plan) not in memo:
            memo[id(plan)] = (plan, run(plan, external, runtime, outcomes))
        return memo[id(plan)][1]

    skipped.run(5, False)
    for _ in range(5):
        cpu.run(args.steps, True)
        plain.run(args.steps, True)
        c.run(args.steps, True)
        adaptive.run.run_region = no_execution
        try:
            skipped.run(args.steps, True)
        finally:
            adaptive.run.run_region = run
    parts = ", ".join(f"{n} ops {t * 1e3:.2f} ms" if t is not None else f"{n} ops (not fused)" for n, t in rows)
    total = sum(t for _, t in rows if t is not None)
    step, without = statistics.median(c.samples), statistics.median(skipped.samples)
    plain_step = statistics.median(plain.samples)
    print(f"{loop:11} where   fused regions alone (min of 20): {parts}; together {total * 1e3:.2f} ms | "
          f"adaptive step {step * 1e3:.2f} ms, cpu eager step {statistics.median(cpu.samples) * 1e3:.2f} ms "
          f"(medians of 5 blocks)", flush=True)
    print(f"{loop:11} where   adaptive step without executing its regions {without * 1e3:.2f} ms, so the "
          f"regions' runs cost {(step - without) * 1e3:.2f} ms in the step; plain step {plain_step * 1e3:.2f} ms: "
          f"{plain_step / step:.2f}x now, {plain_step / without:.2f}x if the runs were free", flush=True)


def recording_cost(args):
    """Per-op cost on the calling thread (thread CPU time, the recording only: the flush is not
    timed): plain eager's dispatch vs adaptive eager recording a region it replays."""
    budget = torchneuron.config.adaptive_compile_budget
    torchneuron.config.adaptive_compile_budget = 1.0
    x, y = torch.randn(64, 64).to("neuron"), torch.randn(64, 64).to("neuron")
    params = [torch.randn(64, 64).to("neuron") for _ in range(26)]
    grads = [torch.randn(64, 64).to("neuron") for _ in range(26)]

    def small():
        ((x + y) * 0.5).relu().sum()

    def foreach():   # one optimizer-like step over 26 tensors: two in-place ops, one new list
        torch._foreach_mul_(params, 0.99)
        torch._foreach_add_(params, grads, alpha=-0.01)
        torch._foreach_sqrt(grads)

    def per_op(mode, fn, n_ops):
        with torchneuron.eager_mode(mode):
            for _ in range(5):
                fn()
                torch.neuron.synchronize()
            adaptive.wait_for_compiles()
            samples = []
            for _ in range(200):
                start = time.thread_time()
                fn()
                samples.append(time.thread_time() - start)
                torch.neuron.synchronize()
        return statistics.median(samples) / n_ops * 1e6

    for name, fn, n_ops in (("4 small ops (64x64)", small, 4), ("3 _foreach_* ops over 26 tensors", foreach, 3)):
        plain, recorded = per_op("plain", fn, n_ops), per_op("adaptive", fn, n_ops)
        print(f"recording  {name:34} plain {plain:7.1f} us/op  adaptive {recorded:7.1f} us/op "
              f"({recorded / plain:.0%} of plain, thread CPU time)", flush=True)
    torchneuron.config.adaptive_compile_budget = budget


def first_steps_child(loop, config, args):
    c = Config(config, loop, args)
    torchneuron.config.adaptive_overlap = c.overlap
    with torchneuron.eager_mode(c.mode):   # the steps alone (Config.run would add its pause)
        start, cpu_start = time.perf_counter(), time.process_time()
        run_steps(c.step, 0, args.first)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    m = torchneuron.metrics()
    print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu, "region_compiles": m["region_compiles"],
                      "fused_runs": m["region_cache_hits"]}))


def first_steps(loop, args):
    results = {name: [] for name in args.configs}
    cpu = {name: [] for name in args.configs}
    extra = {}
    for _ in range(args.first_repeats):
        for name in args.configs:
            cmd = [sys.executable, __file__, "--child", loop, name, "--first", str(args.first),
                   "--gpt-layers", str(args.gpt_layers), "--cpu-threads", str(args.cpu_threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            data = json.loads(out.strip().splitlines()[-1])
            results[name].append(data["seconds"])
            cpu[name].append(data["cpu_seconds"])
            extra[name] = data
    median = statistics.median
    return ({name: median(v) for name, v in results.items()}, {name: median(v) for name, v in cpu.items()},
            extra)


def _times(t, scale, unit):
    return "  ".join(f"{name} {t[name] * scale:8.2f} {unit}" for name in CONFIGS if name in t)


def _ratios(t):
    parts = []
    for fast, label in (("adaptive", ""), ("adaptive-sync", "sync ")):
        if fast in t:
            parts += [f"{label}vs {name} {t.get(f'{name}/{fast}', t[name] / t[fast]):5.2f}x"
                      for name in ("plain", "cpu") if name in t]
    return "  ".join(parts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--first", type=int, default=20)
    parser.add_argument("--first-repeats", type=int, default=1)
    parser.add_argument("--loops", default="mlp,mlp-read10,mlp-noread,gpt")
    parser.add_argument("--gpt-layers", type=int, default=2)
    parser.add_argument("--skip-first", action="store_true")
    parser.add_argument("--recording", action="store_true",
                        help="also measure the per-op recording cost against plain dispatch")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each fused region alone against the whole step")
    parser.add_argument("--configs", default="cpu,plain,adaptive", help="a subset of " + ",".join(CONFIGS))
    parser.add_argument("--cpu-threads", type=int, default=0,
                        help="torch.set_num_threads for CPU eager (default: PyTorch's own choice)")
    parser.add_argument("--child", nargs=2, metavar=("LOOP", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.child:
        first_steps_child(*args.child, args)
        return
    print(f"load average at start: {os.getloadavg()[0]:.1f}; CPU eager threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, XLA CPU pool threads "
          f"{pjrt.describe_intra_op_pool()}")
    print("ratios are speed-ups of adaptive (higher is better)")
    if args.recording:
        recording_cost(args)
    for loop in args.loops.split(","):
        t, cpu, m = steady(loop, args)
        ops = m["region_ops"] / max(m["regions_flushed"], 1)
        print(f"{loop:11} steady  {_times(t, 1e3, 'ms')} | {_ratios(t)} | {ops:.0f} ops/region, "
              f"{m['region_cache_hits']} fused / {sum(m['region_unfused'].values())} op-by-op segment runs, "
              f"{m['region_replayed_ops'] / max(m['region_ops'], 1):.0%} ops replayed", flush=True)
        print(f"{loop:11} cpu     {_times(cpu, 1e3, 'ms')} | {_ratios(cpu)} | process CPU time per step, all "
              f"threads", flush=True)
        if args.breakdown:
            breakdown(loop, args)
        if not args.skip_first:
            f, cpu, extra = first_steps(loop, args)
            a = extra.get("adaptive", {})
            print(f"{loop:11} first {args.first:2d} {_times(f, 1, 's ')} | {_ratios(f)} | adaptive: "
                  f"{a.get('region_compiles')} regions compiled in time, {a.get('fused_runs')} fused runs",
                  flush=True)
            print(f"{loop:11} cpu   {args.first:2d} {_times(cpu, 1, 's ')} | {_ratios(cpu)} | process CPU time, "
                  f"all threads (less sensitive to the load than wall time)", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
