"""Reductions, scans, sorting, top-k and histograms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..runtime.dtypes import jax_dtype
from .numerics import compute_dtype
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


def _accumulate(x, dtype=None):
    """``x`` in the dtype PyTorch accumulates it in: ints and bool in int64, half types in float32.
    A ``dtype=`` argument converts the input first (so its rounding is ATen's) and is accumulated
    the same way; the kernel casts the result to the op's output dtype."""
    if dtype is not None:
        x = x.astype(jax_dtype(dtype))
    dt = x.dtype
    if dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer):
        return x.astype(jnp.int64)
    return x.astype(compute_dtype(dt))


@lowering("sum.dim_IntList")
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.sum(_accumulate(self, dtype), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("sum.default")
def sum_all(self, *, dtype=None):
    return jnp.sum(_accumulate(self, dtype))


@lowering("nansum.default")
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.nansum(_accumulate(self, dtype), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("mean.dim")
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.mean(_accumulate(self, dtype), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("mean.default")
def mean_all(self, *, dtype=None):
    return jnp.mean(_accumulate(self, dtype))


@lowering("nanmean.default", graph_only=True)
def nanmean(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.nanmean(_accumulate(self, dtype), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("prod.dim_int")
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.prod(_accumulate(self, dtype), axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("prod.default")
def prod_all(self, *, dtype=None):
    return jnp.prod(_accumulate(self, dtype))


@lowering("amax.default")
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("amin.default")
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("aminmax.default")
def aminmax(self, *, dim=None, keepdim=False):
    axis = None if dim is None else dims(dim, self.ndim)
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
    acc = compute_dtype(x.dtype)
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
    return jnp.any(self != 0, axis=dims(dim, self.ndim), keepdims=keepdim)   # dim 0 of a 0-d tensor


@lowering("any.dims")
def any_dims(self, dim=None, keepdim=False):
    return jnp.any(self != 0, axis=dims(dim, self.ndim), keepdims=keepdim)


@lowering("all.default")
def all_all(self):
    return jnp.all(self != 0)


@lowering("all.dim")
def all_dim(self, dim, keepdim=False):
    return jnp.all(self != 0, axis=dims(dim, self.ndim), keepdims=keepdim)   # dim 0 of a 0-d tensor


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
    x = _accumulate(self, dtype) if dtype is not None else self
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
    x = _accumulate(self, dtype)
    return jnp.cumsum(x, axis=dim) if self.ndim else x


@lowering("cumprod.default")
def cumprod(self, dim, *, dtype=None):
    x = _accumulate(self, dtype)
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


@lowering("argsort.stable", graph_only=True)
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


# -- searching and binning ----------------------------------------------------------------------
def _searchsorted(seq, values, right, sorter=None):
    """Insertion points of ``values`` in ``seq`` along the last dim (1-D seq: shared by all)."""
    if values.size == 0 or seq.size == 0:
        return jnp.zeros(values.shape, jnp.int64)
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    side = "right" if right else "left"
    if seq.ndim <= 1:
        return jnp.searchsorted(seq, values, side=side)
    lead = seq.shape[:-1]
    flat_seq = seq.reshape((-1, seq.shape[-1]))
    flat_val = values.reshape((flat_seq.shape[0], -1))
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_val)
    return out.reshape(lead + values.shape[len(lead):])


def _right(right, side):
    return side == "right" if side is not None else bool(right)


@lowering("searchsorted.Tensor", "searchsorted.Scalar", promote="common", promote_args=("sorted_sequence", "self"))
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    out = _searchsorted(sorted_sequence, jnp.asarray(self), _right(right, side), sorter)
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


@lowering("bucketize.Tensor", "bucketize.Scalar", promote="common", promote_args=("self", "boundaries"))
def bucketize(self, boundaries, *, out_int32=False, right=False):
    out = jnp.searchsorted(boundaries, jnp.asarray(self), side="right" if right else "left")
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


def _bin_index(x, edges):
    """Bin of each x among ``edges`` (last bin closed), -1 when outside -- ATen's linear guess
    corrected by one step against the actual edges, so both agree exactly."""
    bins = edges.shape[0] - 1
    lo, hi = edges[0], edges[-1]
    pos = jnp.floor((x - lo) / (hi - lo) * bins)
    pos = jnp.clip(jnp.where(jnp.isfinite(pos), pos, 0), 0, bins - 1).astype(jnp.int64)
    pos = jnp.where(x < edges[pos], pos - 1, pos)
    nxt = jnp.clip(pos + 1, 0, bins)
    pos = jnp.where((pos + 1 <= bins - 1) & (x >= edges[nxt]), pos + 1, pos)
    inside = (x >= lo) & (x <= hi)
    return jnp.where(inside, jnp.clip(pos, 0, bins - 1), -1)


def _histogram(x, edges_list, weight, density, dtype):
    """Weighted counts of the rows of x (N, D) over per-dim edges (D lists)."""
    shape = tuple(e.shape[0] - 1 for e in edges_list)
    flat = jnp.zeros((), jnp.int64)
    valid = jnp.ones(x.shape[:1], bool)
    for d, edges in enumerate(edges_list):
        idx = _bin_index(x[:, d], edges)
        valid = valid & (idx >= 0)
        flat = flat * shape[d] + jnp.maximum(idx, 0)
    w = weight.reshape(-1).astype(dtype) if weight is not None else jnp.ones(x.shape[:1], dtype)
    hist = jnp.zeros((max(int(np.prod(shape)), 1),), dtype).at[flat].add(jnp.where(valid, w, 0))
    hist = hist[: int(np.prod(shape))].reshape(shape)
    if density:
        total = jnp.sum(hist)
        for d, edges in enumerate(edges_list):
            widths = (edges[1:] - edges[:-1]).astype(dtype)
            hist = hist / widths.reshape([-1 if i == d else 1 for i in range(len(shape))])
        hist = hist / total
    return hist


def _outer_edges(x, ranges, dims_, widen):
    """Per-dim (min, max): the given range, else the data's; equal ends are widened by ``widen``."""
    out = []
    for d in range(dims_):
        if ranges is not None:
            lo, hi = jnp.asarray(ranges[2 * d], x.dtype), jnp.asarray(ranges[2 * d + 1], x.dtype)
        elif x.shape[0]:
            lo, hi = jnp.min(x[:, d]), jnp.max(x[:, d])
        else:
            # No data and no range: ATen uses [0, 1].
            lo, hi = jnp.asarray(0, x.dtype), jnp.asarray(1, x.dtype)
        same = lo == hi
        out.append((jnp.where(same, lo - widen, lo), jnp.where(same, hi + widen, hi)))
    return out


def _linspace(lo, hi, n, dtype):
    step = (hi - lo) / (n - 1) if n > 1 else 0
    i = jnp.arange(n, dtype=dtype)
    # Filled from both ends, as torch.linspace does, so the last edge is exactly ``hi``.
    return jnp.where(i < n // 2, lo + step * i, hi - step * (n - 1 - i)).astype(dtype)


@lowering("histogram.bin_ct")
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    x = self.reshape(-1, 1)
    (lo, hi), = _outer_edges(x, range, 1, 0.5)
    edges = _linspace(lo, hi, bins + 1, self.dtype)
    return _histogram(x, [edges], weight, density, self.dtype), edges


@lowering("histogram.bins_tensor")
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    return _histogram(self.reshape(-1, 1), [bins], weight, density, self.dtype), bins


def _dd_edges(self, bins, range):
    x = self.reshape(-1, self.shape[-1])
    outer = _outer_edges(x, range, x.shape[1], 0.5)
    return x, [_linspace(lo, hi, b + 1, self.dtype) for (lo, hi), b in zip(outer, bins)]


@lowering("_histogramdd_bin_edges.default")
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _dd_edges(self, bins, range)[1]


@lowering("_histogramdd_from_bin_cts.default")
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    x, edges = _dd_edges(self, bins, range)
    return _histogram(x, edges, weight, density, self.dtype)


@lowering("_histogramdd_from_bin_tensors.default")
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    x = self.reshape(-1, self.shape[-1])
    return _histogram(x, list(bins), weight, density, self.dtype)


@lowering("mode.default")
def mode(self, dim=-1, keepdim=False):
    """Most frequent value (the smallest on ties) and the index of its last occurrence."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    dim = dim % self.ndim
    x = jnp.moveaxis(self, dim, -1)
    n = x.shape[-1]
    if n == 0:
        raise ValueError("mode of an empty dimension")
    vals, idx = sort_stable(x, stable=True, dim=-1)
    same_prev = jnp.concatenate([jnp.zeros(x.shape[:-1] + (1,), bool), vals[..., 1:] == vals[..., :-1]], -1)
    # Length of the run ending at each position.
    pos = jnp.arange(n)
    start = lax.cummax(jnp.where(same_prev, 0, pos), axis=x.ndim - 1)
    run = pos - start + 1
    # The first longest run is the smallest value among ties.
    best = jnp.argmax(run, axis=-1)
    value = jnp.take_along_axis(vals, best[..., None], -1)[..., 0]
    index = jnp.max(jnp.where(x == value[..., None], jnp.arange(n), -1), axis=-1)
    if keepdim:
        value, index = jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index.astype(jnp.int64)


def _nanmedian(x, axis):
    """Lower median of the non-NaN values along ``axis`` (NaN when there are none), and its index."""
    vals, idx = sort_stable(x, stable=True, dim=axis)        # NaNs sort last
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
    k = jnp.maximum(count - 1, 0) // 2
    v = jnp.take_along_axis(vals, k, axis=axis)
    i = jnp.take_along_axis(idx, k, axis=axis)
    return jnp.where(count == 0, jnp.nan, v), i


@lowering("nanmedian.default")
def nanmedian_all(self):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        return median_all(self)
    v, _ = _nanmedian(self.reshape(-1), 0)
    return v.reshape(())


@lowering("nanmedian.dim")
def nanmedian_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    if not jnp.issubdtype(self.dtype, jnp.floating):
        return median_dim(self, dim, keepdim)
    dim = dim % self.ndim
    v, i = _nanmedian(self, dim)
    if not keepdim:
        v, i = jnp.squeeze(v, dim), jnp.squeeze(i, dim)
    return v, i


_SEGMENT_INIT = {"sum": 0.0, "mean": jnp.nan, "prod": 1.0, "max": -jnp.inf, "min": jnp.inf}


def _segment_reduce(data, reduce, lengths, axis, initial):
    """Reduce consecutive runs of ``lengths[..., s]`` elements of ``data`` along ``axis``."""
    axis = axis % data.ndim
    x = jnp.moveaxis(data, axis, lengths.ndim - 1)      # segments dim right after the batch dims
    lengths = lengths.astype(jnp.int64)
    n = x.shape[lengths.ndim - 1]
    ends = jnp.cumsum(lengths, axis=-1)
    # segment id of each element position (per batch row)
    pos = jnp.arange(n)
    seg = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends.reshape(-1, ends.shape[-1]))
    seg = seg.reshape(lengths.shape[:-1] + (n,))
    s = lengths.shape[-1]
    batch = lengths.shape[:-1]
    rest = x.shape[lengths.ndim:]
    seg_b = seg.reshape(seg.shape + (1,) * len(rest))
    if reduce in ("sum", "mean"):
        op_init, combine = 0, "add"
    elif reduce == "prod":
        op_init, combine = 1, "multiply"
    elif reduce == "max":
        op_init, combine = -jnp.inf, "max"
    else:
        op_init, combine = jnp.inf, "min"
    base = jnp.full(batch + (s + 1,) + rest, op_init, x.dtype)
    idx = tuple(jnp.indices(batch + (n,) + rest, sparse=True))
    idx = idx[:len(batch)] + (jnp.broadcast_to(seg_b, batch + (n,) + rest),) + idx[len(batch) + 1:]
    out = lax.slice_in_dim(getattr(base.at[idx], combine)(x), 0, s, axis=len(batch))
    if reduce == "mean":
        # ATen: (initial + sum) / count for non-empty segments.
        cnt = lengths.reshape(lengths.shape + (1,) * len(rest)).astype(x.dtype)
        out = (out + (initial if initial is not None else 0)) / cnt
    empty = (lengths == 0).reshape(lengths.shape + (1,) * len(rest))
    fill = _SEGMENT_INIT[reduce] if initial is None else initial
    if initial is not None and reduce != "mean":
        # ``initial`` also seeds non-empty segments.
        if reduce == "sum":
            out = out + initial
        elif reduce == "prod":
            out = out * initial
        elif reduce == "max":
            out = jnp.maximum(out, initial)
        else:
            out = jnp.minimum(out, initial)
    out = jnp.where(empty, jnp.asarray(fill, x.dtype), out)
    return jnp.moveaxis(out, lengths.ndim - 1, axis)


def _lengths(lengths, offsets):
    return lengths if lengths is not None else offsets[..., 1:] - offsets[..., :-1]


@lowering("segment_reduce.default", static_scalars=True)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    # Half precision accumulates in float32 and rounds once, as ATen's CPU kernel does.
    out = _segment_reduce(data.astype(compute_dtype(data.dtype)), reduce, _lengths(lengths, offsets), axis, initial)
    return out.astype(data.dtype)


def _segment_prod_dense(data, lengths, axis, initial):
    """Segment products through a dense (segment x element) mask: differentiable with zeros
    handled exactly (JAX has no gradient for scatter-multiply)."""
    axis = axis % data.ndim
    x = jnp.moveaxis(data, axis, lengths.ndim - 1)
    nb = lengths.ndim - 1
    n = x.shape[nb]
    ends = jnp.cumsum(lengths.astype(jnp.int64), axis=-1)
    starts = ends - lengths
    pos = jnp.arange(n)
    member = (pos >= starts[..., None]) & (pos < ends[..., None])            # batch + (S, n)
    member = member.reshape(member.shape + (1,) * (x.ndim - nb - 1))
    xs = jnp.expand_dims(x, nb)                                              # batch + (1, n, rest)
    out = jnp.prod(jnp.where(member, xs, 1), axis=nb + 1)
    if initial is not None:
        out = out * initial
    empty = (lengths == 0).reshape(lengths.shape + (1,) * (x.ndim - nb - 1))
    out = jnp.where(empty, jnp.asarray(1.0 if initial is None else initial, x.dtype), out)
    return jnp.moveaxis(out, nb, axis)


@lowering("_segment_reduce_backward.default", static_scalars=True)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    lens = _lengths(lengths, offsets)
    if reduce == "prod":
        _, vjp = jax.vjp(lambda d: _segment_prod_dense(d, lens, axis, initial), data)
    else:
        _, vjp = jax.vjp(lambda d: _segment_reduce(d, reduce, lens, axis, initial), data)
    return vjp(grad.astype(data.dtype))[0]


@lowering("hash_tensor.default")
def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    # Upcast to the 64-bit type of the same kind, bitcast to uint64, xor-reduce.
    if jnp.issubdtype(self.dtype, jnp.floating):
        wide = lax.bitcast_convert_type(self.astype(jnp.float64), jnp.uint64)
    elif self.dtype == jnp.bool_ or jnp.issubdtype(self.dtype, jnp.unsignedinteger):
        wide = self.astype(jnp.uint64)
    else:
        wide = lax.bitcast_convert_type(self.astype(jnp.int64), jnp.uint64)
    axes = dims(dim, self.ndim)
    out = lax.reduce(wide, np.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        out = out.reshape([1 if d in axes else s for d, s in enumerate(self.shape)])
    return out


# -- histograms ------------------------------------------------------------------------------------
# transformers counts tokens per mixture-of-experts expert with torch.histc on integer expert ids.
@lowering("histc.default")
def histc(self, bins=100, min=0, max=0):
    x = self.reshape(-1)
    work = jnp.float32 if not jnp.issubdtype(self.dtype, jnp.floating) or jnp.finfo(self.dtype).bits < 32 \
        else self.dtype
    x = x.astype(work)
    lo = jnp.asarray(min, work)
    hi = jnp.asarray(max, work)
    # min == max: the data's own range; a degenerate range is widened by 1 on each side (PyTorch).
    auto = lo == hi
    if x.size:
        lo = jnp.where(auto, jnp.min(x), lo)
        hi = jnp.where(auto, jnp.max(x), hi)
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo)
    hi = jnp.where(same, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    pos = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int32)
    pos = jnp.clip(pos, 0, bins - 1)         # x == max belongs to the last bin
    counts = jnp.zeros((bins,), jnp.int32).at[pos].add(inside.astype(jnp.int32), mode="drop")
    return counts.astype(self.dtype)
