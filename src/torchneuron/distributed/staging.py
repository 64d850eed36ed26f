"""Moving collective payloads between neuron tensors and the host buffers gloo works on.

Device->host reads go through ``transfers.to_host`` and uploads are counted in the same metrics,
so collective traffic shows up in the host<->device copy counters.

Host buffers are private to one collective and never written after it completes, so results are
handed to PJRT without a copy (``may_alias``: PJRT adopts 64-byte aligned host memory on the CPU
platform, and copies on accelerators). Large buffers come from a pool: on a VM the first-touch page
faults of a fresh 64 MiB buffer cost more than copying it, while gloo's own baseline reuses warm
buffers. A pooled buffer is free again once nothing references it any more: not the collective,
not a device array that adopted it (every view of a numpy array keeps its owner alive, so the
owner's reference count says whether anyone still uses the memory).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import torch

from ..metrics import metrics
from ..runtime import memory, pjrt, transfers

_ALIGN = 64               # PJRT adopts host memory only if it is this aligned
_POOL_MIN = 1 << 20       # smaller buffers come from malloc, which recycles them well enough
_POOL_BYTES = 1 << 30     # host memory the pool may hold in total
_POOL_PER_SIZE = 4        # buffers kept per size (a collective in flight and results on the device)


def flush() -> None:
    """Run pending adaptive-eager work, so reads see it and writes land after it."""
    memory.flush_pending("collective")


class _Pool:
    def __init__(self):
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A free, ``_ALIGN``-aligned uint8 array of ``nbytes`` bytes."""
        with self._lock:
            stack = self._buffers.setdefault(nbytes, [])
            for raw, start in stack:
                # Referenced only by the pool's entry, the loop variable and this call's argument:
                # nobody uses it (every view handed out has ``raw`` as its numpy base).
                if sys.getrefcount(raw) <= 3:
                    return raw[start:start + nbytes]
            raw, start = _aligned(nbytes)
            if len(stack) < _POOL_PER_SIZE and self._bytes + raw.nbytes <= _POOL_BYTES:
                stack.append((raw, start))
                self._bytes += raw.nbytes
            return raw[start:start + nbytes]


_pool = _Pool()


def _aligned(nbytes: int) -> tuple[np.ndarray, int]:
    """A new uint8 array with room for ``nbytes`` from an ``_ALIGN``-aligned start, and that start."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    return raw, (-raw.__array_interface__["data"][0]) % _ALIGN


@functools.cache
def _numpy_dtype(dtype: torch.dtype):
    return ml_dtypes.bfloat16 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def _buffer(shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray | None]:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), None
    if nbytes >= _POOL_MIN:
        block = _pool.take(nbytes)
    else:
        raw, start = _aligned(nbytes)
        block = raw[start:start + nbytes]
    return torch.from_numpy(block).view(dtype).view(shape), block.view(_numpy_dtype(dtype)).reshape(shape)


def buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous, 64-byte aligned host tensor that only this collective uses."""
    return _buffer(tuple(shape), dtype)[0]


def _read(t: torch.Tensor) -> np.ndarray:
    rec = memory.record_of(t)
    if t.storage_offset() == 0 and rec.dtype == t.dtype and rec.numel == t.numel() and t.is_contiguous():
        # The whole storage: its buffer as it is, without a reshape dispatched to the device.
        arr = np.asarray(memory.empty_buffer(rec))
        metrics.d2h_copies += 1
        metrics.d2h_bytes += arr.nbytes
        return arr
    return transfers.copy_to_host(t).reshape(-1)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A writable host copy of a neuron tensor's values (one device->host copy)."""
    host, view = _buffer(tuple(t.shape), t.dtype)
    if view is not None:
        tracer = metrics.tracer
        src = tracer.copy("d2h", _read, t) if tracer is not None else _read(t)
        np.copyto(view.reshape(-1), src)
    return host


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return buffer(t.shape, t.dtype)


def _adopt(host: np.ndarray, device_index: int):
    metrics.h2d_copies += 1
    metrics.h2d_bytes += host.nbytes
    # Nobody writes this buffer again, so PJRT may adopt it instead of copying (transfers.upload
    # must copy user data, which the user may still change).
    return pjrt.put(host, device_index)


def to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Write a host result of ``dst``'s shape and dtype into the neuron tensor ``dst`` in place."""
    if dst.numel() == 0:
        return
    rec = memory.record_of(dst)
    host = host.contiguous()
    flat = (host.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if host.dtype == torch.bfloat16
            else host.numpy()).reshape(-1)
    tracer = metrics.tracer
    arr = tracer.copy("h2d", _adopt, flat, rec.device_index) if tracer is not None \
        else _adopt(flat, rec.device_index)
    if (dst.storage_offset() == 0 and rec.dtype == dst.dtype and rec.numel == dst.numel()
            and dst.is_contiguous()):
        rec.buf = arr   # the result is the whole storage: adopt it
        torch.autograd.graph.increment_version(dst)
        return
    staged = memory.new_buffer_tensor(arr, dst.dtype, rec.device_index, tuple(dst.shape))
    with torch.no_grad():
        dst.copy_(staged)   # a device-side copy into the view


def flatten_by_dtype(tensors: Sequence[torch.Tensor], blocks: int = 1):
    """Pack tensors of each dtype into one host buffer, for one gloo call per dtype.

    With ``blocks = b`` the buffer is viewed as ``b`` equal blocks and block ``r`` holds the ``r``-th
    of ``b`` equal pieces of every tensor, in order (the layout reduce-scatter needs). Returns
    ``[(flat, [(index, tensor, (start, numel)), ...]), ...]``, ``start`` counting the elements
    before this tensor in unblocked order.
    """
    by_dtype: dict[torch.dtype, list] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append((i, t))
    packed = []
    for dtype, items in by_dtype.items():
        total = sum(t.numel() for _, t in items)
        flat = buffer((total,), dtype)
        rows = transfers.host_array(flat).reshape(blocks, total // blocks) if total else None
        members, start = [], 0
        for i, t in items:
            n = t.numel()
            if n % blocks:
                raise RuntimeError(
                    f"torchneuron: a reduce-scatter input of shape {list(t.shape)} ({n} elements) does not "
                    f"split into {blocks} equal shards; pad it to a multiple of the group size.")
            if n:
                rows[:, start // blocks:(start + n) // blocks] = transfers.to_host(t).reshape(blocks, n // blocks)
            members.append((i, t, (start, n)))
            start += n
        packed.append((flat, members))
    return packed


def unflatten_to_device(flat: torch.Tensor, members) -> None:
    for _, t, (start, n) in members:
        to_device(t, flat[start:start + n].view(t.shape))


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    if not tensors:
        return "no tensors"
    shown = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors[:4])
    more = f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
    return f"[{shown}{more}] ({tensors[0].device})"
