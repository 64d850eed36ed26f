"""Keeping shapes stable: compiled neuron graphs are static, so every new shape is a new executable.

Pad tensors to a multiple (TorchNeuron's TRL integration pads batches to multiples of 128 tokens)
or bucket sequence lengths so a whole input-length distribution maps onto a few shapes::

    n = torchneuron.bucket_length(len(tokens))                 # 128, 256, 512, ...
    ids = torchneuron.pad_to_multiple(ids, multiple=128, value=pad_id)

Both are plain torch code, so they also work inside a compiled function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_to_multiple(t: torch.Tensor, multiple: int = 128, dim: int = -1, value=0) -> torch.Tensor:
    """``t`` padded at the end of ``dim`` with ``value`` up to the next multiple of ``multiple``.

    Returns ``t`` itself when its size already is a multiple.
    """
    if multiple <= 0:
        raise ValueError(f"torchneuron.pad_to_multiple: multiple must be positive, got {multiple}")
    if t.dim() == 0:
        raise ValueError("torchneuron.pad_to_multiple: cannot pad a 0-dim tensor")
    dim = dim % t.dim()
    pad = (-t.shape[dim]) % multiple
    if pad == 0:
        return t
    # F.pad lists (left, right) pairs from the last dim backwards.
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, pad]
    return torch.nn.functional.pad(t, pads, mode="constant", value=value)


def bucket_length(length: int, buckets: Sequence[int] | None = None, multiple: int = 128) -> int:
    """The padded length for a sequence of ``length``: the smallest of ``buckets`` that fits it, or,
    without buckets, the smallest ``multiple * 2**k`` that does (128, 256, 512, ... by default), so
    lengths up to N need only about log2(N / multiple) executables.
    """
    length = int(length)
    if length < 0:
        raise ValueError(f"torchneuron.bucket_length: length must be >= 0, got {length}")
    if buckets:
        ordered = sorted(int(b) for b in buckets)
        for b in ordered:
            if b >= length:
                return b
        raise ValueError(f"torchneuron.bucket_length: length {length} exceeds the largest bucket "
                         f"{ordered[-1]}; add a larger bucket or truncate the sequence")
    if multiple <= 0:
        raise ValueError(f"torchneuron.bucket_length: multiple must be positive, got {multiple}")
    size = multiple
    while size < length:
        size *= 2
    return size
