"""``torchneuron.warmup``: compile a program's shape buckets before traffic arrives.

With ``config.shapes = "bucketed"`` a new length compiles only when its bucket is new, but the first
request of each bucket still pays that compile. ``warmup`` runs the program once on the example
inputs and then once per bucket, with the varying dim of every tensor input resized to the bucket
(cut, or extended by repeating its own values, so token ids stay valid ids). Eager ops, bucketed
eager programs and torch.compile graphs compile as they would under traffic, into the persistent
cache (``TORCHNEURON_CACHE_DIR``): a second process that warms up the same buckets loads them,
and ``metrics()["executables_compiled"]`` stays 0 there.
"""

from __future__ import annotations

import time

import torch

from .config import config
from .metrics import metrics


def resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with ``dim`` of length ``size``: cut, or extended with its own values repeated."""
    n = t.shape[dim]
    if n == size:
        return t
    if n == 0:
        raise ValueError(f"torchneuron.warmup: an example input has size 0 along dim {dim}: nothing to repeat")
    if n > size:
        return t.narrow(dim, 0, size)
    reps = [1] * t.dim()
    reps[dim] = -(-size // n)
    return t.repeat(*reps).narrow(dim, 0, size)


def _lengths(sizes) -> list:
    """A length in each bucket, one under its top where that stays in it: a round size (32) could
    equal a static size of the model (a hidden size of 32) and be traced as that one, which
    traffic's lengths are not (eager mode shares a symbol between equal sizes, as Dynamo does)."""
    out, below = [], 1
    for size in sizes:
        out.append(size - 1 if size - 1 > below else size)
        below = size
    return out


def _as_traffic(a, dim, size):
    """An input resized as a request of that size arrives: made on the host and copied over, so
    its storage is what a request's is (storage sizes are part of what decides a program)."""
    if not isinstance(a, torch.Tensor) or a.dim() <= dim:
        return a
    return resized(a.cpu(), dim, size).contiguous().to(a.device)


def warmup(fn, example_inputs, buckets, *, dim: int = 1, grad: bool = False) -> dict:
    """Run ``fn(*example_inputs)`` and then ``fn`` with every tensor input's ``dim`` resized to each
    size of ``buckets`` (the sizes to compile: a ladder's buckets, e.g. ``[16, 32, 64, 128]``).
    Inputs with fewer dims are passed as they are. Under ``torch.no_grad()`` unless ``grad``.
    Each bucket is run at a length just under its top (``_lengths``).
    Returns what it cost: {"sizes", "executables_compiled", "compile_seconds", "seconds"}."""
    if config.shapes != "bucketed":
        raise RuntimeError("torchneuron.warmup compiles shape buckets: set torchneuron.config.shapes = 'bucketed' "
                           "(TORCHNEURON_SHAPES=bucketed) first; with static shapes every length compiles anew")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    sizes = sorted({int(b) for b in buckets})
    if not sizes or sizes[0] < 2:
        raise ValueError(f"torchneuron.warmup: buckets must be sizes of at least 2, got {list(buckets)}")
    compiled, seconds = metrics.executables_compiled, metrics.compile_seconds
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        fn(*example_inputs)        # the example's own shape first, as traffic's first request
        for size in _lengths(sizes):
            fn(*[_as_traffic(a, dim, size) for a in example_inputs])
    return {"sizes": sizes, "executables_compiled": metrics.executables_compiled - compiled,
            "compile_seconds": metrics.compile_seconds - seconds, "seconds": time.perf_counter() - start}
