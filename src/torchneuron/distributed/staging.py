"""Moving collective payloads between neuron tensors and the tensors the collective engine works on.

Two transports, chosen per process group (``config.collectives``):

``HostStaging`` (gloo, every platform): device->host reads go through ``transfers.to_host`` and
uploads are counted in the same metrics, so collective traffic shows up in the host<->device copy
counters. Host buffers are private to one collective and never written after it completes, so
results are handed to PJRT without a copy (``may_alias``: PJRT adopts 64-byte aligned host memory
on the CPU platform, and copies on accelerators). Large buffers come from a pool: on a VM the
first-touch page faults of a fresh 64 MiB buffer cost more than copying it, while gloo's own
baseline reuses warm buffers. A pooled buffer is free again once nothing references it any more:
not the collective, not a device array that adopted it (every view of a numpy array keeps its owner
alive, so the owner's reference count says whether anyone still uses the memory).

``SharedStaging`` (NCCL on the CUDA platform; gloo on the CPU platform, where it is tested): the
engine's tensors share memory with the device buffers through DLPack. An input is a copy made on
the device from a zero-copy view of its buffer (the collective may write it, and device buffers
are immutable); a result is adopted by PJRT as the output's new buffer without a copy. Nothing
crosses to the host. On CUDA the views are dropped only after torch's stream has finished with
them, and results are adopted once the engine's stream is done (``settle``).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence

import jax.dlpack as jax_dlpack
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


def _read(t: torch.Tensor) -> np.ndarray:
    rec = memory.record_of(t)
    if _whole_storage(t, rec):
        # The whole storage: its buffer as it is, without a reshape dispatched to the device.
        arr = np.asarray(memory.empty_buffer(rec))[:rec.numel]
        metrics.d2h_copies += 1
        metrics.d2h_bytes += arr.nbytes
        return arr
    return transfers.copy_to_host(t).reshape(-1)


def _adopt(host: np.ndarray, device_index: int):
    metrics.h2d_copies += 1
    metrics.h2d_bytes += host.nbytes
    # Nobody writes this buffer again, so PJRT may adopt it instead of copying (transfers.upload
    # must copy user data, which the user may still change).
    return pjrt.put(host, device_index)


def _whole_storage(t: torch.Tensor, rec) -> bool:
    return t.storage_offset() == 0 and rec.dtype == t.dtype and rec.numel == t.numel() and t.is_contiguous()


def _install(dst: torch.Tensor, arr) -> None:
    """Make the flat device array ``arr`` (``dst``'s values, in order) the contents of ``dst``."""
    rec = memory.record_of(dst)
    if _whole_storage(dst, rec):
        rec.buf = arr   # the result is the whole storage: adopt it
        torch.autograd.graph.increment_version(dst)
        return
    staged = memory.new_buffer_tensor(arr, dst.dtype, rec.device_index, tuple(dst.shape))
    with torch.no_grad():
        dst.copy_(staged)   # a device-side copy into the view


class HostStaging:
    """Collectives on host copies of the neuron tensors, run by gloo."""

    name = "host"

    def buffer(self, shape, dtype: torch.dtype, device_index: int = 0) -> torch.Tensor:
        """A contiguous tensor on the engine's side that only this collective uses (here: host
        memory, 64-byte aligned)."""
        return _buffer(tuple(shape), dtype)[0]

    def to_engine(self, t: torch.Tensor) -> torch.Tensor:
        """A writable copy of a neuron tensor's values on the engine's side (one device->host copy)."""
        host, view = _buffer(tuple(t.shape), t.dtype)
        if view is not None:
            tracer = metrics.tracer
            src = tracer.copy("d2h", _read, t) if tracer is not None else _read(t)
            np.copyto(view.reshape(-1), src)
        return host

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.buffer(t.shape, t.dtype, t.device.index or 0)

    def settle(self, work) -> None:
        """Called before results are read: gloo's results are complete when its work is."""

    def to_device(self, dst: torch.Tensor, result: torch.Tensor) -> None:
        """Write a result of ``dst``'s shape and dtype into the neuron tensor ``dst`` in place."""
        if dst.numel() == 0:
            return
        result = result.contiguous()
        flat = (result.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if result.dtype == torch.bfloat16
                else result.numpy()).reshape(-1)
        device_index = memory.record_of(dst).device_index
        tracer = metrics.tracer
        arr = tracer.copy("h2d", _adopt, flat, device_index) if tracer is not None \
            else _adopt(flat, device_index)
        _install(dst, arr)

    def _values(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values on the engine's side, flat, to read once (a host copy here)."""
        return transfers.torch_from_host(transfers.to_host(t).reshape(-1))

    def flatten_by_dtype(self, tensors: Sequence[torch.Tensor], blocks: int = 1):
        """Pack tensors of each dtype into one engine buffer, for one engine call per dtype.

        With ``blocks = b`` the buffer is viewed as ``b`` equal blocks and block ``r`` holds the
        ``r``-th of ``b`` equal pieces of every tensor, in order (the layout reduce-scatter needs).
        Returns ``[(flat, [(index, tensor, (start, numel)), ...]), ...]``, ``start`` counting the
        elements before this tensor in unblocked order.
        """
        by_dtype: dict[torch.dtype, list] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append((i, t))
        packed = []
        for dtype, items in by_dtype.items():
            total = sum(t.numel() for _, t in items)
            flat = self.buffer((total,), dtype, items[0][1].device.index or 0)
            rows = flat.view(blocks, total // blocks) if total else None
            members, start = [], 0
            for i, t in items:
                n = t.numel()
                if n % blocks:
                    raise RuntimeError(
                        f"torchneuron: a reduce-scatter input of shape {list(t.shape)} ({n} elements) does "
                        f"not split into {blocks} equal shards; pad it to a multiple of the group size.")
                if n:
                    rows[:, start // blocks:(start + n) // blocks] = self._values(t).view(blocks, n // blocks)
                members.append((i, t, (start, n)))
                start += n
            packed.append((flat, members))
        return packed

    def unflatten_to_device(self, flat: torch.Tensor, members) -> None:
        for _, t, (start, n) in members:
            self.to_device(t, flat[start:start + n].view(t.shape))


class SharedStaging(HostStaging):
    """Collectives on engine tensors that share memory with the device buffers (DLPack)."""

    name = "shared"

    def __init__(self, cuda: bool):
        self.cuda = cuda   # the engine's tensors are torch CUDA tensors (NCCL), else CPU (gloo)
        self._cuda_devices: set[int] = set()   # the torch CUDA devices the group's tensors were on

    def engine_device(self, device_index: int) -> torch.device:
        if not self.cuda:
            return torch.device("cpu")
        # The GPU JAX runs neuron:<device_index> on, as torch numbers it (same CUDA_VISIBLE_DEVICES).
        index = pjrt.device(device_index).local_hardware_id
        self._cuda_devices.add(index)
        return torch.device("cuda", index)

    def buffer(self, shape, dtype: torch.dtype, device_index: int = 0) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.engine_device(device_index))

    def _view(self, t: torch.Tensor) -> torch.Tensor | None:
        """A zero-copy engine view of ``t``'s device buffer with ``t``'s layout, or None where the
        buffer's element type is not ``t``'s (float64 held as float32)."""
        rec = memory.record_of(t)
        if rec.dtype != t.dtype:
            return None
        whole = torch.from_dlpack(memory.empty_buffer(rec))
        if self.cuda:
            self._cuda_devices.add(whole.device.index)
        return whole.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return self.buffer(t.shape, t.dtype, memory.record_of(t).device_index)
        view = self._view(t)
        if view is None:   # through the host, converted as HostStaging would
            return super()._values(t).view(t.shape).to(self.engine_device(memory.record_of(t).device_index))
        copy = view.contiguous() if not view.is_contiguous() else view.clone()
        if self.cuda:
            # The view holds a reference PJRT must not see when it next donates the buffer, and
            # the copy runs on torch's stream: finish it before the view goes.
            torch.cuda.current_stream(copy.device).synchronize()
        del view
        return copy

    def to_engine(self, t: torch.Tensor) -> torch.Tensor:
        return self._copy(t)

    def _values(self, t: torch.Tensor) -> torch.Tensor:
        return self._copy(t).view(-1)

    def settle(self, work) -> None:
        if self.cuda:
            # NCCL's results are ready on its stream; make torch's stream wait for it, then the host,
            # so PJRT may read them on its own stream.
            work.wait()
            for index in self._cuda_devices:
                torch.cuda.synchronize(index)

    def to_device(self, dst: torch.Tensor, result: torch.Tensor) -> None:
        if dst.numel() == 0:
            return
        rec = memory.record_of(dst)
        result = result.contiguous().view(-1)
        if result.dtype != rec.dtype:
            # float64 held as float32 and the like: the host path converts as uploads do.
            return super().to_device(dst, result.cpu() if self.cuda else result)
        arr = jax_dlpack.from_dlpack(result, device=pjrt.device(rec.device_index))
        _install(dst, arr)


def transport(choice: str, platform: str) -> tuple[HostStaging, str]:
    """The staging for ``config.collectives`` (``choice``) on ``platform``, and the engine's name
    (``"nccl"`` or ``"gloo"``)."""
    cuda = platform in ("cuda", "gpu") and torch.cuda.is_available()
    nccl = cuda and torch.distributed.is_nccl_available()
    if choice == "host" or (choice == "auto" and not nccl):
        return HostStaging(), "gloo"
    if choice == "shared" and cuda and not nccl:
        raise RuntimeError(
            "torchneuron: collectives='shared' on the CUDA platform needs NCCL, and this torch has none "
            "(torch.distributed.is_nccl_available() is False); use TORCHNEURON_COLLECTIVES=host.")
    return SharedStaging(cuda=nccl), "nccl" if nccl else "gloo"


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    if not tensors:
        return "no tensors"
    shown = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors[:4])
    more = f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
    return f"[{shown}{more}] ({tensors[0].device})"
