"""Filling, copying and random lowerings (the values behind torch.zeros/full/arange/rand...)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .numerics import compute_dtype, scalar_type_name
from .registry import lowering


@lowering("fill_.Scalar", "fill_.Tensor", overwrites=True)
def fill_(self, value):
    return jnp.full(self.shape, value, dtype=self.dtype)


@lowering("zero_.default", overwrites=True)
def zero_(self):
    return jnp.zeros(self.shape, self.dtype)


@lowering("copy_.default", overwrites=True)
def copy_(self, src, non_blocking=False):
    if jnp.iscomplexobj(src) and not jnp.iscomplexobj(self):
        src = src.real
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@lowering("clone.default")
def clone(self, *, memory_format=None):
    return self


@lowering("lift_fresh_copy.default")
def lift_fresh_copy(self):
    return self


@lowering("arange.default", static_scalars=True)
def arange_end(end, **factory):
    return _arange(0, end, 1, factory.get("dtype"))


@lowering("arange.start", static_scalars=True)
def arange_start(start, end, **factory):
    return _arange(start, end, 1, factory.get("dtype"))


@lowering("arange.start_step", static_scalars=True)
def arange(start, end, step=1, **factory):
    return _arange(start, end, step, factory.get("dtype"))


@lowering("range.step", static_scalars=True)
def range_step(start, end, step=1, **factory):
    return _range(start, end, step, factory.get("dtype"))


@lowering("range.default", static_scalars=True)
def range_default(start, end, **factory):
    return _range(start, end, 1, factory.get("dtype"))


def _range(start, end, step, dtype=None):
    """torch.range (deprecated, kept for old scripts): [start, end] *with* end, sized in double."""
    n = int(math.floor((end - start) / step)) + 1
    if _is_integral(dtype):
        return int(start) + jnp.arange(max(n, 0), dtype=jnp.int64) * int(step)
    return start + jnp.arange(max(n, 0), dtype=jnp.float64) * step


def _is_integral(dtype) -> bool:
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


def _arange(start, end, step, dtype=None):
    """ATen's arange: start + i * step in its accumulate type (double for floating results, int64
    for integer ones, whose start and step are truncated first), then cast by the caller."""
    integral = _is_integral(dtype) or (
        dtype is None and all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)))
    if integral and dtype in (None, torch.int64):
        # int64 sizes its result in integer arithmetic: C's truncating division of the span.
        istart, iend, istep = int(start), int(end), int(step)
        span = iend - istart + istep - (1 if istep > 0 else -1)
        n = abs(span) // abs(istep) if span * istep > 0 else 0
    else:
        # Other dtypes size it in double from the arguments as given.
        n = max(math.ceil((end - start) / step), 0)
    if integral:
        return int(start) + jnp.arange(n, dtype=jnp.int64) * int(step)
    return start + jnp.arange(n, dtype=jnp.float64) * step


@lowering("linspace.default", static_scalars=True)
def linspace(start, end, steps, **factory):
    if _is_integral(factory.get("dtype")):
        # ATen converts the ends to an integer result's type first (truncating -10.5 to -10).
        start, end = int(start), int(end)
    if steps == 0:
        return jnp.zeros((0,), jnp.float64)
    if steps == 1:   # the start as given (a complex start stays complex); the caller casts
        return jnp.full((1,), start)
    step = (end - start) / (steps - 1)
    idx = jnp.arange(steps, dtype=jnp.float64)
    # Filled from both ends, as PyTorch does, so the last element is exactly `end`.
    return jnp.where(idx < steps // 2, start + step * idx, end - step * (steps - 1 - idx))


@lowering("_efficientzerotensor.default")
def efficient_zero_tensor(size, **_factory):
    # What autograd returns for an identically-zero gradient (sgn of a real tensor). A ZeroTensor is
    # all zeros by definition; neuron has no ZeroTensor key, so the zeros are materialised.
    return jnp.zeros(tuple(size), jnp.float32)


@lowering("eye.default")
def eye(n, **_factory):
    return jnp.eye(n, dtype=jnp.float32)


@lowering("eye.m")
def eye_m(n, m, **_factory):
    return jnp.eye(n, m, dtype=jnp.float32)


# -- random (keys come from the device generator: reproducible under torch.manual_seed) ----------
def _float_dtype(dtype):
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32


@lowering("uniform_.default", random=True, overwrites=True)
def uniform_(self, from_=0.0, to=1.0, *, generator=None, key):
    dt = _float_dtype(self.dtype)
    compute = compute_dtype(dt)
    return jax.random.uniform(key, self.shape, compute, from_, to).astype(self.dtype)


@lowering("normal_.default", random=True, overwrites=True)
def normal_(self, mean=0.0, std=1.0, *, generator=None, key):
    dt = _float_dtype(self.dtype)
    compute = compute_dtype(dt)
    return (jax.random.normal(key, self.shape, compute) * std + mean).astype(self.dtype)


@lowering("normal.Tensor_float", random=True)
def normal_tensor_float(mean, std=1.0, *, generator=None, key):
    return jax.random.normal(key, mean.shape, jnp.float32).astype(mean.dtype) * std + mean


@lowering("normal.float_Tensor", random=True)
def normal_float_tensor(mean, std, *, generator=None, key):
    return jax.random.normal(key, std.shape, jnp.float32).astype(std.dtype) * std + mean


@lowering("normal.Tensor_Tensor", random=True)
def normal_tensor_tensor(mean, std, *, generator=None, key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return jax.random.normal(key, shape, jnp.float32).astype(mean.dtype) * std + mean


@lowering("random_.from", random=True, overwrites=True)
def random_from(self, from_, to, *, generator=None, key):
    if to is None:   # [from, the dtype's largest integer]; from = int64's minimum: all 64 bits
        span = _random_max(self.dtype) - _as_u64(from_) + jnp.uint64(1)
    else:            # [from, to); the range checks ran before the call (eager/host_checks.py)
        span = _as_u64(to) - _as_u64(from_)
    return _random_ints(key, self.shape, from_, span, self.dtype)


@lowering("random_.to", random=True, overwrites=True)
def random_to(self, to, *, generator=None, key):
    return _random_ints(key, self.shape, 0, _as_u64(to), self.dtype)


@lowering("random_.default", random=True, overwrites=True)
def random_default(self, *, generator=None, key):
    # [0, the dtype's largest integer]: 2^digits for floating dtypes (every integer is exact).
    return _random_ints(key, self.shape, 0, _random_max(self.dtype) + jnp.uint64(1), self.dtype)


def _random_max(dtype):
    """The largest value random_ draws for ``dtype``, as a uint64 (ATen's ``to_inc``)."""
    if dtype == jnp.bool_:
        return jnp.uint64(1)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.uint64(int(jnp.iinfo(dtype).max))
    return jnp.uint64(2 ** min(jnp.finfo(dtype).nmant + 1, 63))


def _as_u64(v):
    """An int64 value's two's-complement bits as a uint64 (wrapping arithmetic, as in C)."""
    return jax.lax.bitcast_convert_type(jnp.asarray(v).astype(jnp.int64), jnp.uint64)


def _random_ints(key, shape, low, span, dtype):
    """Integers uniform in [low, low + span) (``span`` uint64; 0 means 2^64), as ATen draws them:
    64 random bits modulo the span, added to ``low`` in wrapping int64 arithmetic."""
    bits = jax.random.bits(key, shape, jnp.uint64)
    drawn = jnp.where(span == 0, bits, bits % jnp.where(span == 0, jnp.uint64(1), span))
    value = jax.lax.bitcast_convert_type(drawn + _as_u64(low), jnp.int64)
    if dtype == jnp.bool_:
        return value != 0
    return value.astype(dtype)


@lowering("exponential_.default", random=True, overwrites=True)
def exponential_(self, lambd=1.0, *, generator=None, key):
    return (jax.random.exponential(key, self.shape, jnp.float32) / lambd).astype(self.dtype)


@lowering("geometric_.default", random=True, overwrites=True)
def geometric_(self, p, *, generator=None, key):
    u = jax.random.uniform(key, self.shape, jnp.float32, minval=np.finfo(np.float32).tiny)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p)).astype(self.dtype)


