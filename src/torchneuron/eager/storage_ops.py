"""Dispatcher kernels that allocate, resize, copy and read back neuron storages.

Allocation (``empty``, ``empty_strided``) makes DLPack-backed storages (``runtime.memory``);
``copy_`` moves data between the host, neuron devices and views (device-to-device copies inside a
storage run the lowered ``copy_`` kernel); ``_local_scalar_dense`` is ``.item()``.
"""

from __future__ import annotations

import jax
import torch

from ..runtime import memory, pjrt, transfers
from ..runtime.device import current_device
from ..runtime.dtypes import device_dtype, jax_dtype
from ..runtime.layout import is_contiguous

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _device_index(device) -> int:
    if device is None:
        return current_device()
    device = torch.device(device)
    if device.type != "neuron":
        raise RuntimeError(f"torchneuron: expected a neuron device, got {device}")
    index = current_device() if device.index is None else device.index
    pjrt.device(index)  # validates the index with a clear error
    return index


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = device_dtype(dtype or torch.get_default_dtype(), "empty")
    jax_dtype(dtype)
    size = tuple(int(s) for s in size)
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        strides = memory.contiguous_strides(size)
    else:
        strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return _deterministic_fill(memory.allocator.new_tensor(size, tuple(strides), dtype, _device_index(device)))


def _deterministic_fill(t: torch.Tensor) -> torch.Tensor:
    """With torch.use_deterministic_algorithms(True) (and fill_uninitialized_memory, its default),
    new memory holds NaN or the dtype's largest value, as ATen's empty kernels fill it."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        else:
            t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
    return t


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    if len(size) != len(stride):   # CPU's check (the meta kernel is not consulted here)
        raise RuntimeError(f"dimensionality of sizes ({len(size)}) must match dimensionality of strides "
                           f"({len(stride)})")
    dtype = device_dtype(dtype or torch.get_default_dtype(), "empty_strided")
    jax_dtype(dtype)
    return _deterministic_fill(memory.allocator.new_tensor(
        tuple(int(s) for s in size), tuple(int(s) for s in stride), dtype, _device_index(device)))


def resize_(self, size, memory_format=None):
    size = tuple(int(s) for s in size)
    numel = 1
    for s in size:
        numel *= s
    if numel > memory.INT64_MAX:   # CPU's check, before any storage size is computed
        raise RuntimeError("numel: integer multiplication overflow")
    needed = (self.storage_offset() + numel) * self.element_size()
    if needed > self.untyped_storage().nbytes():
        # Grow: a new storage that keeps the whole old storage as its prefix, as PyTorch does (not
        # only this tensor's elements: a view may be resized, and its storage holds other data).
        old_numel = self.untyped_storage().nbytes() // self.element_size()
        fresh = memory.allocator.new_tensor((self.storage_offset() + numel,), (1,), self.dtype,
                                            self.device.index or 0)
        _deterministic_fill(fresh[old_numel:])   # the grown part, as ATen's resize fills it
        if old_numel:
            old = torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
                _CPU, self.new_empty(0), self.untyped_storage(), 0, (old_numel,), (1,))
            with torch.no_grad():
                fresh[:old_numel].copy_(old)
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU, self, fresh.untyped_storage(), self.storage_offset(), size,
            memory.contiguous_strides(size))
    else:
        strides = memory.contiguous_strides(size)
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU, self, self.untyped_storage(), self.storage_offset(), size, strides)
    return self


def set_tensor_(self, source):
    """``t.set_(source)``: ``t`` shares ``source``'s storage, offset, sizes and strides, as ATen's
    set_ does (run on CPU, ``t`` would get a copy: writes through one would miss the other)."""
    if source.dtype != self.dtype:   # ATen's check and text
        raise RuntimeError(f"Could not set tensor of type {_type_name(source.dtype)} to a tensor of type "
                           f"{_type_name(self.dtype)}")
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, self, source.untyped_storage(), source.storage_offset(), source.size(), source.stride())


def set_empty_(self):
    """``t.set_()``: a new empty storage on ``t``'s own device."""
    fresh = memory.allocator.new_tensor((0,), (1,), self.dtype, self.device.index or 0)
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, self, fresh.untyped_storage(), 0, (0,), (1,))


def is_set_to(self, tensor) -> bool:
    """ATen's rule: the same storage, storage offset, sizes and strides."""
    return (self.untyped_storage()._cdata == tensor.untyped_storage()._cdata
            and self.storage_offset() == tensor.storage_offset()
            and self.size() == tensor.size() and self.stride() == tensor.stride())


def _type_name(dtype) -> str:
    """ATen's C++ name of a dtype in its messages ("long int", "float")."""
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
            torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char",
            torch.bool: "bool", torch.complex64: "c10::complex<float>",
            torch.complex128: "c10::complex<double>"}.get(dtype, str(dtype))


