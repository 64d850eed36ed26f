"""Per-op latency in eager mode: neuron vs CPU PyTorch vs the same jitted JAX function (the floor).

Each op is timed side by side in one run (the machine is shared and noisy): median of repeats of
N back-to-back calls, with a device synchronisation at the end of each repeat (``--stat min``: the
fastest repeat, the one least disturbed by other load).

    .venv/bin/python bench/eager_overhead.py [--calls 2000] [--repeats 7] [--stat median|min]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchneuron  # noqa: F401

_STAT = statistics.median


def _median_us(fn, calls, repeats, sync):
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return _STAT(samples)


def cases():
    a64, b64 = torch.randn(64, 64), torch.randn(64, 64)
    a256, b256 = torch.randn(256, 256), torch.randn(256, 256)
    v = torch.randn(4096)
    return [
        ("add 64x64", (a64, b64), lambda x, y: x + y, lambda x, y: x + y),
        ("mul scalar 64x64", (a64,), lambda x: x * 0.5, lambda x: x * 0.5),
        ("relu 4096", (v,), torch.relu, jax.nn.relu),
        ("in-place add_ 64x64", (a64.clone(), b64), lambda x, y: x.add_(y), None),
        ("sum 4096", (v,), torch.sum, jnp.sum),
        ("mean dim 64x64", (a64,), lambda x: x.mean(1), lambda x: x.mean(1)),
        ("matmul 64x64", (a64, b64), torch.matmul, jnp.matmul),
        ("matmul 256x256", (a256, b256), torch.matmul, jnp.matmul),
    ]


def measure(cpu_args, torch_fn, jax_fn, calls, repeats):
    """(neuron us, cpu us, jax-floor us) per call of one op."""
    neuron_args = tuple(t.to("neuron") for t in cpu_args)
    cpu_us = _median_us(lambda: torch_fn(*cpu_args), calls, repeats, lambda: None)
    neu_us = _median_us(lambda: torch_fn(*neuron_args), calls, repeats, torch.neuron.synchronize)
    if jax_fn is None:  # in-place: the floor is the functional update of the same buffer
        jax_fn = lambda x, y: x + y  # noqa: E731
    jitted = jax.jit(jax_fn)
    jax_args = tuple(jnp.asarray(t.numpy()) for t in cpu_args)
    jax_us = _median_us(lambda: jitted(*jax_args), calls, repeats,
                        lambda: jax.block_until_ready(jitted(*jax_args)))
    return neu_us, cpu_us, jax_us


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    args = parser.parse_args()
    global _STAT
    _STAT = min if args.stat == "min" else statistics.median

    rows = [(case[0], *measure(*case[1:], args.calls, args.repeats)) for case in cases()]

    print(f"{'op':22} {'neuron us':>10} {'cpu us':>8} {'jax us':>8} {'neuron/cpu':>11} {'overhead us':>12}")
    for name, neu, cpu, floor in rows:
        print(f"{name:22} {neu:10.1f} {cpu:8.1f} {floor:8.1f} {neu / cpu:10.1f}x {neu - floor:12.1f}")
    overheads = [neu - floor for _, neu, _, floor in rows]
    print(f"\nmedian cached-op overhead above the JAX floor: {statistics.median(overheads):.1f} us")


if __name__ == "__main__":
    main()