@lowering("log_normal_.default", random=True, overwrites=True)
def log_normal_(self, mean=1.0, std=2.0, *, generator=None, key):
    return jnp.exp(jax.random.normal(key, self.shape, jnp.float32) * std + mean).astype(self.dtype)


@lowering("cauchy_.default", random=True, overwrites=True)
def cauchy_(self, median=0.0, sigma=1.0, *, generator=None, key):
    return (median + sigma * jax.random.cauchy(key, self.shape, jnp.float32)).astype(self.dtype)


@lowering("bernoulli_.float", random=True, overwrites=True)
def bernoulli_float(self, p=0.5, *, generator=None, key):
    return jax.random.bernoulli(key, p, self.shape).astype(self.dtype)


@lowering("bernoulli_.Tensor", random=True, overwrites=True)
def bernoulli_tensor(self, p, *, generator=None, key):
    return (jax.random.uniform(key, self.shape, jnp.float32) < jnp.broadcast_to(p, self.shape)).astype(self.dtype)


@lowering("bernoulli.default", random=True)
def bernoulli(self, *, generator=None, key):
    return (jax.random.uniform(key, self.shape, jnp.float32) < self).astype(self.dtype)


@lowering("bernoulli.p", random=True)
def bernoulli_p(self, p, *, generator=None, key):
    return jax.random.bernoulli(key, p, self.shape).astype(self.dtype)


@lowering("native_dropout.default", random=True)
def native_dropout(input, p, train, *, key):
    if not train or p == 0:
        return input, jnp.ones(input.shape, bool)
    if p >= 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, bool)
    keep = jax.random.uniform(key, input.shape, jnp.float32) >= p
    return jnp.where(keep, input * (1.0 / (1.0 - p)), 0).astype(input.dtype), keep


@lowering("native_dropout_backward.default", promote="result", promote_args=("grad_output", "mask"))
def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask * scale


@lowering("randperm.default", random=True)
def randperm(n, *, key, **_factory):
    return jax.random.permutation(key, n)


@lowering("randperm.generator", random=True)
def randperm_generator(n, *, generator=None, key, **_factory):
    return jax.random.permutation(key, n)


def _check_multinomial(self, num_samples, replacement):
    """ATen's checks of multinomial's static arguments (PyTorch's meta kernel checks only the rank;
    the lowering runs for the shapes, so these raise before anything compiles)."""
    if self.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError("multinomial only supports floating-point dtypes for input, got: "
                           f"{scalar_type_name(self.dtype)}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")


@lowering("multinomial.default", random=True, shape_from_lowering=True)
def multinomial(self, num_samples, replacement=False, *, generator=None, key):
    _check_multinomial(self, num_samples, replacement)
    logits = jnp.log(self.astype(jnp.float32))
    if replacement:
        shape = (num_samples,) + self.shape[:-1]
        out = jax.random.categorical(key, logits, axis=-1, shape=shape)
        return jnp.moveaxis(out, 0, -1).astype(jnp.int64)
    # Gumbel top-k: sampling without replacement.
    g = jax.random.gumbel(key, self.shape, jnp.float32)
    return jax.lax.top_k(logits + g, num_samples)[1].astype(jnp.int64)
