"""examples/train_classifier.py in eager mode: cold vs warm start, and the steady-state epoch vs CPU.

Cold vs warm: two fresh processes share one new ``TORCHNEURON_CACHE_DIR``; the first compiles every
eager executable of the first training step and stores it, the second loads them. Each reports the
time of its first step (model on the device, forward, loss, backward, AdamW step, ``loss.item()``),
apart from the imports.

Steady state: the example's epoch (8 steps of batch 64) on neuron and on CPU PyTorch in the same
process, after a warm-up epoch, alternating, median of the repeats.

    .venv/bin/python bench/eager_train.py [--repeats 7] [--skip-cold-warm] [--skip-steady]
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

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

_FIRST_STEP = """
import json, sys, time
start = time.perf_counter()
import torch
import torch._dynamo  # what the first optimizer imports (~2 s, as on CPU): counted with the imports
import torch.nn.functional as F
import torchneuron
sys.path.insert(0, {examples!r})
sys.path.insert(0, {bench!r})
import train_classifier as tc
from eager_train import build
imported = time.perf_counter()
x, y = tc.make_data()
torch.manual_seed(0)
model, opt = build("neuron")
x, y = x.to("neuron"), y.to("neuron")
opt.zero_grad()
loss = F.cross_entropy(model(x[0:64]), y[0:64])
loss.backward()
opt.step()
value = loss.item()
done = time.perf_counter()
m = torchneuron.metrics()
print("RESULT" + json.dumps({{"imports": imported - start, "first_step": done - imported,
                             "compiled": m["executables_compiled"], "loaded": m["eager_cache_loads"],
                             "compile_seconds": m["compile_seconds"], "loss": value}}))
"""


def build(device: str):
    """The example's model and optimizer."""
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def cold_warm():
    with tempfile.TemporaryDirectory(prefix="torchneuron-bench-cache-") as cache:
        env = dict(os.environ, TORCHNEURON_CACHE_DIR=cache)
        code = _FIRST_STEP.format(examples=_EXAMPLES, bench=os.path.dirname(os.path.abspath(__file__)))
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True).stdout
            runs.append(json.loads(out.rsplit("RESULT", 1)[1]))
    cold, warm = runs
    print(f"first training step of examples/train_classifier.py in a fresh process (load average "
          f"{os.getloadavg()[0]:.1f}):")
    print(f"{'':6} {'imports s':>10} {'first step s':>13} {'compiled':>9} {'loaded':>7} {'compile+load s':>15}")
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:6} {r['imports']:10.2f} {r['first_step']:13.2f} {r['compiled']:9d} {r['loaded']:7d} "
              f"{r['compile_seconds']:15.2f}")
    print(f"first step {cold['first_step'] / warm['first_step']:.1f}x faster warm; losses equal: "
          f"{cold['loss'] == warm['loss']}")


def steady(repeats: int):
    import torch
    import torch.nn.functional as F

    import torchneuron  # noqa: F401

    sys.path.insert(0, _EXAMPLES)
    import train_classifier as tc

    x, y = tc.make_data()

    def setup(device):
        torch.manual_seed(0)
        model, opt = build(device)
        xd, yd = x.to(device), y.to(device)

        def epoch():
            for i in range(0, len(xd), 64):
                opt.zero_grad()
                loss = F.cross_entropy(model(xd[i:i + 64]), yd[i:i + 64])
                loss.backward()
                opt.step()
            return loss.item()

        epoch()   # compiles (neuron) and warms up
        return epoch

    threads = torch.get_num_threads()
    epochs = {"neuron": (setup("neuron"), threads), "cpu": (setup("cpu"), threads),
              "cpu, 1 thread": (setup("cpu"), 1)}
    times = {name: [] for name in epochs}
    cpu_times = {name: [] for name in epochs}
    for _ in range(repeats):
        for name, (epoch, n) in epochs.items():
            torch.set_num_threads(n)
            time.sleep(0.2)   # let the other configuration's threads go idle
            start, start_cpu = time.perf_counter(), time.process_time()
            epoch()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - start_cpu)
    torch.set_num_threads(threads)
    med = {name: statistics.median(t) for name, t in times.items()}
    med_cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    print(f"\nsteady-state epoch (8 steps of batch 64), median of {repeats} (load average "
          f"{os.getloadavg()[0]:.1f}; CPU PyTorch with its {threads} threads, and with 1):")
    print(f"  {'':14} {'wall ms':>8} {'neuron/this':>12} {'CPU-time ms':>12} {'neuron/this':>12}")
    for name in epochs:
        print(f"  {name:14} {med[name] * 1e3:8.1f} {med['neuron'] / med[name]:11.2f}x "
              f"{med_cpu[name] * 1e3:12.1f} {med_cpu['neuron'] / med_cpu[name]:11.2f}x")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-cold-warm", action="store_true")
    parser.add_argument("--skip-steady", action="store_true")
    args = parser.parse_args()
    if not args.skip_cold_warm:
        cold_warm()
    if not args.skip_steady:
        steady(args.repeats)


if __name__ == "__main__":
    main()
