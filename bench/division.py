"""What exact floor/trunc division costs: neuron's ``//`` of a broadcast operand against CPU PyTorch,
and its jitted lowering (IEEE division behind an optimisation barrier, ATen's fmod-based floor)
against a plain ``jnp.floor(a / b)``, which XLA turns into a multiply by the reciprocal.

Timed side by side in one run (median of repeats of N back-to-back calls):

    .venv/bin/python bench/division.py [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import torch

sys.path.insert(0, str(Path(__file__).parent))
from eager_overhead import _median_us  # noqa: E402

import torchneuron  # noqa: E402, F401
from torchneuron.ops.elementwise import floor_divide  # noqa: E402


def _row(rows, cols, calls, repeats) -> str:
    a, b = torch.randn(rows, cols), torch.randn(cols)
    an, bn = a.to("neuron"), b.to("neuron")
    aj, bj = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    exact, plain = jax.jit(floor_divide), jax.jit(lambda x, y: jnp.floor(x / y))
    t_neuron = _median_us(lambda: an // bn, calls, repeats, torch.neuron.synchronize)
    t_cpu = _median_us(lambda: a // b, calls, repeats, lambda: None)
    t_exact = _median_us(lambda: exact(aj, bj), calls, repeats, lambda: exact(aj, bj).block_until_ready())
    t_plain = _median_us(lambda: plain(aj, bj), calls, repeats, lambda: plain(aj, bj).block_until_ready())
    return (f"{f'{rows}x{cols} // {cols}':28s} {t_neuron:10.1f} {t_cpu:10.1f} {t_exact:13.1f} {t_plain:13.1f} "
            f"{t_neuron / t_cpu:11.2f} {t_exact / t_plain:12.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"{'case':28s} {'neuron µs':>10s} {'CPU µs':>10s} {'exact jit µs':>13s} {'plain jit µs':>13s} "
          f"{'neuron/CPU':>11s} {'exact/plain':>12s}")
    for rows, cols in ((256, 256), (1024, 1024)):
        print(_row(rows, cols, args.calls, args.repeats))


if __name__ == "__main__":
    main()
