"""Registers neuron (PrivateUse1) kernels with the PyTorch dispatcher.

From the lowering table: each lowered overload, plus its in-place (``add_.Tensor``) and ``out=``
(``add.out``) variants derived from the schema. By hand: allocation, copies, ``.item()``, the
metadata-only view ops (which reuse PyTorch's CPU kernels: they only build sizes/strides over the
same storage), storage swaps and resizes, and the global fallback.
"""

from __future__ import annotations

import warnings

import torch

from ..ops import registry
from ..runtime import memory, transfers
from ..runtime.dtypes import device_dtype, jax_dtype
from .fallback import neuron_fallback
from .kernel import Kernel

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_libs: list = []
_kernels: dict[str, object] = {}

# Ops whose CPU kernel only builds metadata on the same storage: they work unchanged on neuron.
_METADATA_OPS = [
    "view.default", "as_strided.default", "_reshape_alias.default", "unfold.default",
    "view_as_real.default", "view_as_complex.default", "set_.source_Storage",
    "set_.source_Storage_storage_offset", "set_.default", "as_strided_.default",
]


def _overload(name: str):
    packet, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), ov or "default")


def _key(op) -> str:
    """Registry spelling of an overload: "add_.Tensor", "index_put_.default"."""
    schema = op._schema
    return f"{schema.name.split('::', 1)[1]}.{schema.overload_name or 'default'}"


def kernel_for(name: str):
    return _kernels[name]


def _schema_key(op, skip_out=False):
    args = op._schema.arguments
    return tuple((a.name, str(a.type)) for a in args
                 if not (skip_out and a.alias_info is not None and a.alias_info.is_write and a.kwarg_only))


def _find_variants(name: str):
    """The in-place and out= overloads that compute the same thing as functional ``name``."""
    packet_name, _, ov = name.partition(".")
    ov = ov or "default"
    functional = _overload(name)
    if any(a.alias_info is not None and a.alias_info.is_write for a in functional._schema.arguments):
        return None, None
    inplace = None
    inplace_packet = getattr(torch.ops.aten, packet_name + "_", None)
    if inplace_packet is not None and ov in inplace_packet.overloads():
        inplace = getattr(inplace_packet, ov)
    want = tuple((n, t) for n, t in _schema_key(functional))
    out = None
    for cand in getattr(torch.ops.aten, packet_name).overloads():
        op = getattr(getattr(torch.ops.aten, packet_name), cand)
        writes = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if writes and all(a.kwarg_only for a in writes) and _schema_key(op, skip_out=True) == want:
            out = op
            break
    return inplace, out


class OutKernel:
    """``op.out(..., out=t)``: the functional kernel, then a write (or storage swap) into ``out``."""

    def __init__(self, overload, functional_kernel):
        self.overload = overload
        self.functional = functional_kernel
        args = overload._schema.arguments
        self.out_names = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
        self.names = [a.name for a in args]

    def __call__(self, *args, **kwargs):
        outs = [kwargs.pop(n) for n in self.out_names]
        result = self.functional(*args, **kwargs)
        results = result if isinstance(result, tuple) else (result,)
        for out, value in zip(outs, results):
            write_out(out, value, self.functional.short_name)
        return outs[0] if len(outs) == 1 else tuple(outs)


def write_out(out: torch.Tensor, value: torch.Tensor, op_name: str) -> None:
    if out.shape != value.shape:
        if out.numel() != 0:
            warnings.warn(
                f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                f"which does not match the required output shape {list(value.shape)}. This behavior is "
                "deprecated, and in a future PyTorch release outputs will not be resized unless they "
                "have zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, "
                "to zero elements with t.resize_(0).", stacklevel=3)
        if out.dtype == value.dtype:
            _swap_storage(out, value)
            return
        out.resize_(value.shape)
    if out.dtype != value.dtype and not torch.can_cast(value.dtype, out.dtype):
        raise RuntimeError(f"result type {_dtype_name(value.dtype)} can't be cast to the desired output "
                           f"type {_dtype_name(out.dtype)}")
    with torch.no_grad():
        out.copy_(value)


def _dtype_name(dtype):
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(dtype, str(dtype))


def _swap_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, dst, src.untyped_storage(), src.storage_offset(), src.shape, src.stride())


def _device_index(device) -> int:
    from ..runtime.device import current_device
    if device is None:
        return current_device()
    device = torch.device(device)
    if device.type != "neuron":
        raise RuntimeError(f"torchneuron: expected a neuron device, got {device}")
    index = current_device() if device.index is None else device.index
    from ..runtime import pjrt
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
    return memory.allocator.new_tensor(size, tuple(strides), dtype, _device_index(device))


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = device_dtype(dtype or torch.get_default_dtype(), "empty_strided")
    jax_dtype(dtype)
    return memory.allocator.new_tensor(tuple(int(s) for s in size), tuple(int(s) for s in stride), dtype,
                                       _device_index(device))


def resize_(self, size, memory_format=None):
    size = tuple(int(s) for s in size)
    numel = 1
    for s in size:
        numel *= s
    needed = (self.storage_offset() + numel) * self.element_size()
    if needed > self.untyped_storage().nbytes():
        # Grow: a new storage that keeps the old bytes as its prefix, as PyTorch does.
        old = transfers.device_array(self.view(-1)) if self.numel() else None
        fresh = memory.allocator.new_tensor((self.storage_offset() + numel,), (1,), self.dtype,
                                            self.device.index or 0)
        if old is not None:
            with torch.no_grad():
                fresh[self.storage_offset(): self.storage_offset() + self.numel()].copy_(self.view(-1))
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


