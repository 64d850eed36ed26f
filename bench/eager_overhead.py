"""Per-op latency in eager mode: neuron vs CPU PyTorch vs the same jitted JAX function (the floor).

Each op is timed side by side in one run (the machine is shared and noisy): median of repeats of
N back-to-back calls, with a device synchronisation at the end of each repeat (``--stat min``: the
fastest repeat, the one least disturbed by other load). Two clocks: wall time, and the process's CPU
time (all threads: what the op costs the machine, and much less distorted by other processes on a
loaded box). The overhead column is neuron minus the JAX floor.

    .venv/bin/python bench/eager_overhead.py [--calls 2000] [--repeats 7] [--stat median|min]
    .venv/bin/python bench/eager_overhead.py --compare-async   # both CPU dispatch modes, one process each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import torch

import torchneuron
from torchneuron.runtime import pjrt

_STAT = statistics.median


def _median_us(fn, calls, repeats, sync):
    """(wall us, CPU us) per call: medians (or minima, ``--stat min``) over repeats."""
    fn()
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        sync()
        wall.append((time.perf_counter() - start) / calls * 1e6)
        cpu.append((time.process_time() - start_cpu) / calls * 1e6)
    return _STAT(wall), _STAT(cpu)


def cases():
    a64, b64 = torch.randn(64, 64), torch.randn(64, 64)
    a256, b256 = torch.randn(256, 256), torch.randn(256, 256)
    v = torch.randn(4096)
    big = torch.randn(4, 64, 64)
    return [
        ("add 64x64", (a64, b64), lambda x, y: x + y, lambda x, y: x + y),
        ("mul scalar 64x64", (a64,), lambda x: x * 0.5, lambda x: x * 0.5),
        ("relu 4096", (v,), torch.relu, jax.nn.relu),
        ("in-place add_ 64x64", (a64.clone(), b64), lambda x, y: x.add_(y), None),
        ("sum 4096", (v,), torch.sum, jnp.sum),
        ("mean dim 64x64", (a64,), lambda x: x.mean(1), lambda x: x.mean(1)),
        ("matmul 64x64", (a64, b64), torch.matmul, jnp.matmul),
        ("matmul 256x256", (a256, b256), torch.matmul, jnp.matmul),
        # Views with a storage offset (rows of a bigger tensor): the offsets are runtime inputs.
        ("add 64x64 rows of 4x64x64", (big,), lambda x: x[1] + x[2], lambda x: x[1] + x[2]),
    ]


def measure(cpu_args, torch_fn, jax_fn, calls, repeats):
    """((neuron wall, cpu), (CPU-PyTorch wall, cpu), (jax-floor wall, cpu)) us per call of one op."""
    neuron_args = tuple(t.to("neuron") for t in cpu_args)
    if len(cpu_args) == 1 and cpu_args[0].dim() == 3:
        # The view case: the views are made once, outside the timed loop (views are metadata).
        rows = (neuron_args[0][1], neuron_args[0][2])
        neuron_call = lambda: rows[0] + rows[1]  # noqa: E731
    else:
        neuron_call = lambda: torch_fn(*neuron_args)  # noqa: E731
    cpu = _median_us(lambda: torch_fn(*cpu_args), calls, repeats, lambda: None)
    neu = _median_us(neuron_call, calls, repeats, torch.neuron.synchronize)
    if jax_fn is None:  # in-place: the floor is the functional update of the same buffer
        jax_fn = lambda x, y: x + y  # noqa: E731
    jitted = jax.jit(jax_fn)
    jax_args = tuple(jnp.asarray(t.numpy()) for t in cpu_args)
    floor = _median_us(lambda: jitted(*jax_args), calls, repeats,
                       lambda: jax.block_until_ready(jitted(*jax_args)))
    return neu, cpu, floor


def run(calls, repeats):
    rows = [(case[0], *measure(*case[1:], calls, repeats)) for case in cases()]
    print(f"CPU async dispatch: {torchneuron.config.cpu_async_dispatch}; XLA CPU pool threads "
          f"{pjrt.describe_intra_op_pool()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'op':27} {'neuron us':>10} {'cpu us':>8} {'jax us':>8} {'neuron/cpu':>11} {'overhead us':>12}"
          f"   {'(CPU time:':>10} {'neuron':>7} {'jax':>6} {'overhead)':>9}")
    for name, neu, cpu, floor in rows:
        print(f"{name:27} {neu[0]:10.1f} {cpu[0]:8.1f} {floor[0]:8.1f} {neu[0] / cpu[0]:10.1f}x "
              f"{neu[0] - floor[0]:12.1f}   {'':>10} {neu[1]:7.1f} {floor[1]:6.1f} {neu[1] - floor[1]:9.1f}")
    wall = statistics.median(neu[0] - floor[0] for _, neu, _, floor in rows)
    cpu_time = statistics.median(neu[1] - floor[1] for _, neu, _, floor in rows)
    print(f"\nmedian cached-op overhead above the JAX floor: {wall:.1f} us wall, {cpu_time:.1f} us CPU time")
    return {"wall": wall, "cpu": cpu_time}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compare-async", action="store_true",
                        help="run the table once per CPU dispatch mode, each in a fresh process "
                             "(XLA reads the switch when its CPU client starts)")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global _STAT
    _STAT = min if args.stat == "min" else statistics.median
    if not args.compare_async:
        result = run(args.calls, args.repeats)
        if args.json:
            print("RESULT" + json.dumps(result))
        return
    medians = {}
    for mode in ("0", "1"):
        env = dict(os.environ, TORCHNEURON_CPU_ASYNC_DISPATCH=mode)
        out = subprocess.run([sys.executable, __file__, "--calls", str(args.calls), "--repeats",
                              str(args.repeats), "--stat", args.stat, "--json"], env=env, capture_output=True, text=True,
                             check=True).stdout
        print(out.rsplit("RESULT", 1)[0])
        medians[mode] = json.loads(out.rsplit("RESULT", 1)[1])
    inline, pool = medians["0"], medians["1"]
    print(f"median overhead, inline (default) vs thread pool: {inline['wall']:.1f} vs {pool['wall']:.1f} us "
          f"wall, {inline['cpu']:.1f} vs {pool['cpu']:.1f} us CPU time")


if __name__ == "__main__":
    main()
