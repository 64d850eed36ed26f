"""Where one warm request's time goes: ``torch.compile(backend="neuron", dynamic=True)`` with
``config.shapes="bucketed"`` against CPU Inductor (``dynamic=True``) and CPU eager, in one process.

The model and request are those of ``bench/shapes.py`` (a 2-layer GPT, batch 2, the prompt uploaded,
the last position's logits summed and read back). For each length the three requests run
interleaved, 200 times each after warm-up, so the machine's drift (this shared VM's speed moves by
1.5x within an hour) hits all three alike. Printed per length: each request's P50 / P99, the neuron
executable's own time (timed around the compiled call with ``block_until_ready``: it runs inline on
XLA:CPU), and the rest of the neuron request, the host's part (upload, Dynamo's guards,
AOTAutograd's wrapper, the inputs' specs, output wrapping, the slice, sum and ``.item()``).

    .venv/bin/python bench/shapes_request.py [--lengths 21,45,100] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
import torch

import torchneuron
from torchneuron.compile import executables

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_shapes_bucketed import TinyGPT  # noqa: E402  (the model bench/shapes.py serves)

_exe_seconds: list = []


def _timed_compile(compile_traced):
    """``executables.compile_traced`` whose executables record their own run time: the only place
    the bare executable is in reach (the program wraps it in its host work)."""
    def compile_and_time(fn, bufs, runtime, *args, **kwargs):
        lowered, compiled, hits = compile_traced(fn, bufs, runtime, *args, **kwargs)

        def call(*a):
            start = time.perf_counter()
            out = compiled(*a)
            jax.block_until_ready(out)
            _exe_seconds.append(time.perf_counter() - start)
            return out
        return lowered, call, hits
    return compile_and_time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="21,45,100")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    executables.compile_traced = _timed_compile(executables.compile_traced)
    torchneuron.config.shapes = "bucketed"
    torch._dynamo.config.cache_size_limit = 1024
    torch.manual_seed(0)
    cpu_model = TinyGPT(vocab=256, d=64, heads=4, layers=2).eval()
    model = TinyGPT(vocab=256, d=64, heads=4, layers=2).eval()
    model.load_state_dict(cpu_model.state_dict())
    model = model.to("neuron")
    neuron_compiled = torch.compile(model, backend="neuron", dynamic=True)
    inductor = torch.compile(cpu_model, dynamic=True)

    def request(fn, device):
        def run(t):
            with torch.no_grad():
                return fn(torch.randint(0, 256, (2, t)).to(device))[:, -1].sum().item()
        return run

    modes = {"neuron compiled": request(neuron_compiled, "neuron"), "CPU Inductor": request(inductor, "cpu"),
             "CPU eager": request(cpu_model, "cpu")}
    for t in [7, 45, *lengths]:   # warm-up: every bucket and Inductor's dynamic graph compiled
        for run in modes.values():
            run(t)
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()} in every mode; "
          f"{args.calls} interleaved calls per length; microseconds")
    print(f"{'length':>6} {'mode':<16} {'P50':>7} {'P99':>7}")
    for t in lengths:
        times = {k: [] for k in modes}
        exe, host = [], []
        for _ in range(args.calls):
            for name, run in modes.items():
                _exe_seconds.clear()
                start = time.perf_counter()
                run(t)
                elapsed = time.perf_counter() - start
                times[name].append(elapsed)
                if name == "neuron compiled":
                    exe.append(sum(_exe_seconds))
                    host.append(elapsed - sum(_exe_seconds))
        rows = [*times.items(), ("  its executable", exe), ("  its host part", host)]
        for name, v in rows:
            print(f"{t:>6} {name:<16} {1e6 * np.median(v):>7.0f} {1e6 * np.percentile(v, 99):>7.0f}")
        ratio = np.median(times["neuron compiled"]) / np.median(times["CPU Inductor"])
        print(f"{t:>6} neuron compiled / CPU Inductor, P50: {ratio:.2f}")


if __name__ == "__main__":
    main()
