"""``out=`` overloads: the functional kernel's result written into the caller's tensors."""

from __future__ import annotations

import warnings

import torch

from ..ops.signature import out_names

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class OutKernel:
    """``op.out(..., out=t)``: the functional kernel, then a write (or storage swap) into ``out``."""

    def __init__(self, overload, functional_kernel):
        self.overload = overload
        self.functional = functional_kernel
        self.out_names = out_names(overload)

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
