"""Dtype facts lowerings share: reduction identities for any dtype (bool included, where iinfo
fails), the compute dtype of half-precision inputs, and ATen's dtype errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .registry import NotImplementedForDtype


def lowest(dtype):
    """The value every element of ``dtype`` is >= to: -inf, the integer minimum, or False."""
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf
    if dtype == jnp.bool_:
        return False
    return jnp.iinfo(dtype).min


def highest(dtype):
    """The value every element of ``dtype`` is <= to: inf, the integer maximum, or True."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf
    if dtype == jnp.bool_:
        return True
    return jnp.iinfo(dtype).max


def compute_dtype(dtype):
    """The dtype a lowering computes in: float32 for float16/bfloat16 (ATen's opmath type)."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


# ATen's names for the dtypes its errors mention ("not implemented for 'Long'").
_SCALAR_TYPE_NAMES = {jnp.dtype(k): v for k, v in (
    (jnp.int64, "Long"), (jnp.int32, "Int"), (jnp.int16, "Short"), (jnp.int8, "Char"),
    (jnp.uint8, "Byte"), (jnp.bool_, "Bool"), (jnp.float16, "Half"), (jnp.bfloat16, "BFloat16"),
    (jnp.float32, "Float"), (jnp.float64, "Double"), (jnp.complex64, "ComplexFloat"),
    (jnp.complex128, "ComplexDouble"))}


def scalar_type_name(dtype) -> str:
    return _SCALAR_TYPE_NAMES.get(jnp.dtype(dtype), str(dtype))


def require_floating(op: str, *arrays, also=(), allow_complex=True) -> None:
    """Refuse, as PyTorch's CPU kernel does, inputs of a dtype ``op`` computes only for floating
    point (complex too unless ``allow_complex`` is False; plus the dtypes in ``also``)."""
    dtype = np.dtype(jnp.result_type(*arrays))
    accepted = jnp.inexact if allow_complex else jnp.floating
    if jnp.issubdtype(dtype, accepted) or dtype in [np.dtype(d) for d in also]:
        return
    raise NotImplementedForDtype(f'"{op}" not implemented for \'{scalar_type_name(dtype)}\' '
                                 "(as on CPU: convert the input with .float() first)")
