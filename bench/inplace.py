"""In-place writes on large storages: neuron eager vs CPU PyTorch, side by side in one process.

Every write to a neuron storage makes its new buffer; with buffer donation (runtime/donation.py)
XLA writes it where the old one was, so a slice write costs the slice, not the storage. This
prints, per case, the median time per call over repeats of N calls (a device synchronisation
closes each repeat), CPU's time for the same loop in the same process, and the ratio; then the
growth of the process's peak resident memory over an in-place loop, measured in a fresh process.

    .venv/bin/python bench/inplace.py [--calls 20] [--repeats 5] [--mib 64]

Run it under ``PYTHONPATH=<older checkout>/src`` to measure that code the same way.
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

import torchneuron  # noqa: F401 - registers the neuron device


def _cases(n):
    """(name, setup(device) -> state, step(state, i)) of each loop."""
    return [
        ("x[i:i+16] = v  (slice copy_)", lambda d: (torch.zeros(n, device=d), torch.ones(16, device=d)),
         lambda s, i: s[0][i * 16:(i + 1) * 16].copy_(s[1])),
        ("x[i] = 2.0  (one element)", lambda d: (torch.zeros(n, device=d),),
         lambda s, i: s[0].__setitem__(i, 2.0)),
        ("x.add_(1)  (whole storage)", lambda d: (torch.zeros(n, device=d),),
         lambda s, i: s[0].add_(1)),
        ("KV cache [1, 8, 2048, 64][:, :, i] = kv", lambda d: (torch.zeros(1, 8, 2048, 64, device=d),
                                                               torch.ones(1, 8, 1, 64, device=d)),
         lambda s, i: s[0][:, :, i:i + 1].copy_(s[1])),
        ("index_copy_ of 4 rows into [n/256, 256]", lambda d: (torch.zeros(n // 256, 256, device=d),
                                                               torch.ones(4, 256, device=d)),
         lambda s, i: s[0].index_copy_(0, torch.arange(4 * i, 4 * i + 4, device=s[0].device), s[1])),
    ]


def _sync(device):
    if device == "neuron":
        torch.neuron.synchronize()


def _time(setup, step, device, calls, repeats):
    state = setup(device)
    for i in range(3):
        step(state, i)
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            step(state, i)
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


_PEAK = """
import json, sys, torch, torchneuron

def peak_kib():   # the process's peak resident memory (VmHWM); writing 5 to clear_refs resets it
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])

n = int(sys.argv[1])
x = torch.zeros(n, device="neuron")

def step(i):
    x.add_(1)
    x[i * 1000:(i + 1) * 1000] = -1.0

step(0)                                         # compiles, and first touches x's pages
torch.neuron.synchronize()
with open("/proc/self/clear_refs", "w") as f:   # the loop's peak, not the set-up's
    f.write("5")
base = peak_kib()
for i in range(1, 9):
    step(i)
torch.neuron.synchronize()
print(json.dumps(peak_kib() - base))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="size of the large float32 storages")
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, "
          f"storage {args.mib} MiB, {args.calls} calls x {args.repeats} repeats (median)")
    print(f"{'case':44s} {'neuron ms':>10s} {'CPU ms':>9s} {'neuron/CPU':>11s}")
    for name, setup, step in _cases(n):
        # Interleaved: the machine's speed drifts, a ratio is only meaningful within one round.
        neuron = _time(setup, step, "neuron", args.calls, args.repeats)
        cpu = _time(setup, step, "cpu", args.calls, args.repeats)
        print(f"{name:44s} {neuron * 1e3:10.3f} {cpu * 1e3:9.3f} {neuron / cpu:10.1f}x")
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(n)], capture_output=True, text=True,
                          env=dict(os.environ, TORCHNEURON_CACHE_DIR=""), timeout=600)
    if proc.returncode != 0:
        print("peak memory run failed:\n" + proc.stderr[-2000:])
        return 1
    grown = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"peak resident memory over 8 x (add_, slice write) on a {args.mib} MiB storage: "
          f"+{grown / 1024:.1f} MiB ({grown / (n * 4 / 1024):.0%} of the storage)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
