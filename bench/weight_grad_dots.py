"""A Linear's weight gradient, ``a.t() @ b`` (a: k x m, b: k x n), three ways, side by side in one run.

* XLA as traced (``dot_general`` contracting both operands' leading dim: what ``mm(t(a), b)``
  lowers to without compile/fusions.py);
* ``ops.linalg.mm_transposed_self`` (what compiled graphs run now);
* PyTorch's ``torch.mm`` (torch threads 2; XLA's pool one thread per core).

    .venv/bin/python bench/weight_grad_dots.py
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np
import torch
from jax import lax

from torchneuron.ops.linalg import mm_transposed_self

# (k, m, n): bench/compile.py's GPT at d 256 and at d 512 (1,024 tokens, vocabulary 8,192).
SHAPES = [(1024, 8192, 256), (1024, 1024, 256), (1024, 256, 1024), (1024, 768, 256), (1024, 256, 256),
          (1024, 8192, 512), (1024, 2048, 512), (1024, 512, 2048), (1024, 1536, 512), (1024, 512, 512)]


def median_ms(fn, n=15):
    fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main():
    torch.set_num_threads(2)
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads 2; float32, precision highest")
    print(f"{'k x m x n':>18s} {'XLA as traced':>14s} {'fused':>8s} {'torch.mm':>9s}")
    rng = np.random.default_rng(0)
    traced = jax.jit(lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=lax.Precision.HIGHEST))
    fused = jax.jit(lambda a, b: mm_transposed_self(a, b))
    for k, m, n in SHAPES:
        a = rng.standard_normal((k, m)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        ja, jb = jax.device_put(a), jax.device_put(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        t_traced = median_ms(lambda ja=ja, jb=jb: traced(ja, jb).block_until_ready())
        t_fused = median_ms(lambda ja=ja, jb=jb: fused(ja, jb).block_until_ready())
        t_torch = median_ms(lambda ta=ta, tb=tb: torch.mm(ta.t(), tb))
        print(f"{f'{k}x{m}x{n}':>18s} {t_traced:11.2f} ms {t_fused:5.2f} ms {t_torch:6.2f} ms")


if __name__ == "__main__":
    main()