def _redispatch_cpu(overload):
    def kernel(*args, **kwargs):
        return overload.redispatch(_CPU, *args, **kwargs)
    return kernel


def _is_composite_implicit(op) -> bool:
    """Ops PyTorch decomposes above the backend (autograd comes from the decomposition): a backend
    kernel would bypass their derivative, so eager mode leaves them alone; graphs still use them."""
    schema = op._schema
    qualname = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeImplicitAutograd")


def _kernel_table() -> dict:
    """ATen overload name -> PrivateUse1 kernel, for everything torchneuron implements."""
    from .. import ops  # noqa: F401  (imports every lowering module)
    from ..config import config
    from . import host_ops

    table = {}
    for name, low in registry.LOWERINGS.items():
        if low.graph_only or (low.platforms is not None and config.platform not in low.platforms):
            continue
        try:
            overload = _overload(name)
        except AttributeError:
            raise RuntimeError(f"torchneuron: lowering registered for unknown op aten::{name}") from None
        if _is_composite_implicit(overload):
            continue
        table.setdefault(name, Kernel(overload, low))
        if not low.derive_variants:
            continue
        inplace, out = _find_variants(name)
        if inplace is not None and not _is_composite_implicit(inplace):
            iname = _key(inplace)
            if iname not in registry.LOWERINGS:
                table[iname] = Kernel(inplace, low, functional=overload)
        if out is not None and not _is_composite_implicit(out):
            oname = _key(out)
            if oname not in registry.LOWERINGS:
                table[oname] = OutKernel(out, table[name])
    _kernels.update(table)

    # Data-dependent shapes and host-side decisions wrap or replace some of them.
    table["index.Tensor"] = host_ops.make_index(table["index.Tensor"])
    table["index_put.default"] = host_ops.make_index_put(table["index_put.default"], table["masked_fill.Tensor"])
    for name in ("index_put_.default", "_index_put_impl_.default"):
        table[name] = host_ops.make_index_put(table[name], table["masked_fill_.Tensor"])
    from ..ops import data_dependent
    table.update(data_dependent.KERNELS)
    from ..ops import hf_ops
    table.update(hf_ops.kernels(table))
    table["nonzero.default"] = host_ops.nonzero
    table["masked_select.default"] = host_ops.masked_select
    table["_fused_sdp_choice.default"] = host_ops.fused_sdp_choice
    table["repeat_interleave.Tensor"] = host_ops.repeat_interleave_tensor

    table["empty.memory_format"] = empty_memory_format
    table["empty_strided.default"] = empty_strided
    table["copy_.default"] = transfers.copy_
    table["_to_copy.default"] = transfers.to_copy
    table["_copy_from.default"] = lambda self, dst, non_blocking=False: transfers.copy_(dst, self, non_blocking)
    table["_local_scalar_dense.default"] = transfers.local_scalar_dense
    table["resize_.default"] = resize_
    for name in _METADATA_OPS:
        table[name] = _redispatch_cpu(_overload(name))
    for name, read in _MATH_BIT_FALLTHROUGH.items():
        if name in table:
            table[name] = _resolving_math_bits(table[name], read)
    return table


# PyTorch lets these ops through its Conjugate/Negative fallbacks with a lazy conj/neg bit still set
# on an input (CPU and CUDA fold it into the BLAS call); neuron reads raw storages, so it
# materialises such inputs first. Checking the bits costs ~1 us per tensor, so only these pay it.
_MATH_BIT_FALLTHROUGH = {   # op -> positions of the tensors it reads
    "copy_.default": (1,), "_copy_from.default": (0,), "clone.default": (0,), "mm.default": (0, 1),
    "bmm.default": (0, 1), "dot.default": (0, 1), "vdot.default": (0, 1), "addmm.default": (0, 1, 2),
    "addmm_.default": (0, 1, 2), "baddbmm.default": (0, 1, 2), "baddbmm_.default": (0, 1, 2),
    "linalg_solve_triangular.default": (0, 1),
}


def _resolve_bits(v):
    if isinstance(v, torch.Tensor):
        # Not resolve_conj(): it copies through copy_, which is one of these kernels.
        if v.is_conj():
            v = _kernels["_conj_physical.default"](v.conj())   # conj() of a conj view clears the bit
        if v.is_neg():
            v = _kernels["neg.default"](v._neg_view())
    return v


def _resolving_math_bits(kernel, read):
    def resolved(*args, **kwargs):
        if any(i < len(args) and _has_bits(args[i]) for i in read):
            args = [_resolve_bits(a) if i in read else a for i, a in enumerate(args)]
        return kernel(*args, **kwargs)
    return resolved


def _has_bits(v):
    return isinstance(v, torch.Tensor) and (v.is_conj() or v.is_neg())


def register_all() -> None:
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    for name, fn in _kernel_table().items():
        lib.impl(name.removesuffix(".default"), fn, "PrivateUse1")
    from ..ops import rnn
    rnn.install(lib)   # fused LSTM/GRU/RNN: an autograd kernel, as these ATen ops are composite
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(neuron_fallback, "PrivateUse1")
    _libs.append(fallback_lib)
