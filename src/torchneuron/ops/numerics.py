"""Dtype facts lowerings share: reduction identities for any dtype (bool included, where iinfo
fails) and the compute dtype of half-precision inputs."""

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


# ATen's names for dtypes in "not implemented for 'Int'" messages.
_ATEN_NAMES = {np.dtype(np.uint8): "Byte", np.dtype(np.int8): "Char", np.dtype(np.int16): "Short",
               np.dtype(np.int32): "Int", np.dtype(np.int64): "Long", np.dtype(np.bool_): "Bool"}


def require_floating(op: str, x, also=()) -> None:
    """Refuse, as PyTorch's CPU kernel does, an input of a dtype ``op`` computes only for floating
    point (and the dtypes in ``also``)."""
    dtype = np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.inexact) or dtype in [np.dtype(d) for d in also]:
        return
    raise NotImplementedForDtype(f'"{op}" not implemented for \'{_ATEN_NAMES.get(dtype, str(dtype))}\' '
                                 "(as on CPU: convert the input with .float() first)")
