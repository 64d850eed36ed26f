"""Moving collective payloads between neuron tensors and the host buffers gloo works on.

Every device->host read goes through ``transfers.to_host`` and every write back through the
tensor's own ``copy_`` kernel, so the metrics' host<->device counters include collective traffic
and views, dtypes and version counters behave exactly as for any other copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime import transfers


def flush() -> None:
    """Run pending adaptive-eager work, so reads see it and writes land after it."""
    from ..eager import adaptive
    adaptive.flush("collective")


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A writable, contiguous CPU copy of a neuron tensor's values (one device->host copy)."""
    return transfers.torch_from_host(transfers.to_host(t))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host buffer for a collective to write ``t``'s result into."""
    return torch.empty(tuple(t.shape), dtype=t.dtype)


def to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Write a host result into a neuron tensor (any layout) in place."""
    dst.copy_(host)


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    if not tensors:
        return "no tensors"
    shown = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors[:4])
    more = f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
    return f"[{shown}{more}] on {tensors[0].device}"


def flatten_by_dtype(tensors: Sequence[torch.Tensor], read: bool = True, blocks: int = 1):
    """Pack tensors of each dtype into one host buffer, for one gloo call per dtype.

    With ``blocks = b`` the buffer is viewed as ``b`` equal blocks and block ``r`` holds the ``r``-th
    of ``b`` equal pieces of every tensor, in order (the layout reduce-scatter needs). Returns
    ``[(flat, [(index, tensor, (start, numel)), ...]), ...]``, ``start`` counting elements before
    this tensor in the unblocked order.
    """
    by_dtype: dict[torch.dtype, list] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append((i, t))
    packed = []
    for dtype, items in by_dtype.items():
        total = sum(t.numel() for _, t in items)
        flat = torch.empty(total, dtype=dtype)
        rows = transfers.host_array(flat).reshape(blocks, total // blocks) if total else None
        members, start = [], 0
        for i, t in items:
            n = t.numel()
            if n % blocks:
                raise RuntimeError(
                    f"torchneuron: a reduce-scatter input of shape {list(t.shape)} ({n} elements) does not "
                    f"split into {blocks} equal shards; pad it to a multiple of the group size.")
            if read and n:
                piece = transfers.to_host(t).reshape(blocks, n // blocks)
                rows[:, start // blocks:(start + n) // blocks] = piece
            members.append((i, t, (start, n)))
            start += n
        packed.append((flat, members))
    return packed


def unflatten_to_device(flat: torch.Tensor, members) -> None:
    for _, t, (start, n) in members:
        to_device(t, flat[start:start + n].view(t.shape))


__all__ = ["describe", "empty_like", "flatten_by_dtype", "flush", "nbytes", "to_device", "to_host",
           "unflatten_to_device"]
