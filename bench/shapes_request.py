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

``--stream N`` times instead the warm pass over ``bench/shapes.py``'s long-tail stream of N requests,
each request run in every mode back to back (the modes interleaved request by request, in one
process), and adds a second neuron compiled function with the ladder ``--fine-buckets``: P50 / P99
per mode over the stream and their ratios, so the latency targets of docs/shapes.md are judged with
both sides on the same machine at the same moment.

    .venv/bin/python bench/shapes_request.py --stream 200 [--fine-buckets 16,24,32,...]
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
sys.path.insert(0, os.path.dirname(__file__))
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
    p.add_argument("--stream", type=int, default=0, help="time bench/shapes.py's stream of N requests")
    p.add_argument("--passes", type=int, default=3,
                   help="--stream: timed passes; each request's time is its median over the passes")
    p.add_argument("--max-len", type=int, default=128, help="at most 128: the model's positions")
    p.add_argument("--fine-buckets", default="16,24,32,48,64,96,128,192,256",
                   help="the ladder of the second neuron compiled function in --stream")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max([*lengths, args.max_len if args.stream else 0]) > 128:
        p.error("the model has 128 positions: lengths and --max-len must be at most 128")

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
    if args.stream:
        fine = torch.compile(model, backend="neuron", dynamic=True, options={"buckets": args.fine_buckets})
        modes["neuron compiled, fine ladder"] = request(fine, "neuron")
        return time_stream(modes, args)
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


def time_stream(modes, args):
    from shapes import lengths as stream_lengths  # bench/shapes.py, beside this file
    lens = stream_lengths(args.stream, args.max_len)
    for t in lens:                # warm-up: the whole stream once, every bucket compiled
        for run in modes.values():
            run(t)
    # One request's time is its median over the passes: the P99 of the stream is then its longest
    # requests', not the moment the shared VM stalled (a single pass's P99 is 3 of 300 samples).
    passes = {k: np.zeros((args.passes, len(lens))) for k in modes}
    for p in range(args.passes):
        for i, t in enumerate(lens):
            for name, run in modes.items():
                start = time.perf_counter()
                run(t)
                passes[name][p, i] = time.perf_counter() - start
    times = {k: np.median(v, axis=0) for k, v in passes.items()}
    print(f"{len(lens)} requests, {len(set(lens))} distinct lengths, median {int(np.median(lens))}, "
          f"max {max(lens)}; modes interleaved request by request; each request's median of "
          f"{args.passes} passes; load average {os.getloadavg()[0]:.2f}; torch threads "
          f"{torch.get_num_threads()} in every mode; fine ladder {args.fine_buckets}; ms")
    p50 = {k: np.median(v) for k, v in times.items()}
    p99 = {k: np.percentile(v, 99) for k, v in times.items()}
    print(f"{'mode':<30} {'P50':>7} {'P99':>7} {'P50/eager':>10} {'P99/eager':>10} {'P99/Inductor':>13}")
    for k in times:
        print(f"{k:<30} {1e3 * p50[k]:>7.2f} {1e3 * p99[k]:>7.2f} {p50[k] / p50['CPU eager']:>10.2f} "
              f"{p99[k] / p99['CPU eager']:>10.2f} {p99[k] / p99['CPU Inductor']:>13.2f}")


if __name__ == "__main__":
    main()
