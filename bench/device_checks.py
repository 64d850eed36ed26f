"""What PyTorch's value-dependent checks cost on neuron: index bounds (x[idx], gather,
index_select, embedding, index_put_, scatter_) and integer division by zero, timed with
``config.device_checks`` = "off", "deferred" (the default) and "sync", side by side in one run.

Each row is the best over repeats of N back-to-back eager calls followed by one synchronisation
(what a training step does), so "deferred" includes reading the outcomes at that sync. The modes
take turns within each repeat (a noisy machine then slows all of them alike); switching the mode
clears the executable caches, so every turn starts with one untimed warm-up call. A second table
times a torch.compile graph (embedding + gather + floor division) the same way.

    .venv/bin/python bench/device_checks.py [--calls 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import torchneuron

MODES = ("off", "deferred", "sync")


def cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=g)
    idx = torch.randint(0, 1024, (512,), generator=g)
    gidx = torch.randint(0, 256, (1024, 64), generator=g)
    table = torch.randn(32000, 256, generator=g)
    tokens = torch.randint(0, 32000, (8, 512), generator=g)
    a = torch.randint(-1000, 1000, (1024, 1024), generator=g)
    b = torch.randint(1, 100, (1024, 1024), generator=g)
    vals = torch.randn(512, 256, generator=g)
    src = torch.randn(1024, 64, generator=g)
    small, small_idx = torch.randn(16, 16, generator=g), torch.randint(0, 16, (16, 2), generator=g)
    return [
        # Tiny: what a checked op adds per call (outcome bookkeeping, call site), not per element.
        ("gather 16x16 dim1 [16x2] (tiny)", lambda x, i: x.gather(1, i), (small, small_idx)),
        ("x[idx] 1024x256[512]", lambda x, i: x[i], (x, idx)),
        ("gather 1024x256 dim1 [1024x64]", lambda x, i: x.gather(1, i), (x, gidx)),
        ("index_select 1024x256 [512]", lambda x, i: x.index_select(0, i), (x, idx)),
        ("embedding 32000x256 [8x512]", lambda w, t: torch.nn.functional.embedding(t, w), (table, tokens)),
        ("index_put_ 1024x256 [512]", lambda x, i, v: x.index_put_((i,), v), (x.clone(), idx, vals)),
        ("scatter_ 1024x256 dim1", lambda x, i, s: x.scatter_(1, i, s), (x.clone(), gidx, src)),
        ("int64 // 1024x1024", lambda a, b: a // b, (a, b)),
        ("int64 % 1024x1024", lambda a, b: a % b, (a, b)),
    ]


def _turns(make, modes, calls, repeats):
    """Best µs per call of ``make()``'s function in each mode, the modes taking turns."""
    best = {m: float("inf") for m in modes}
    for _ in range(repeats):
        for mode in modes:
            torchneuron.config.device_checks = mode   # clears the executable caches
            fn = make()
            fn()                                      # compile (untimed)
            torch.neuron.synchronize()
            start = time.perf_counter()
            # Results are kept: synchronize() waits for the buffers of live tensors.
            results = [fn() for _ in range(calls)]
            torch.neuron.synchronize()
            best[mode] = min(best[mode], (time.perf_counter() - start) / calls * 1e6)
            del results
    torchneuron.config.device_checks = "deferred"
    return best


def _eager_call(fn, args):
    def make():
        return lambda: fn(*args)
    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'eager op':32s}" + "".join(f"{m + ' µs':>13s}" for m in MODES)
          + f"{'deferred/off':>14s}{'sync/off':>10s}")
    for name, fn, inputs in cases():
        times = _turns(_eager_call(fn, [t.to("neuron") for t in inputs]), MODES, args.calls, args.repeats)
        print(f"{name:32s}" + "".join(f"{times[m]:13.1f}" for m in MODES)
              + f"{times['deferred'] / times['off']:14.2f}{times['sync'] / times['off']:10.2f}")

    def step(w, t, x, i, a, b):
        return torch.nn.functional.embedding(t, w).sum() + x.gather(1, i).sum() + (a // b).sum()

    g = torch.Generator().manual_seed(1)
    inputs = [t.to("neuron") for t in (
        torch.randn(32000, 256, generator=g), torch.randint(0, 32000, (8, 512), generator=g),
        torch.randn(1024, 256, generator=g), torch.randint(0, 256, (1024, 64), generator=g),
        torch.randint(-1000, 1000, (512, 512), generator=g), torch.randint(1, 100, (512, 512), generator=g))]

    def compiled():
        torch._dynamo.reset()
        graph = torch.compile(step, backend="neuron")
        return lambda: graph(*inputs)

    modes = MODES[:2]
    times = _turns(compiled, modes, max(args.calls // 4, 1), args.repeats)
    print(f"\n{'torch.compile graph':32s}" + "".join(f"{m + ' µs':>13s}" for m in modes)
          + f"{'deferred/off':>14s}")
    print(f"{'embedding+gather+int //':32s}" + "".join(f"{times[m]:13.1f}" for m in modes)
          + f"{times['deferred'] / times['off']:14.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
