"""Adaptive eager vs plain eager vs CPU eager, measured side by side in one run.

Two workloads: a small-op-heavy MLP training loop, and the GPT-style model's eager training step
(the model from bench/compile.py). Each is timed per step (median of several repeats, after a
warm-up that compiles everything), then printed as ratios.

    .venv/bin/python bench/adaptive.py [--steps 20] [--repeats 3] [--gpt-layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron

sys.path.insert(0, os.path.dirname(__file__))
from compile import GPT  # noqa: E402  (the shared GPT-style model)


def mlp_workload(device):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # a host read per step, as in a typical loop that logs the loss

    return step


def gpt_workload(device, layers):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(vocab=512, d=128, heads=4, layers=layers, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 512, (4, 64), generator=g).to(device)
    tgt = torch.randint(0, 512, (4, 64), generator=g).to(device)

    def step():
        opt.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def seconds_per_step(step, steps, repeats):
    for _ in range(3):   # warm-up: compiles every executable / region
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


def run(name, make, args):
    cpu = seconds_per_step(make("cpu"), args.steps, args.repeats)
    with torchneuron.eager_mode("plain"):
        plain = seconds_per_step(make("neuron"), args.steps, args.repeats)
    with torchneuron.eager_mode("adaptive"):
        torchneuron.metrics.reset()
        adaptive = seconds_per_step(make("neuron"), args.steps, args.repeats)
        m = torchneuron.metrics()
    ops_per_region = m["region_ops"] / max(m["regions_flushed"], 1)
    print(f"{name:14} cpu {cpu * 1e3:8.2f} ms  plain {plain * 1e3:8.2f} ms  adaptive {adaptive * 1e3:8.2f} ms"
          f" | adaptive vs plain {plain / adaptive:5.2f}x  vs cpu {cpu / adaptive:5.2f}x"
          f" | {ops_per_region:.0f} ops/region, {m['region_compiles']} region compiles")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpt-layers", type=int, default=2)
    args = parser.parse_args()
    print("throughput ratios are speed-ups (higher is better for adaptive)")
    run("mlp loop", mlp_workload, args)
    run("gpt step", lambda d: gpt_workload(d, args.gpt_layers), args)


if __name__ == "__main__":
    main()
