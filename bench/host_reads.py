"""What reading device values one element at a time costs: ``x[i].item()`` in a loop, ``all(mask)``
and ``for v in t: float(v)`` on neuron, against CPU PyTorch.

Timed side by side in one run, microseconds per element read (median of repeats):

    .venv/bin/python bench/host_reads.py [--elements 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import torchneuron  # noqa: F401


def _per_element_us(loop, x, n, repeats) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop(x)
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.elements
    print(f"load average {os.getloadavg()[0]:.1f}; {n} elements per loop; us per element read")
    print(f"{'loop':26s} {'neuron':>9s} {'CPU':>9s} {'neuron/CPU':>11s}")
    loops = {
        "x[i].item()": lambda x: [x[i].item() for i in range(n)],
        "all(x > -1)": lambda x: all(x > -1),
        "for v in x: float(v)": lambda x: [float(v) for v in x],
    }
    for name, loop in loops.items():
        cpu = torch.randn(n)
        dev = cpu.to("neuron")
        loop(dev)   # compiles the reads once
        t_neuron = _per_element_us(loop, dev, n, args.repeats)
        t_cpu = _per_element_us(loop, cpu, n, args.repeats)
        print(f"{name:26s} {t_neuron:9.1f} {t_cpu:9.1f} {t_neuron / t_cpu:11.2f}")


if __name__ == "__main__":
    main()
