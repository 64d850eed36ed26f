"""Custom kernels against the same computation as eager composite ops, side by side in one run.

For each example kernel (examples/kernel_rms_norm.py: a fused RMSNorm in jax.numpy;
examples/kernel_flash_attention.py: a blockwise causal attention in Pallas), times

* the kernel on neuron (one executable from the eager cache),
* the same computation written with PyTorch ops, eager on neuron (one executable per op),
* the same PyTorch ops on CPU,

for the forward alone and for forward + backward, as the median over repeats of N back-to-back
calls (each waiting for its result) after a warm-up that compiles everything; the three configs
are timed round by round with a 0.5 s pause before each (bench/compile.py's settle pause). Ratios
> 1 mean the kernel is faster.

    .venv/bin/python bench/kernels.py [--calls 20] [--repeats 5]

On the CPU platform Pallas kernels run through Pallas's interpreter (a loop over the grid inside
the executable), so the attention figures measure that interpreter, not a native Pallas lowering.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import torchneuron

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import kernel_flash_attention  # noqa: E402
import kernel_rms_norm  # noqa: E402


def _block(out):
    """Wait for the device: an output's buffer is what the last executable produced."""
    if isinstance(out, torch.Tensor) and out.device.type == "neuron":
        from torchneuron.runtime import memory
        buf = memory.record_of(out).buf
        if buf is not None:
            buf.block_until_ready()
        torch.neuron.synchronize()


def _interleaved_ms(fns, calls, repeats):
    """Median milliseconds per call of each of ``fns``, timed round by round (every config once a
    round, so the machine's drift hits all alike) after a warm-up that compiles every executable.
    Each call waits for its result: latency per call, as CPU PyTorch's. Before each timing the
    previous config's worker threads (PyTorch's OpenMP team, XLA's pool) get 0.5 s to stop
    spinning, as in bench/compile.py: otherwise they take cores from the config timed next."""
    for fn in fns:
        _block(fn())
        _block(fn())
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            time.sleep(0.5)
            start = time.perf_counter()
            for _ in range(calls):
                _block(fn())
            out.append((time.perf_counter() - start) / calls * 1e3)
    return [statistics.median(s) for s in samples]


def _cases(device, make_inputs, kernel, composite):
    inputs = [t.to(device) for t in make_inputs()]
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]

    def train(fn):
        def step():
            for t in leaves:
                t.grad = None
            out = fn(*leaves)
            out.sum().backward()
            return leaves[0].grad
        return step

    return {"forward": (lambda: kernel(*inputs), lambda: composite(*inputs)),
            "forward+backward": (train(kernel), train(composite))}


def rms_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 128, 512, generator=g), torch.randn(512, generator=g)


def attention_inputs(batch=1, heads=4, seq=256, dim=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3)]


def composite_attention(q, k, v):
    """Causal attention as PyTorch ops (matmul, mask, softmax, matmul)."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-2, -1)) * scale
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from torchneuron.runtime import pjrt
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores; "
          f"platform {torchneuron.config.platform}, torch {torch.__version__}; torch threads "
          f"{torch.get_num_threads()}, {pjrt.describe_intra_op_pool()}; configs timed round by round")
    rms = kernel_rms_norm.rms_norm
    fa = kernel_flash_attention.flash_attention
    benches = [
        ("rms_norm 16x128x512", rms_inputs, lambda x, w: rms(x, w), kernel_rms_norm.reference),
        ("flash attention 1x4x256x64", attention_inputs,
         lambda q, k, v: fa(q, k, v, 1 / math.sqrt(q.shape[-1]), 64, 64), composite_attention),
    ]
    print(f"{'case':28s} {'pass':17s} {'kernel ms':>10s} {'composite ms':>13s} {'CPU torch ms':>13s} "
          f"{'vs composite':>13s} {'vs CPU':>8s}")
    for name, make_inputs, kernel, composite in benches:
        neuron = _cases("neuron", make_inputs, kernel, composite)
        cpu = _cases("cpu", make_inputs, kernel, composite)
        for what in ("forward", "forward+backward"):
            t_kernel, t_composite, t_cpu = _interleaved_ms(
                [neuron[what][0], neuron[what][1], cpu[what][1]], args.calls, args.repeats)
            print(f"{name:28s} {what:17s} {t_kernel:10.3f} {t_composite:13.3f} {t_cpu:13.3f} "
                  f"{t_composite / t_kernel:12.2f}x {t_cpu / t_kernel:7.2f}x")
    m = torchneuron.metrics()
    print(f"custom kernel compiles: {dict(m['custom_kernel_compiles'])}")


if __name__ == "__main__":
    main()
