"""Dtype facts lowerings share: reduction identities for any dtype (bool included, where iinfo
fails) and the compute dtype of half-precision inputs."""

from __future__ import annotations

import jax.numpy as jnp


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
