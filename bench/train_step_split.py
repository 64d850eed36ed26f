"""Where one compiled train step of bench/compile.py's GPT spends its time, side by side with CPU Inductor.

neuron: each graph of the step (forward, backward, optimizer) timed to its completion, the graphs'
fused op pairs (compile/fusions.py), and the minor page faults per step. CPU Inductor: the same
step's matmuls, attention and generated kernels from ``torch.profiler``, and its page faults.
Both in this one process, torch threads 2 and XLA's pool at its setting, subnormals flushed.

    .venv/bin/python bench/train_step_split.py [bench/compile.py's model options]
"""

from __future__ import annotations

import collections
import os
import resource
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile as bench  # noqa: E402 - the model and step of bench/compile.py

from torchneuron.compile import graph  # noqa: E402
from torchneuron.runtime import host_memory, memory  # noqa: E402

STEPS = 6


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def neuron_split(args):
    model, opt, idx, tgt = bench.make(args, "neuron")
    step = torch.compile(bench.train_step_fn(model, opt), backend="neuron")
    times, programs = collections.defaultdict(list), {}
    plain_call = graph.GraphProgram.__call__

    def timed(self, *a):
        programs[self.name] = self
        start = time.perf_counter()
        out = plain_call(self, *a)
        for o in out:   # to completion: execution is asynchronous
            if isinstance(o, torch.Tensor) and o.device.type == "neuron":
                memory.record_of(o).buf.block_until_ready()
        times[self.name].append(time.perf_counter() - start)
        return out

    graph.GraphProgram.__call__ = timed
    try:
        for _ in range(3):
            loss = step(idx, tgt)
        bench.sync("neuron", loss)
        times.clear()
        f0, start = faults(), time.perf_counter()
        for _ in range(STEPS):
            loss = step(idx, tgt)
        bench.sync("neuron", loss)
        total, per_step_faults = (time.perf_counter() - start) / STEPS, (faults() - f0) / STEPS
    finally:
        graph.GraphProgram.__call__ = plain_call
    print(f"neuron compiled: {total * 1000:.1f} ms a step, {per_step_faults * 4096 / 2**20:.0f} MiB of "
          f"page faults a step (freed memory retained: {host_memory.retained()})")
    for name, samples in times.items():
        fused = collections.Counter(sig.name for sig, _ in programs[name].fusions.steps.values())
        print(f"  {name:16s} {statistics.median(samples) * 1000:7.1f} ms   fused: {dict(fused) or '-'}")


def inductor_split(args):
    model, opt, idx, tgt = bench.make(args, "cpu")
    step = torch.compile(bench.train_step_fn(model, opt), backend="inductor")
    for _ in range(3):
        step(idx, tgt)
    f0, start = faults(), time.perf_counter()
    for _ in range(STEPS):
        step(idx, tgt)
    total, per_step_faults = (time.perf_counter() - start) / STEPS, (faults() - f0) / STEPS
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step(idx, tgt)
    groups = collections.defaultdict(float)
    for e in prof.key_averages():
        key = ("matmuls (mm, addmm, bmm)" if e.key in ("aten::mm", "aten::addmm", "aten::bmm")
               else "attention (flash, forward and backward)" if "flash_attention" in e.key
               else "generated kernels (CompiledFxGraph, self)" if "CompiledFxGraph" in e.key else None)
        if key is not None:
            groups[key] += e.self_cpu_time_total / 1000 / STEPS
    print(f"CPU Inductor: {total * 1000:.1f} ms a step, {per_step_faults * 4096 / 2**20:.0f} MiB of page faults a step")
    for key, ms in groups.items():
        print(f"  {key:42s} {ms:7.1f} ms")


def main():
    args = bench.parse(sys.argv[1:])
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    neuron_split(args)
    inductor_split(args)


if __name__ == "__main__":
    main()
