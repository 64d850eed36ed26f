"""``out=`` overloads: the functional kernel's result written into the caller's tensors.

PyTorch's out= rules differ per op (``neg`` wants an out of its own dtype, ``add`` casts, ``mm``
wants the same dtype, ``sum`` casts) and meta kernels apply them only in part, so the first call
with each combination of out and result dtypes asks CPU PyTorch (``eager/oracle.py``); later calls
pay one set lookup. Out tensors on another device are refused, as on CUDA.
"""

from __future__ import annotations

import torch

from ..ops.signature import OpSignature, out_names
from ..runtime import sites
from ..runtime.device import device_mismatch_error
from ..runtime.dtypes import dtype_name
from . import oracle
from .kernel import describe_args

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class OutKernel:
    """``op.out(..., out=t)``: the functional kernel, then a write (or storage swap) into ``out``."""

    def __init__(self, overload, functional_kernel):
        self.overload = overload
        self.functional = functional_kernel
        self.out_names = out_names(overload)
        self.signature = OpSignature(overload, None)
        self.checked: set = set()   # (out dtypes, result dtypes) whose out= rules CPU accepted
        # Reductions take their computation dtype from ``out`` when no ``dtype`` is given (ATen's
        # infer_dtype_from_optional): sum(float, out=int64) sums int64 values; torch.range computes in
        # out's dtype (linspace/logspace/arange: eager/fallback.py's _keep_out_shape).
        self.dtype_from_out = (overload._schema.name.split("::", 1)[1] in DTYPE_FROM_OUT
                               and "dtype" in getattr(functional_kernel, "index_of", ()))

    def __call__(self, *args, **kwargs):
        outs = [kwargs.pop(n) for n in self.out_names]
        call = kwargs
        if self.dtype_from_out and kwargs.get("dtype") is None:
            call = dict(kwargs, dtype=outs[0].dtype)
        result = self.functional(*args, **call)
        results = result if isinstance(result, tuple) else (result,)
        check_out_devices(outs, results[0].device)
        key = (tuple(o.dtype for o in outs), tuple(v.dtype for v in results))
        checked = key in self.checked
        if _shares_storage(outs, args, kwargs):
            # Whether an out= tensor may overlap an input is a fact of this call's views, not of
            # the dtypes: checked on every such call (CPU's replay, or ATen's rules past its limit).
            values = self.signature.bind(args, dict(kwargs, **dict(zip(self.out_names, outs))))
            oracle.check_overlaps(self.signature, values, describe_args)
        if not checked:
            values = self.signature.bind(args, dict(kwargs, **dict(zip(self.out_names, outs))))
            err = oracle.cpu_error(self.overload, values, self.signature.kwarg_only, self.signature.arg_names)
            if err is not None:
                raise oracle.as_cpu_error(err, self.signature.name, describe_args(values)) from None
            # No verdict (an op CPU cannot replay, a replay too large to make): write_out checks
            # the cast itself.
            checked = oracle.replays(self.overload) and not oracle.too_large(values)
            if checked:
                self.checked.add(key)
        for out, value in zip(outs, results):
            write_out(out, value, self.functional.short_name, cast_checked=checked)
        return outs[0] if len(outs) == 1 else tuple(outs)


DTYPE_FROM_OUT = {"sum", "nansum", "prod", "cumsum", "cumprod", "range"}


def check_out_devices(outs, device) -> None:
    """out= tensors live on the op's device (CUDA's rule; writing a CPU tensor from a neuron op
    would hide a transfer and is an error there)."""
    for out in outs:
        if isinstance(out, torch.Tensor) and out.device != device:
            raise device_mismatch_error(out, device.index or 0)


def write_out(out: torch.Tensor, value: torch.Tensor, op_name: str, cast_checked: bool = False) -> None:
    if out.shape != value.shape:
        if out.numel() != 0:
            sites.warn(
                f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                f"which does not match the required output shape {list(value.shape)}. This behavior is "
                "deprecated, and in a future PyTorch release outputs will not be resized unless they "
                "have zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, "
                "to zero elements with t.resize_(0).")
        if out.dtype == value.dtype:
            _swap_storage(out, value)
            return
        out.resize_(value.shape)
    if not cast_checked and out.dtype != value.dtype and not torch.can_cast(value.dtype, out.dtype):
        raise RuntimeError(f"result type {dtype_name(value.dtype)} can't be cast to the desired output "
                           f"type {dtype_name(out.dtype)}")
    with torch.no_grad():
        out.copy_(value)


def _swap_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, dst, src.untyped_storage(), src.storage_offset(), src.shape, src.stride())


def _shares_storage(outs, args, kwargs) -> bool:
    """Whether an out= tensor shares its storage with a tensor argument (list elements included)."""
    ptrs = {o.untyped_storage().data_ptr() for o in outs if isinstance(o, torch.Tensor)}

    def tensors(v):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, list | tuple):
            for x in v:
                yield from tensors(x)

    return any(t.untyped_storage().data_ptr() in ptrs
               for v in (*args, *kwargs.values()) for t in tensors(v))
