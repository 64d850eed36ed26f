"""Registers neuron (PrivateUse1) kernels with the PyTorch dispatcher.

From the lowering table: each lowered overload, plus its in-place (``add_.Tensor``) and ``out=``
(``add.out``) variants derived from the schema (``ops.signature``). By hand: allocation, copies,
``.item()`` and resizes (``storage_ops``), data-dependent shapes (``host_ops``, ``data_dependent``),
the metadata-only view ops (which reuse PyTorch's CPU kernels: they only build sizes/strides over
the same storage), the fused RNN autograd kernels (``rnn``), and the global fallback.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (imports every lowering module, filling the registry)
from ..config import config
from ..ops import registry
from ..ops.signature import (
    aten_overload,
    is_composite_implicit,
    lowers_in_eager,
    registry_name,
    variants_of,
)
from . import data_dependent, host_ops, rnn, storage_ops
from .fallback import neuron_fallback
from .kernel import Kernel
from .out_variants import OutKernel

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_libs: list = []
_kernels: dict[str, object] = {}

# Ops whose CPU kernel only builds metadata on the same storage: they work unchanged on neuron.
_METADATA_OPS = [
    "view.default", "as_strided.default", "_reshape_alias.default", "unfold.default",
    "view_as_real.default", "view_as_complex.default", "set_.source_Storage",
    "set_.source_Storage_storage_offset", "as_strided_.default",
]


def _runtime_lr(tensor_lr_kernel):
    """``_fused_adam(w)_`` with a float ``lr`` through its ``tensor_lr`` form: a float would be
    compiled into the executable, so every step of an LR schedule (Trainer's default) would compile
    anew; as a 0-dim CPU tensor it is a runtime input."""
    def fused(*args, lr, **kwargs):
        if not isinstance(lr, torch.Tensor):
            lr = torch.tensor(lr, dtype=torch.float32)
        return tensor_lr_kernel(*args, lr=lr, **kwargs)
    return fused


def _redispatch_cpu(overload):
    # The handle's boxed redispatch directly: OpOverload.redispatch is one more Python frame on
    # every view (x.t() in each Linear, x[i], reshape...).
    redispatch = overload._handle.redispatch_boxed

    def kernel(*args, **kwargs):
        return redispatch(_CPU, *args, **kwargs)
    return kernel


def _kernel_table() -> dict:
    """ATen overload name -> PrivateUse1 kernel, for everything torchneuron implements."""
    table = {}
    for name, low in registry.LOWERINGS.items():
        try:
            overload = aten_overload(name)
        except AttributeError:
            raise RuntimeError(f"torchneuron: lowering registered for unknown op aten::{name}") from None
        if not lowers_in_eager(low, overload, config.platform):
            continue
        table.setdefault(name, Kernel(overload, low))
        if not low.derive_variants:
            continue
        inplace, out = variants_of(overload)
        if inplace is not None and not is_composite_implicit(inplace):
            iname = registry_name(inplace)
            if iname not in registry.LOWERINGS:
                table[iname] = Kernel(inplace, low, functional=overload)
        if out is not None and not is_composite_implicit(out):
            oname = registry_name(out)
            if oname not in registry.LOWERINGS:
                table[oname] = OutKernel(out, table[name])
    _kernels.update(table)

    # Data-dependent shapes and host-side decisions wrap or replace some of them.
    table["index.Tensor"] = host_ops.make_index(table["index.Tensor"])
    table["index_put.default"] = host_ops.make_index_put(table["index_put.default"], table["masked_fill.Tensor"])
    for name in ("index_put_.default", "_index_put_impl_.default"):
        table[name] = host_ops.make_index_put(table[name], table["masked_fill_.Tensor"])
    table.update(data_dependent.KERNELS)
    for name in ("_fused_adamw_", "_fused_adam_"):
        if f"{name}.tensor_lr" in table:
            table[f"{name}.default"] = _runtime_lr(table[f"{name}.tensor_lr"])
    for name, (api, info_index) in host_ops.CHECKED_EX.items():
        for variant in [n for n in table if n.split(".", 1)[0] == name]:   # functional and out=
            table[variant] = host_ops.make_check_errors(table[variant], api, info_index)
    table["nonzero.default"] = host_ops.nonzero
    table["masked_select.default"] = host_ops.masked_select
    table["_fused_sdp_choice.default"] = host_ops.fused_sdp_choice
    table["repeat_interleave.Tensor"] = host_ops.repeat_interleave_tensor

    storage_ops.device_copy_kernel = table["copy_.default"]
    table["empty.memory_format"] = storage_ops.empty_memory_format
    table["empty_strided.default"] = storage_ops.empty_strided
    table["copy_.default"] = storage_ops.copy_
    table["_to_copy.default"] = storage_ops.to_copy
    table["_copy_from.default"] = storage_ops.copy_from
    table["_local_scalar_dense.default"] = storage_ops.local_scalar_dense
    table["resize_.default"] = storage_ops.resize_
    # set_(tensor) shares the source's storage, set_() makes an empty one on the tensor's device
    # (through CPU's kernels, set_(tensor) got a copy and set_() a CPU storage).
    table["set_.source_Tensor"] = storage_ops.set_tensor_
    table["set_.default"] = storage_ops.set_empty_
    table["is_set_to.default"] = storage_ops.is_set_to
    table["_lazy_clone.default"] = storage_ops.lazy_clone
    for name in _METADATA_OPS:
        table[name] = _redispatch_cpu(aten_overload(name))
    for name, read in _MATH_BIT_FALLTHROUGH.items():
        if name in table:
            table[name] = _resolving_math_bits(table[name], read)
    table["copy_.default"] = _copy_with_math_bits(table["copy_.default"])
    return table


# PyTorch lets these ops through its Conjugate/Negative fallbacks with a lazy conj/neg bit still set
# on an input (CPU and CUDA fold it into the BLAS call); neuron reads raw storages, so it
# materialises such inputs first. Checking the bits costs ~1 us per tensor, so only these pay it.
_MATH_BIT_FALLTHROUGH = {   # op -> positions of the tensors it reads
    "_copy_from.default": (0,), "clone.default": (0,), "mm.default": (0, 1),
    "bmm.default": (0, 1), "dot.default": (0, 1), "vdot.default": (0, 1), "addmm.default": (0, 1, 2),
    "addmm_.default": (0, 1, 2), "baddbmm.default": (0, 1, 2), "baddbmm_.default": (0, 1, 2),
    "linalg_solve_triangular.default": (0, 1),
}


def _resolve_bits(v):
    if isinstance(v, torch.Tensor):
        # Not resolve_conj(): it copies through copy_, which is one of these kernels.
        conj, neg = v.is_conj(), v.is_neg()
        # Clear both bits first (conj() of a conj view and _neg_view() of a neg view toggle them
        # off): a kernel reads the stored values, whatever bit is still set on its input.
        if conj:
            v = v.conj()
        if neg:
            v = v._neg_view()
        if conj:
            v = _kernels["_conj_physical.default"](v)
        if neg:
            v = _kernels["neg.default"](v)
    return v


def _resolving_math_bits(kernel, read):
    def resolved(*args, **kwargs):
        for i in read:   # a loop, not any(<generator>): this runs on every matmul
            if i < len(args) and _has_bits(args[i]):
                args = [_resolve_bits(a) if i in read else a for i, a in enumerate(args)]
                break
        return kernel(*args, **kwargs)
    return resolved


def _copy_with_math_bits(copy_kernel):
    """``copy_`` reads a source's lazy conj/neg bits (as the other ops of _MATH_BIT_FALLTHROUGH),
    and into a destination with such a bit stores conj(src)/-src, so that it reads back src:
    PyTorch's math-bit fallbacks run an in-place op on such a tensor (``x.conj().triu_()``) on a
    resolved copy and write the result back with this ``copy_``."""
    def copy_(self, src, non_blocking=False):
        if not (self.is_conj() or self.is_neg()):
            if src.is_conj() or src.is_neg():
                src = _resolve_bits(src)
            return copy_kernel(self, src, non_blocking)
        conj, neg = self.is_conj(), self.is_neg()
        plain = self.conj() if conj else self          # the same storage, bits cleared
        plain = plain._neg_view() if neg else plain
        src = _resolve_bits(src.to(self.device, self.dtype))
        if conj:
            src = _kernels["_conj_physical.default"](src)
        if neg:
            src = _kernels["neg.default"](src)
        copy_kernel(plain, src, non_blocking)
        return self
    return copy_


def _has_bits(v):
    return isinstance(v, torch.Tensor) and (v.is_conj() or v.is_neg())


def register_all() -> None:
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    for name, fn in _kernel_table().items():
        lib.impl(name.removesuffix(".default"), fn, "PrivateUse1")
    rnn.install(lib)   # fused LSTM/GRU/RNN: an autograd kernel, as these ATen ops are composite
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(neuron_fallback, "PrivateUse1")
    _libs.append(fallback_lib)
