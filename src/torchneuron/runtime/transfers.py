"""Host <-> device copies, the ``copy_`` kernel, and reading values back to the host."""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import torch

from ..metrics import metrics
from . import memory
from .dtypes import jax_dtype


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's contents as a numpy array (bfloat16 through ml_dtypes)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.numpy()
    return t.numpy()


def torch_from_host(a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:
        a = np.array(a)   # arrays read back from PJRT are read-only views
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).reshape(a.shape)).view(torch.bfloat16)
    # ascontiguousarray turns 0-d arrays into 1-d ones: keep the shape.
    return torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape))


@functools.lru_cache(maxsize=4096)
def _reader(buf_shape, buf_dtype, dtype, sizes, strides, offset):
    from ..eager import layout
    return jax.jit(lambda buf: layout.read(buf, dtype, sizes, strides, offset))


def device_array(t: torch.Tensor, host: bool = False):
    """The logical contents of a neuron tensor as a jax.Array (no host copy), or with ``host`` as a
    NumPy array (a tensor covering its whole buffer is then reshaped on the host: no device op)."""
    if t.numel() == 0:
        return jax.numpy.zeros(tuple(t.shape), dtype=jax_dtype(t.dtype))
    rec = memory.record_of(t)
    buf = memory.empty_buffer(rec)
    sizes, strides, offset = tuple(t.shape), t.stride(), t.storage_offset()
    dtype = np.dtype(jax_dtype(t.dtype))
    from ..eager import layout
    if offset == 0 and buf.dtype == dtype and layout.is_contiguous(sizes, strides) \
            and buf.shape[0] == t.numel():
        return np.asarray(buf).reshape(sizes) if host else buf.reshape(sizes)
    return _reader(buf.shape, buf.dtype, dtype, sizes, tuple(strides), offset)(buf)


def to_host(t: torch.Tensor) -> np.ndarray:
    tracer = metrics.tracer
    if tracer is not None:   # profiler ranges / readiness report: see torchneuron.profiler
        return tracer.copy("d2h", _to_host, t)
    return _to_host(t)


def _to_host(t: torch.Tensor) -> np.ndarray:
    arr = np.asarray(device_array(t, host=True))
    metrics.d2h_copies += 1
    metrics.d2h_bytes += arr.nbytes
    return arr


def upload(host: np.ndarray, device_index: int):
    tracer = metrics.tracer
    if tracer is not None:
        return tracer.copy("h2d", _upload, host, device_index)
    return _upload(host, device_index)


def _upload(host: np.ndarray, device_index: int):
    metrics.h2d_copies += 1
    metrics.h2d_bytes += host.nbytes
    # The transfer may complete asynchronously: hand PJRT a private copy so that later writes to
    # the caller's CPU tensor cannot race with it.
    return memory.jax_put(np.array(host, copy=True), device_index)


def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``Tensor.copy_`` for every pair of devices that involves neuron."""
    if self.device.type != "neuron":
        # device -> host: read the neuron tensor, then let the CPU copy convert and broadcast.
        if src.device.type != "neuron":
            raise RuntimeError(f"torchneuron: copy_ from {src.device} to {self.device} reached the neuron kernel")
        with torch.no_grad():
            self.copy_(torch_from_host(to_host(src)))
        return self
    if src.device.type == "neuron":
        if src.device != self.device:
            # Between neuron devices: move the logical array, then copy on the destination.
            index = self.device.index or 0
            moved = jax.device_put(device_array(src), memory.pjrt_device(index))
            src = memory.new_buffer_tensor(moved.reshape(-1), src.dtype, index, tuple(src.shape),
                                           memory.contiguous_strides(tuple(src.shape)))
        return _device_copy(self, src)
    # host -> device
    if self.numel() == 0:
        return self
    if memory.flush_pending is not None:
        memory.flush_pending("host write")  # a pending region may still write this storage
    host_src = src.detach().to(self.dtype)
    if tuple(host_src.shape) != tuple(self.shape):
        host_src = host_src.expand(self.shape)
    rec = memory.record_of(self)
    from ..eager import layout
    covers_storage = (self.storage_offset() == 0 and layout.is_contiguous(tuple(self.shape), self.stride())
                      and rec.dtype == self.dtype and rec.numel == self.numel())
    arr = upload(host_array(host_src).reshape(-1), rec.device_index)
    if covers_storage:
        rec.buf = arr
        return self
    staged = memory.new_buffer_tensor(arr, self.dtype, rec.device_index, tuple(self.shape),
                                      memory.contiguous_strides(tuple(self.shape)))
    return _device_copy(self, staged)


_copy_kernel = None


def _device_copy(dst, src):
    global _copy_kernel
    if _copy_kernel is None:
        from ..eager.registration import kernel_for
        _copy_kernel = kernel_for("copy_.default")
    return _copy_kernel(dst, src)


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def to_copy(self: torch.Tensor, *, dtype=None, layout=None, device=None, pin_memory=None,
            non_blocking=False, memory_format=None) -> torch.Tensor:
    """``aten::_to_copy`` for neuron tensors: PyTorch's composite kernel, minus pinned memory.

    ``.to("cpu", non_blocking=True)`` makes the composite kernel allocate a pinned host buffer,
    which needs a C++ PrivateUse1 hook a Python backend cannot provide. Reads back to the host are
    synchronous here, so the copy simply runs blocking (DCP and data loaders use this form).
    """
    to_host_device = device is not None and torch.device(device).type == "cpu"
    return torch.ops.aten._to_copy.default.redispatch(
        _CPU_KEYS, self, dtype=dtype, layout=layout, device=device,
        pin_memory=False if to_host_device else pin_memory,
        non_blocking=False if to_host_device else non_blocking, memory_format=memory_format)


def local_scalar_dense(t: torch.Tensor):
    value = to_host(t).reshape(()).item()
    if t.dtype.is_floating_point:
        return float(value)
    if t.dtype == torch.bool:
        return bool(value)
    if t.dtype.is_complex:
        return complex(value)
    return int(value)
