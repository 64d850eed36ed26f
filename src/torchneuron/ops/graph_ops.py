"""Lowerings only torch.compile graphs need (``graph_only=True``).

AOTAutograd emits functional forms of mutating ops (``copy``, ``uniform``,
``_native_batch_norm_legit_functional``) and the factories/conversions that eager mode runs
through PyTorch's composite kernels (``_to_copy``, ``full``, ``scalar_tensor``...). The compile
interpreter casts every result to the dtype PyTorch's meta functions give, so these bodies return
values in whatever dtype is natural and leave the cast to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .registry import lowering


# -- conversions and factories ------------------------------------------------------------------
@lowering("_to_copy.default", graph_only=True)
def to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    if jnp.iscomplexobj(self) and dtype is not None and not dtype.is_complex:
        return jnp.real(self)
    return self


@lowering("copy.default", graph_only=True)
def copy(self, src, non_blocking=False):
    if jnp.iscomplexobj(src) and not jnp.iscomplexobj(self):
        src = jnp.real(src)
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@lowering("scalar_tensor.default", graph_only=True)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s)


@lowering("full.default", graph_only=True)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


@lowering("full_like.default", graph_only=True)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
    return jnp.full(self.shape, fill_value)


@lowering("new_full.default", graph_only=True)
def new_full(self, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


# Uninitialised memory is zeros here: deterministic, and XLA drops it when it is overwritten.
@lowering("empty.memory_format", "zeros.default", graph_only=True)
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), jnp.float32)


@lowering("empty_strided.default", graph_only=True)
def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), jnp.float32)


@lowering("ones.default", graph_only=True)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), jnp.float32)


@lowering("empty_like.default", "zeros_like.default", graph_only=True)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, self.dtype)


@lowering("ones_like.default", graph_only=True)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, self.dtype)


@lowering("new_zeros.default", "new_empty.default", graph_only=True)
def new_zeros(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), self.dtype)


@lowering("new_empty_strided.default", graph_only=True)
def new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), self.dtype)


@lowering("new_ones.default", graph_only=True)
def new_ones(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), self.dtype)


# -- functional forms of mutating ops -----------------------------------------------------------
@lowering("_native_batch_norm_legit_functional.default", graph_only=True)
def batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # The eager lowering returns (running_mean, running_var, out, mean, invstd); the functional op
    # returns the updated running stats last.
    legit = registry.get("_native_batch_norm_legit.default").fn
    rm, rv, out, mean, invstd = legit(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, mean, invstd, rm, rv


# -- random (keys derive from the device generator: reproducible under torch.manual_seed) -------
def _compute_dtype(dtype):
    return dtype if dtype in (jnp.float32, jnp.float64) else jnp.float32


@lowering("uniform.default", random=True, graph_only=True)
def uniform(self, from_=0.0, to=1.0, *, generator=None, key):
    return jax.random.uniform(key, self.shape, _compute_dtype(self.dtype), from_, to)


@lowering("normal_functional.default", random=True, graph_only=True)
def normal_functional(self, mean=0.0, std=1.0, *, generator=None, key):
    return jax.random.normal(key, self.shape, _compute_dtype(self.dtype)) * std + mean


@lowering("rand.default", "rand.generator", random=True, graph_only=True)
def rand(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.uniform(key, tuple(size), jnp.float32)


@lowering("randn.default", "randn.generator", random=True, graph_only=True)
def randn(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.normal(key, tuple(size), jnp.float32)


@lowering("rand_like.default", random=True, graph_only=True)
def rand_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return jax.random.uniform(key, self.shape, _compute_dtype(self.dtype))


@lowering("randn_like.default", random=True, graph_only=True)
def randn_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return jax.random.normal(key, self.shape, _compute_dtype(self.dtype))


@lowering("randint.default", random=True, graph_only=True)
def randint(high, size, *, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.randint(key, tuple(size), 0, high, dtype=jnp.int64)


@lowering("randint.low", random=True, graph_only=True)
def randint_low(low, high, size, *, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.randint(key, tuple(size), low, high, dtype=jnp.int64)