def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``Tensor.copy_`` for every pair of devices that involves neuron."""
    if self.device.type != "neuron":
        # device -> host: read the neuron tensor, then let the CPU copy convert and broadcast.
        if src.device.type != "neuron":
            raise RuntimeError(f"torchneuron: copy_ from {src.device} to {self.device} reached the neuron kernel")
        with torch.no_grad():
            self.copy_(transfers.torch_from_host(transfers.to_host(src)))
        return self
    if src.device.type == "neuron":
        if src.device != self.device:
            # Between neuron devices: move the logical array, then copy on the destination.
            index = self.device.index or 0
            moved = jax.device_put(transfers.device_array(src), memory.pjrt_device(index))
            src = memory.new_buffer_tensor(moved.reshape(-1), src.dtype, index, tuple(src.shape),
                                           memory.contiguous_strides(tuple(src.shape)))
        return _device_copy(self, src)
    # host -> device
    if self.numel() == 0:
        return self
    memory.flush_pending("host write")  # a pending region may still write this storage
    host_src = src.detach().to(self.dtype)
    if tuple(host_src.shape) != tuple(self.shape):
        host_src = host_src.expand(self.shape)
    rec = memory.record_of(self)
    covers_storage = (self.storage_offset() == 0 and is_contiguous(tuple(self.shape), self.stride())
                      and rec.dtype == self.dtype and rec.numel == self.numel())
    arr = transfers.upload(transfers.host_array(host_src).reshape(-1), rec.device_index)
    if covers_storage:
        rec.buf = arr
        return self
    staged = memory.new_buffer_tensor(arr, self.dtype, rec.device_index, tuple(self.shape),
                                      memory.contiguous_strides(tuple(self.shape)))
    return _device_copy(self, staged)


def _device_copy(dst, src):
    return device_copy_kernel(dst, src)


# The Kernel of aten::copy_ driven by its lowering: set by registration, which builds it before it
# registers copy_ above as the op's kernel.
device_copy_kernel = None


def to_copy(self: torch.Tensor, *, dtype=None, layout=None, device=None, pin_memory=None,
            non_blocking=False, memory_format=None) -> torch.Tensor:
    """``aten::_to_copy`` for neuron tensors: PyTorch's composite kernel, minus pinned memory.

    ``.to("cpu", non_blocking=True)`` makes the composite kernel allocate a pinned host buffer,
    which needs a C++ PrivateUse1 hook a Python backend cannot provide. Reads back to the host are
    synchronous here, so the copy simply runs blocking (DCP and data loaders use this form).
    """
    if self.device.type == "cpu" and layout in (None, torch.strided) and not pin_memory:
        direct = _upload_new(self, dtype, device, memory_format)
        if direct is not None:
            return direct
    to_host_device = device is not None and torch.device(device).type == "cpu"
    return torch.ops.aten._to_copy.default.redispatch(
        _CPU, self, dtype=dtype, layout=layout, device=device,
        pin_memory=False if to_host_device else pin_memory,
        non_blocking=False if to_host_device else non_blocking, memory_format=memory_format)


def _upload_new(src: torch.Tensor, dtype, device, memory_format):
    """``cpu_tensor.to("neuron")`` of a dense tensor that keeps its dtype: one upload wrapped as the
    new tensor, without the composite kernel's ``empty_strided`` + ``copy_`` (two more trips
    through the dispatcher, ~40% of a small upload's host time). None where that path is needed:
    a dtype change, a layout other than contiguous, an empty tensor."""
    if (dtype is not None and dtype != src.dtype) or device is None or src.numel() == 0:
        return None
    if torch.device(device).type != "neuron":
        return None
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        return None
    if src.dtype in (torch.float64, torch.complex128) or not src.is_contiguous():
        return None   # the float64 policy (counted, warned about) and strided copies: the full path
    jax_dtype(src.dtype)   # a dtype the device lacks: the clear error empty_strided raises
    index = _device_index(device)
    sizes = tuple(src.shape)
    arr = transfers.upload(transfers.host_array(src).reshape(-1), index)
    # Every element is written: nothing for use_deterministic_algorithms to fill.
    return memory.new_buffer_tensor(arr, src.dtype, index, sizes, memory.contiguous_strides(sizes))


def local_scalar_dense(t: torch.Tensor):
    value = transfers.read_element(t).item()
    if t.dtype.is_floating_point:
        return float(value)
    if t.dtype == torch.bool:
        return bool(value)
    if t.dtype.is_complex:
        return complex(value)
    return int(value)


def copy_from(self, dst, non_blocking=False):
    """``aten::_copy_from(self, dst)``: ``dst.copy_(self)``."""
    return copy_(dst, self, non_blocking)


def lazy_clone(self: torch.Tensor) -> torch.Tensor:
    """``torch._lazy_clone``: copy-on-write shares the allocation until a write, which needs a storage
    whose data pointer is the allocation itself; a neuron storage is a DLPack capsule (ATen refuses
    with "Expected storage != nullptr"). An eager copy gives the same values and independence."""
    return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device).copy_(self)
