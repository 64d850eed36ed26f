"""What PyTorch's value-dependent checks cost on neuron: index bounds (x[idx], gather,
index_select, embedding, index_put_, scatter_) and integer division by zero, timed with
``config.device_checks`` = "off", "deferred" (the default) and "sync", side by side in one run.

Each row is the median over repeats of N back-to-back eager calls followed by one synchronisation
(what a training step does), so "deferred" includes reading the outcomes at that sync. A second
table times a torch.compile graph (embedding + gather + floor division) the same way.

    .venv/bin/python bench/device_checks.py [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from eager_overhead import _median_us  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.eager import kernel  # noqa: E402

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
    return [
        ("x[idx] 1024x256[512]", lambda x, i: x[i], (x, idx)),
        ("gather 1024x256 dim1 [1024x64]", lambda x, i: x.gather(1, i), (x, gidx)),
        ("index_select 1024x256 [512]", lambda x, i: x.index_select(0, i), (x, idx)),
        ("embedding 32000x256 [8x512]", lambda w, t: torch.nn.functional.embedding(t, w), (table, tokens)),
        ("index_put_ 1024x256 [512]", lambda x, i, v: x.index_put_((i,), v), (x.clone(), idx, vals)),
        ("scatter_ 1024x256 dim1", lambda x, i, s: x.scatter_(1, i, s), (x.clone(), gidx, src)),
        ("int64 // 1024x1024", lambda a, b: a // b, (a, b)),
        ("int64 % 1024x1024", lambda a, b: a % b, (a, b)),
    ]


def _time(fn, args, calls, repeats):
    args = [t.to("neuron") for t in args]
    return _median_us(lambda: fn(*args), calls, repeats, torch.neuron.synchronize)


def _with_mode(mode):
    torchneuron.config.device_checks = mode
    kernel.clear_cache()   # executables compile their checks in (or not)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'eager op':32s}" + "".join(f"{m + ' µs':>13s}" for m in MODES)
          + f"{'deferred/off':>14s}{'sync/off':>10s}")
    for name, fn, inputs in cases():
        times = {}
        for mode in MODES:
            _with_mode(mode)
            times[mode] = _time(fn, inputs, args.calls, args.repeats)
        print(f"{name:32s}" + "".join(f"{times[m]:13.1f}" for m in MODES)
              + f"{times['deferred'] / times['off']:14.2f}{times['sync'] / times['off']:10.2f}")

    def step(w, t, x, i, a, b):
        return torch.nn.functional.embedding(t, w).sum() + x.gather(1, i).sum() + (a // b).sum()

    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(32000, 256, generator=g), torch.randint(0, 32000, (8, 512), generator=g),
              torch.randn(1024, 256, generator=g), torch.randint(0, 256, (1024, 64), generator=g),
              torch.randint(-1000, 1000, (512, 512), generator=g), torch.randint(1, 100, (512, 512), generator=g))
    print(f"\n{'torch.compile graph':32s}" + "".join(f"{m + ' µs':>13s}" for m in MODES[:2])
          + f"{'deferred/off':>14s}")
    times = {}
    for mode in MODES[:2]:
        _with_mode(mode)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="neuron")
        times[mode] = _time(compiled, inputs, args.calls // 4, args.repeats)
    print(f"{'embedding+gather+int //':32s}" + "".join(f"{times[m]:13.1f}" for m in MODES[:2])
          + f"{times['deferred'] / times['off']:14.2f}")
    _with_mode("deferred")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
