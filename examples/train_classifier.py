"""Train a small classifier on synthetic data on the neuron device, next to the same run on CPU.

The one-line change is `.to(device)`: everything else is plain PyTorch.
Run with `make demo` (or `.venv/bin/python examples/train_classifier.py`).
"""

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron


def make_data(n=512, features=32, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + 3 * torch.randn(n, features, generator=g)
    return x, labels


def train(device, x, y, epochs=5, batch=64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, int(y.max()) + 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[i:i + batch]), y[i:i + batch])
            loss.backward()
            opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return losses, accuracy


def main():
    x, y = make_data()
    start = time.perf_counter()
    cpu_losses, cpu_acc = train("cpu", x, y)
    cpu_s = time.perf_counter() - start
    torchneuron.metrics.reset()
    start = time.perf_counter()
    neuron_losses, neuron_acc = train("neuron", x, y)
    neuron_s = time.perf_counter() - start

    print(f"device: {torch.accelerator.current_accelerator()} ({torch.neuron.get_device_name()})")
    print(f"{'epoch':>5} {'loss (cpu)':>12} {'loss (neuron)':>14}")
    for epoch, (a, b) in enumerate(zip(cpu_losses, neuron_losses), 1):
        print(f"{epoch:>5} {a:12.6f} {b:14.6f}")
    print(f"accuracy: cpu {cpu_acc:.3f}  neuron {neuron_acc:.3f}")
    print(f"wall time: cpu {cpu_s:.2f} s  neuron {neuron_s:.2f} s (includes first-call compiles)")
    print("\nneuron metrics")
    print(torchneuron.metrics.summary())
    drift = max(abs(a - b) / abs(a) for a, b in zip(cpu_losses, neuron_losses))
    assert drift < 1e-3, f"neuron losses drifted from CPU by {drift:.2e}"
    assert torchneuron.metrics()["fallback_count"] == 0


if __name__ == "__main__":
    main()
