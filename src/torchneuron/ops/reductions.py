"""Reductions, scans, sorting and top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .registry import lowering


def dims(dim, ndim) -> tuple[int, ...]:
    """ATen's dim argument (None, int or list; negative allowed; [] = all) as a sorted tuple."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim))
    return tuple(sorted(d % max(ndim, 1) for d in dim)) if ndim else ()


def _accumulate_dtype(x, dtype=None):
    """The dtype PyTorch sums in: ints and bool in int64, half types in float32."""
    if dtype is not None:
        from ..runtime.dtypes import jax_dtype
        return jax_dtype(dtype)
    dt = x.dtype
    if dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer):
        return jnp.int64
    if dt in (jnp.float16, jnp.bfloat16):
        return jnp.float32
    return dt


@lowering("sum.dim_IntList")
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.sum(self.astype(_accumulate_dtype(self, dtype)), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("sum.default")
def sum_all(self, *, dtype=None):
    return jnp.sum(self.astype(_accumulate_dtype(self, dtype)))


@lowering("nansum.default")
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.nansum(self.astype(_accumulate_dtype(self, dtype)), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("mean.dim")
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    acc = _accumulate_dtype(self, dtype)
    return jnp.mean(self.astype(acc), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("mean.default")
def mean_all(self, *, dtype=None):
    return jnp.mean(self.astype(_accumulate_dtype(self, dtype)))


@lowering("nanmean.default")
def nanmean(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.nanmean(self.astype(_accumulate_dtype(self, dtype)), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("prod.dim_int")
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.prod(self.astype(_accumulate_dtype(self, dtype)), axis=dim, keepdims=keepdim)


@lowering("prod.default")
def prod_all(self, *, dtype=None):
    return jnp.prod(self.astype(_accumulate_dtype(self, dtype)))


@lowering("amax.default")
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("amin.default")
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("aminmax.default")
def aminmax(self, *, dim=None, keepdim=False):
    axis = None if dim is None else dim
    return jnp.min(self, axis=axis, keepdims=keepdim), jnp.max(self, axis=axis, keepdims=keepdim)


@lowering("max.default")
def max_all(self):
    return jnp.max(self)


@lowering("min.default")
def min_all(self):
    return jnp.min(self)


def _arg_extreme(x, dim, keepdim, largest):
    """Index of the first max/min along dim, NaN counting as the extreme (PyTorch semantics)."""
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    if jnp.issubdtype(x.dtype, jnp.floating):
        nan = jnp.isnan(x)
        any_nan = jnp.any(nan, axis=dim, keepdims=True)
        idx = jnp.argmax(x, axis=dim, keepdims=True) if largest else jnp.argmin(x, axis=dim, keepdims=True)
        nan_idx = jnp.argmax(nan, axis=dim, keepdims=True)
        idx = jnp.where(any_nan, nan_idx, idx)
        return idx if keepdim else jnp.squeeze(idx, dim)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int8)
    return (jnp.argmax if largest else jnp.argmin)(x, axis=dim, keepdims=keepdim)


@lowering("max.dim")
def max_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    idx = _arg_extreme(self, dim, True, True)
    vals = jnp.take_along_axis(self, idx, axis=dim)
    return (vals, idx) if keepdim else (vals.squeeze(dim), idx.squeeze(dim))


@lowering("min.dim")
def min_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    idx = _arg_extreme(self, dim, True, False)
    vals = jnp.take_along_axis(self, idx, axis=dim)
    return (vals, idx) if keepdim else (vals.squeeze(dim), idx.squeeze(dim))


@lowering("argmax.default")
def argmax(self, dim=None, keepdim=False):
    if dim is None:
        flat = self.reshape(-1)
        out = _arg_extreme(flat, 0, False, True)
        return out.reshape((1,) * self.ndim) if keepdim else out
    return _arg_extreme(self, dim, keepdim, True)


@lowering("argmin.default")
def argmin(self, dim=None, keepdim=False):
    if dim is None:
        flat = self.reshape(-1)
        out = _arg_extreme(flat, 0, False, False)
        return out.reshape((1,) * self.ndim) if keepdim else out
    return _arg_extreme(self, dim, keepdim, False)


def _var(x, dim, correction, keepdim):
    axis = dims(dim, x.ndim)
    acc = jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype
    x = x.astype(acc)
    n = 1
    for a in axis:
        n *= x.shape[a]
    mean = jnp.mean(x, axis=axis, keepdims=True)
    centered = x - mean
    sq = jnp.real(centered * jnp.conj(centered)) if jnp.iscomplexobj(x) else centered * centered
    c = 1 if correction is None else correction
    return jnp.sum(sq, axis=axis, keepdims=keepdim) / jnp.maximum(n - c, 0), mean if keepdim else jnp.squeeze(mean, axis)


@lowering("var.correction")
def var(self, dim=None, *, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)[0]


@lowering("std.correction")
def std(self, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_var(self, dim, correction, keepdim)[0])


@lowering("var_mean.correction")
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)


@lowering("std_mean.correction")
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    v, m = _var(self, dim, correction, keepdim)
    return jnp.sqrt(v), m


@lowering("any.default")
def any_all(self):
    return jnp.any(self != 0)


@lowering("any.dim")
def any_dim(self, dim, keepdim=False):
    return jnp.any(self != 0, axis=dim, keepdims=keepdim)


@lowering("any.dims")
def any_dims(self, dim=None, keepdim=False):
    return jnp.any(self != 0, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("all.default")
def all_all(self):
    return jnp.all(self != 0)


@lowering("all.dim")
def all_dim(self, dim, keepdim=False):
    return jnp.all(self != 0, axis=dim, keepdims=keepdim)


@lowering("all.dims")
def all_dims(self, dim=None, keepdim=False):
    return jnp.all(self != 0, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("logsumexp.default")
def logsumexp(self, dim, keepdim=False):
    x = self.astype(jnp.float32) if not jnp.issubdtype(self.dtype, jnp.floating) else self
    return jax.scipy.special.logsumexp(x, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("linalg_vector_norm.default", static_scalars=True)
def vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    # ord picks the algorithm, so it is compiled in (static_scalars), not a runtime input.
    x = self.astype(_accumulate_dtype(self, dtype)) if dtype is not None else self
    x = jnp.abs(x)
    if x.dtype in (jnp.float16, jnp.bfloat16):
        x = x.astype(jnp.float32)
    axis = dims(dim, self.ndim)
    if ord == float("inf"):
        return jnp.max(x, axis=axis, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(x, axis=axis, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=axis, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(x, axis=axis, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=keepdim))
    return jnp.sum(x ** ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)


@lowering("cumsum.default")
def cumsum(self, dim, *, dtype=None):
    x = self.astype(_accumulate_dtype(self, dtype))
    return jnp.cumsum(x, axis=dim) if self.ndim else x


@lowering("cumprod.default")
def cumprod(self, dim, *, dtype=None):
    x = self.astype(_accumulate_dtype(self, dtype))
    return jnp.cumprod(x, axis=dim) if self.ndim else x


@lowering("logcumsumexp.default")
def logcumsumexp(self, dim):
    if self.ndim == 0:
        return self
    return lax.cumlogsumexp(self, axis=dim % self.ndim)


def _cum_extreme(x, dim, largest):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    n = x.shape[dim]
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int64).reshape([-1 if d == dim else 1 for d in range(x.ndim)]), x.shape)

    def combine(a, b):
        va, ia = a
        vb, ib = b
        if jnp.issubdtype(va.dtype, jnp.floating):
            take_b = jnp.isnan(vb) | (~jnp.isnan(va) & ((vb >= va) if largest else (vb <= va)))
        else:
            take_b = (vb >= va) if largest else (vb <= va)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (x, idx), axis=dim)


@lowering("cummax.default")
def cummax(self, dim):
    return _cum_extreme(self, dim, True)


@lowering("cummin.default")
def cummin(self, dim):
    return _cum_extreme(self, dim, False)


@lowering("sort.default")
def sort(self, dim=-1, descending=False):
    return sort_stable(self, stable=False, dim=dim, descending=descending)


@lowering("sort.stable")
def sort_stable(self, *, stable=False, dim=-1, descending=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    dim = dim % self.ndim
    x = self
    # NaN sorts last ascending and first descending, as in PyTorch.
    iota = jnp.broadcast_to(jnp.arange(x.shape[dim], dtype=jnp.int64).reshape(
        [-1 if d == dim else 1 for d in range(x.ndim)]), x.shape)
    operand = x
    if descending:
        if jnp.issubdtype(x.dtype, jnp.floating):
            operand = jnp.where(jnp.isnan(x), -jnp.inf, -x)
            nan_first = ~jnp.isnan(x)
            vals_idx = lax.sort((nan_first, operand, iota), dimension=dim, num_keys=2, is_stable=True)
            idx = vals_idx[2]
        elif x.dtype == jnp.bool_:
            vals_idx = lax.sort((~x, iota), dimension=dim, num_keys=1, is_stable=True)
            idx = vals_idx[1]
        else:
            vals_idx = lax.sort((-x.astype(jnp.int64) if jnp.issubdtype(x.dtype, jnp.unsignedinteger) else
                                 jnp.bitwise_not(x), iota), dimension=dim, num_keys=1, is_stable=True)
            idx = vals_idx[1]
    else:
        vals_idx = lax.sort((x, iota), dimension=dim, num_keys=1, is_stable=True)
        idx = vals_idx[1]
    return jnp.take_along_axis(x, idx, axis=dim), idx


@lowering("argsort.stable")
def argsort_stable(self, *, stable, dim=-1, descending=False):
    return sort_stable(self, stable=stable, dim=dim, descending=descending)[1]


@lowering("topk.default")
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    vals, idx = sort_stable(self, stable=True, dim=dim, descending=largest)
    dim = dim % self.ndim
    return lax.slice_in_dim(vals, 0, k, axis=dim), lax.slice_in_dim(idx, 0, k, axis=dim)


@lowering("kthvalue.default")
def kthvalue(self, k, dim=-1, keepdim=False):
    vals, idx = sort_stable(self, stable=True, dim=dim, descending=False)
    if self.ndim == 0:
        return vals, idx
    dim = dim % self.ndim
    v = lax.index_in_dim(vals, k - 1, axis=dim, keepdims=keepdim)
    i = lax.index_in_dim(idx, k - 1, axis=dim, keepdims=keepdim)
    return v, i


@lowering("median.default")
def median_all(self):
    flat = self.reshape(-1)
    vals, _ = sort_stable(flat, stable=True)
    n = flat.shape[0]
    v = vals[(n - 1) // 2]
    if jnp.issubdtype(self.dtype, jnp.floating):
        v = jnp.where(jnp.any(jnp.isnan(flat)), jnp.nan, v)
    return v


@lowering("median.dim")
def median_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    vals, idx = sort_stable(self, stable=True, dim=dim)
    dim = dim % self.ndim
    k = (self.shape[dim] - 1) // 2
    v = lax.index_in_dim(vals, k, axis=dim, keepdims=keepdim)
    i = lax.index_in_dim(idx, k, axis=dim, keepdims=keepdim)
    if jnp.issubdtype(self.dtype, jnp.floating):
        has_nan = jnp.any(jnp.isnan(self), axis=dim, keepdims=keepdim)
        first_nan = jnp.argmax(jnp.isnan(self), axis=dim, keepdims=keepdim)
        v = jnp.where(has_nan, jnp.nan, v)
        i = jnp.where(has_nan, first_nan, i)
    return v, i


@lowering("count_nonzero.dim_IntList")
def count_nonzero(self, dim):
    return jnp.sum(self != 0, axis=dims(dim, self.ndim)).astype(jnp.int64)
