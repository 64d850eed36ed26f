"""Indexing lowerings: advanced indexing, gather/scatter, index_*, masked_*, embedding."""

from __future__ import annotations

import jax.numpy as jnp

from . import checks
from .checks import index_in_range, out_of_bounds
from .numerics import compute_dtype, highest, lowest
from .registry import InvalidArguments, lowering

_OUT_OF_RANGE = "index out of range in self"


def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


def _wrap(index, size):
    # Negative indices count from the end, as in PyTorch.
    return jnp.where(index < 0, index + size, index)


def _add_at(at, values):
    """Scatter-add; for bool tensors a logical or, as PyTorch accumulates booleans."""
    return at.max(values) if at.array.dtype == jnp.bool_ else at.add(values)


def _check_indices(self, indices):
    # CPU's message numbers the index tensors, not the dimensions they index.
    k = 0
    for d, i in enumerate(indices):
        if i is not None:
            index_in_range(i, self.shape[d], out_of_bounds(k, self.shape[d]))
            k += 1


@lowering("index.Tensor", "_unsafe_index.Tensor")
def index(self, indices):
    # Bool masks were turned into integer indices by the kernel (see eager/dynamic.py).
    _check_indices(self, indices)
    return self[_index_tuple(indices)]


_INDEX_PUT_DTYPES = ("self", "values", "Index put requires the source and destination dtypes match, got {self} for "
                     "the destination and {values} for the source.")


@lowering("index_put.default", "_unsafe_index_put.default", promote="result", promote_args=("self", "values"),
          same_dtype=_INDEX_PUT_DTYPES)
def index_put(self, indices, values, accumulate=False):
    _check_indices(self, indices)
    idx = _index_tuple(indices)
    return _add_at(self.at[idx], values) if accumulate else self.at[idx].set(values)


@lowering("_index_put_impl_.default", promote="result", promote_args=("self", "values"), same_dtype=_INDEX_PUT_DTYPES)
def index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    return index_put(self, indices, values, accumulate)


def _gather_like(self, dim, index):
    """``self`` cut down to ``index``'s extent in every dim but ``dim`` (gather/scatter semantics)."""
    if self.ndim == 0:
        return self
    limits = [index.shape[d] if d != dim else self.shape[d] for d in range(self.ndim)]
    return self[tuple(slice(0, n) for n in limits)]


def _one_dim(index, self):
    """ATen's rank rule counts a 0-dim tensor as 1-dim: a 0-dim index of a 1-dim ``self`` is one
    element (``torch.gather(x, 0, torch.tensor(1))`` is ``x[1]``, 0-dim)."""
    return index.reshape(1) if index.ndim == 0 and self.ndim == 1 else index


@lowering("gather.default")
def gather(self, dim, index, *, sparse_grad=False):
    if index.size == 0:   # ATen checks nothing about an empty index (not even its rank)
        return jnp.zeros(index.shape, self.dtype)
    if self.ndim == 0:
        _check_nonnegative(index, 1, 0)
        return self.reshape(index.shape)
    dim = dim % self.ndim
    shape, index = index.shape, _one_dim(index, self)
    _check_nonnegative(index, self.shape[dim], dim)
    out = jnp.take_along_axis(_gather_like(self, dim, index), _wrap(index, self.shape[dim]), axis=dim)
    return out.reshape(shape)


def _check_nonnegative(index, size, dim, error=RuntimeError, message=None):
    """gather/scatter/index_add: 0 <= index < size (no counting from the end)."""
    index_in_range(index, size, message or out_of_bounds(dim, size), error, negative=False)


def _scatter_index(index, dim, size):
    _check_nonnegative(index, size, dim)
    idx = list(jnp.indices(index.shape, sparse=True))
    idx[dim] = _wrap(index, size)
    return tuple(idx)


def _src_like(src, index):
    if not hasattr(src, "shape") or src.ndim == 0:
        return src
    return src[tuple(slice(0, n) for n in index.shape)]


@lowering("scatter.src", "scatter.value", promote="result", promote_args=("self", "src", "value"))
def scatter(self, dim, index, src=None, value=None):
    if self.ndim == 0:
        _check_nonnegative(index, 1, 0)
        return jnp.asarray(src if src is not None else value, self.dtype).reshape(())
    dim = dim % self.ndim
    index = _one_dim(index, self)
    vals = _src_like(src if src is not None else value, index)
    return self.at[_scatter_index(index, dim, self.shape[dim])].set(vals)


@lowering("scatter.reduce", "scatter.value_reduce", promote="result", promote_args=("self", "src", "value"))
def scatter_reduce_legacy(self, dim, index, src=None, value=None, *, reduce):
    if self.ndim == 0:
        src = None if src is None else src.reshape(-1)
        return scatter_reduce_legacy(self.reshape(1), 0, index.reshape(-1), src, value, reduce=reduce).reshape(())
    dim = dim % self.ndim
    index = _one_dim(index, self)
    vals = _src_like(src if src is not None else value, index)
    at = self.at[_scatter_index(index, dim, self.shape[dim])]
    return _add_at(at, vals) if reduce == "add" else at.multiply(vals)


@lowering("scatter_add.default", promote="result", promote_args=("self", "src"))
def scatter_add(self, dim, index, src):
    if index.size == 0:   # nothing to add; ATen checks nothing about an empty index
        return self
    if self.ndim == 0:
        _check_nonnegative(index, 1, 0)
        return self + src.reshape(())
    dim = dim % self.ndim
    index = _one_dim(index, self)
    return _add_at(self.at[_scatter_index(index, dim, self.shape[dim])], _src_like(src, index))


@lowering("scatter_reduce.two", promote="result", promote_args=("self", "src"))
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    if self.ndim == 0:
        self, src, index = self.reshape(1), src.reshape(-1), index.reshape(-1)
        return scatter_reduce(self, 0, index, src, reduce, include_self=include_self).reshape(())
    dim = dim % self.ndim
    index = _one_dim(index, self)
    idx = _scatter_index(index, dim, self.shape[dim])
    vals = _src_like(src, index)
    is_float = jnp.issubdtype(self.dtype, jnp.floating)
    if reduce in ("sum", "mean"):
        identity = 0
    elif reduce == "prod":
        identity = 1
    elif reduce == "amax":
        identity = lowest(self.dtype)
    else:
        identity = highest(self.dtype)
    base = self if include_self else self.at[idx].set(jnp.asarray(identity, self.dtype))
    at = base.at[idx]
    if reduce in ("sum", "mean"):
        out = _add_at(at, vals)
    elif reduce == "prod":
        out = at.min(vals) if self.dtype == jnp.bool_ else at.multiply(vals)   # bool product: and
    elif reduce == "amax":
        out = at.max(vals)
    else:
        out = at.min(vals)
    if reduce == "mean":
        counts = jnp.zeros(self.shape, jnp.int64).at[idx].add(1) + (1 if include_self else 0)
        safe = jnp.maximum(counts, 1)
        out = out / safe if is_float else jnp.floor_divide(out, safe)
        out = jnp.where(counts == 0, self, out).astype(self.dtype)
    return out


@lowering("index_select.default")
def index_select(self, dim, index):
    if self.ndim == 0:
        # A 0-dim source gives a 0-dim result (its only element, selected by index 0).
        index_in_range(index, 1, _OUT_OF_RANGE, negative=False)
        return self
    dim = dim % self.ndim
    index_in_range(index, self.shape[dim], _OUT_OF_RANGE, negative=False)
    return jnp.take(self, _wrap(index.reshape(-1), self.shape[dim]), axis=dim)


def _dim_index(ndim, dim, index):
    return (slice(None),) * dim + (index,)


def _check_index_func(func, self, dim, index, source):
    """ATen's checks of index_add/index_reduce's shapes that PyTorch's meta kernel leaves to the CPU
    kernel, in its words; then the 0-dim forms (index, source, self) as one-entry vectors."""
    dim = dim % max(self.ndim, 1)
    if not (dim == 0 or dim < source.ndim):
        raise InvalidArguments(f"{func}_(): Indexing dim {dim} is out of bounds of the source tensor "
                               f"with dim {source.ndim}")
    n = 1 if source.ndim == 0 else source.shape[dim]
    if index.size != n:
        raise InvalidArguments(f"{func}_(): Number of indices ({index.size}) should be equal to "
                               f"source.size(dim): ({n}), for dim: {dim}")
    self_sizes, source_sizes = list(self.shape), list(source.shape)
    if self.ndim and source.ndim:
        del self_sizes[dim], source_sizes[dim]
    if self_sizes != source_sizes:
        raise InvalidArguments("source tensor shape must match self tensor shape, excluding the specified "
                               f"dimension. Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}")
    return index.reshape(-1), source.reshape(source.shape or (1,))


@lowering("index_add.default", promote="result", promote_args=("self", "source"),
          same_dtype=("self", "source", "index_add_(): self ({self}) and source ({source}) must have the same scalar type"))
def index_add(self, dim, index, source, *, alpha=1):
    index, source = _check_index_func("index_add", self, dim, index, source)
    if self.ndim == 0:
        return index_add(self.reshape(1), 0, index, source, alpha=alpha).reshape(())
    scaled = jnp.logical_and(source, alpha) if self.dtype == jnp.bool_ else source * alpha
    dim = dim % self.ndim
    _check_nonnegative(index, self.shape[dim], dim)
    return _add_at(self.at[_dim_index(self.ndim, dim, _wrap(index, self.shape[dim]))], scaled)


@lowering("index_copy.default", promote="result", promote_args=("self", "source"),
          same_dtype=("self", "source", "index_copy_(): self and source expected to have the same dtype, but got (self) "
                      "{self} and (source) {source}"))
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        _check_nonnegative(index, 1, 0, IndexError, "index_copy_(): " + out_of_bounds(0, 1))
        return source.reshape(())
    dim = dim % self.ndim
    # A 0-dim index (and source) stand for one entry along dim, as in ATen.
    index = index.reshape(-1)
    if source.ndim == 0:
        source = source.reshape((1,) * self.ndim)
    _check_nonnegative(index, self.shape[dim], dim, IndexError,
                       "index_copy_(): " + out_of_bounds(dim, self.shape[dim]))
    return self.at[_dim_index(self.ndim, dim, _wrap(index, self.shape[dim]))].set(source)


@lowering("index_fill.int_Scalar", "index_fill.int_Tensor")
def index_fill(self, dim, index, value):
    # The value is cast here, after ATen's check (promotion would have dropped its imaginary part).
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(self):
        raise InvalidArguments("index_fill_(): Converting complex Scalar to non-complex type is not supported")
    value = value.astype(self.dtype)
    if self.ndim == 0:
        index_in_range(index, 1, out_of_bounds(0, 1))
        return jnp.asarray(value, self.dtype).reshape(())
    dim = dim % self.ndim
    index_in_range(index, self.shape[dim], out_of_bounds(dim, self.shape[dim]))
    return self.at[_dim_index(self.ndim, dim, _wrap(index, self.shape[dim]))].set(value)


@lowering("masked_fill.Scalar", "masked_fill.Tensor", promote="result", promote_args=("self", "value"))
def masked_fill(self, mask, value):
    return jnp.where(mask, value, self)


@lowering("masked_scatter.default", promote="result", promote_args=("self", "source"))
def masked_scatter(self, mask, source):
    # The out-of-place op broadcasts self and mask against each other (ATen's expand_outplace).
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    self = jnp.broadcast_to(self, shape)
    if source.size == 0:   # nothing to scatter (PyTorch requires the mask to select nothing)
        return self
    mask = jnp.broadcast_to(mask, shape).reshape(-1)
    positions = jnp.cumsum(mask.astype(jnp.int64)) - 1
    # CPU's check: a mask with more ones than source has elements would read past the source.
    checks.fail_if(mask & (positions >= source.size), None, RuntimeError,
                   "Number of elements of source < number of ones in mask")
    picked = source.reshape(-1)[jnp.clip(positions, 0, max(source.size - 1, 0))]
    return jnp.where(mask, picked, self.reshape(-1)).reshape(self.shape)


@lowering("embedding.default")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    index_in_range(indices, weight.shape[0], _OUT_OF_RANGE, negative=False)
    return jnp.take(weight, indices, axis=0)


@lowering("embedding_dense_backward.default")
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    dim = grad_output.shape[-1]
    grads = grad_output.reshape(-1, dim)
    if padding_idx >= 0:
        grads = jnp.where((flat == padding_idx)[:, None], 0, grads)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grads.dtype).at[flat].add(1)
        grads = grads / counts[flat][:, None]
    acc = compute_dtype(grads.dtype)
    return jnp.zeros((num_weights, dim), acc).at[flat].add(grads.astype(acc)).astype(grad_output.dtype)


def _take_message(n):
    return f"out of range: tried to access index {{value}} on a tensor of {n} elements."


@lowering("take.default")
def take(self, index):
    flat = self.reshape(-1)
    index_in_range(index, flat.shape[0], _take_message(flat.shape[0]))
    return flat[_wrap(index, flat.shape[0])]


@lowering("put.default", promote="result", promote_args=("self", "source"),
          same_dtype=("self", "source", "put_(): self and source expected to have the same dtype, but got self.dtype = "
                      "{self} and source.dtype = {source}"))
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    index_in_range(index, flat.shape[0], _take_message(flat.shape[0]))
    idx = _wrap(index.reshape(-1), flat.shape[0])
    src = source.reshape(-1)
    out = _add_at(flat.at[idx], src) if accumulate else flat.at[idx].set(src)
    return out.reshape(self.shape)


@lowering("nonzero_static.default")
def nonzero_static(self, *, size, fill_value=-1):
    # The first ``size`` nonzero positions in row-major order, padded with ``fill_value``.
    flat = (self != 0).reshape(-1)
    n = flat.shape[0]
    order = jnp.argsort(~flat, stable=True)[:size] if n else jnp.zeros((0,), jnp.int64)
    valid = flat[order] if n else jnp.zeros((0,), bool)
    coords = jnp.stack(jnp.unravel_index(order, self.shape), axis=-1) if self.ndim else \
        jnp.zeros((order.shape[0], 0), jnp.int64)
    coords = jnp.where(valid[:, None], coords, fill_value).astype(jnp.int64)
    if coords.shape[0] < size:
        pad = jnp.full((size - coords.shape[0], max(self.ndim, 0)), fill_value, jnp.int64)
        coords = jnp.concatenate([coords, pad], axis=0)
    return coords


@lowering("index_reduce.default", promote="result", promote_args=("self", "source"),
          same_dtype=("self", "source", "index_reduce_(): self ({self}) and source ({source}) must have the same scalar type"))
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    index, source = _check_index_func("index_reduce", self, dim, index, source)
    if self.ndim == 0:
        return index_reduce(self.reshape(1), 0, index, source, reduce, include_self=include_self).reshape(())
    dim = dim % self.ndim
    index_in_range(index, self.shape[dim], _OUT_OF_RANGE, negative=False)
    idx = _dim_index(self.ndim, dim, _wrap(index, self.shape[dim]))
    is_float = jnp.issubdtype(self.dtype, jnp.floating)
    identity = {"prod": 1, "mean": 0,
                "amax": lowest(self.dtype),
                "amin": highest(self.dtype)}[reduce]
    base = self if include_self else self.at[idx].set(jnp.asarray(identity, self.dtype))
    at = base.at[idx]
    if reduce == "prod":
        return at.multiply(source)
    if reduce == "amax":
        return at.max(source)
    if reduce == "amin":
        return at.min(source)
    counts = jnp.zeros(self.shape[dim], jnp.int64).at[_wrap(index, self.shape[dim])].add(1)
    counts = counts + (1 if include_self else 0)
    shape = [1] * self.ndim
    shape[dim] = -1
    counts = counts.reshape(shape)
    total = at.add(source)
    safe = jnp.maximum(counts, 1)
    out = total / safe if is_float else jnp.floor_divide(total, safe)
    return jnp.where(counts == 0, self, out).astype(self.dtype)


# -- embedding_bag ------------------------------------------------------------------------------
_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, num_bags):
    """Bag id of every index position (offsets[:num_bags] are the bag starts)."""
    pos = jnp.arange(indices.shape[0])
    return jnp.searchsorted(offsets[:num_bags].astype(jnp.int64), pos, side="right") - 1


def _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx):
    n = weight.shape[0]
    checks.fail_if((indices < 0) | (indices >= n), indices, RuntimeError,
                   f"Index {{position}} of input takes value {{value}} which is not in the valid range [0, {n})")
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    dim = weight.shape[1]
    bag = _bags(indices, offsets, num_bags)
    keep = (indices != padding_idx) if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    keep = keep & (bag >= 0) & (bag < num_bags)
    bag = jnp.clip(bag, 0, max(num_bags - 1, 0))
    rows = jnp.take(weight, indices, axis=0)
    counts = jnp.zeros((num_bags,), jnp.int64).at[bag].add(keep.astype(jnp.int64))
    if mode == _MAX:
        low = lowest(weight.dtype)
        vals = jnp.where(keep[:, None], rows, low)
        out = jnp.full((num_bags, dim), low, weight.dtype).at[bag].max(vals)
        # Index (into weight) of each bag's maximum: the first position reaching it.
        hit = keep[:, None] & (vals == out[bag])
        first = jnp.full((num_bags, dim), indices.shape[0], jnp.int64).at[bag].min(
            jnp.where(hit, jnp.arange(indices.shape[0])[:, None], indices.shape[0]))
        max_idx = jnp.where(counts[:, None] > 0, indices[jnp.clip(first, 0, max(indices.shape[0] - 1, 0))], 0)
        out = jnp.where(counts[:, None] > 0, out, 0)
        return out, bag, counts, max_idx.astype(jnp.int64)
    acc = compute_dtype(weight.dtype)
    rows = rows.astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(acc)
    out = jnp.zeros((num_bags, dim), acc).at[bag].add(jnp.where(keep[:, None], rows, 0).astype(acc))
    if mode == _MEAN:
        out = out / jnp.maximum(counts, 1)[:, None].astype(acc)
    return out.astype(weight.dtype), bag, counts, jnp.zeros((num_bags,), jnp.int64)


@lowering("_embedding_bag.default", "_embedding_bag_forward_only.default")
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    out, bag, counts, max_idx = _embedding_bag(weight, indices, offsets, mode, per_sample_weights,
                                               include_last_offset, padding_idx)
    # Output shapes of the side outputs follow ATen's device (non-CPU) meta rules: bag_size has one
    # entry per offset, max_indices is empty except in max mode. The backward recomputes the bags.
    if counts.shape[0] < offsets.shape[0]:
        counts = jnp.concatenate([counts, jnp.zeros((offsets.shape[0] - counts.shape[0],), counts.dtype)])
    if mode != _MAX:
        max_idx = jnp.zeros((0,), jnp.int64)
    return out, bag, counts, max_idx


@lowering("_embedding_bag_backward.default")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    num_bags = grad.shape[0]
    bag = jnp.clip(_bags(indices, offsets, num_bags), 0, max(num_bags - 1, 0))
    keep = (indices != padding_idx) if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    acc = compute_dtype(grad.dtype)
    g = grad.astype(acc)
    dim = grad.shape[1]
    if mode == _MAX:
        valid = jnp.sum(jnp.zeros((num_bags,), jnp.int64).at[bag].add(keep.astype(jnp.int64))[:, None] > 0, -1) > 0
        cols = jnp.broadcast_to(jnp.arange(dim), (num_bags, dim))
        out = jnp.zeros((num_weights, dim), acc).at[maximum_indices, cols].add(jnp.where(valid[:, None], g, 0))
        if padding_idx >= 0:
            out = out.at[padding_idx].set(0)
        return out.astype(grad.dtype)
    rows = g[bag]
    if mode == _MEAN:
        counts = jnp.zeros((num_bags,), jnp.int64).at[bag].add(keep.astype(jnp.int64))
        rows = rows / jnp.maximum(counts, 1)[bag][:, None].astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(acc)
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), acc).at[indices].add(1)
        rows = rows / freq[indices][:, None]
    out = jnp.zeros((num_weights, dim), acc).at[indices].add(jnp.where(keep[:, None], rows, 0))
    return out.astype(grad.dtype)


@lowering("_embedding_bag_per_sample_weights_backward.default")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    num_bags = grad.shape[0]
    bag = jnp.clip(_bags(indices, offsets, num_bags), 0, max(num_bags - 1, 0))
    out = jnp.sum(grad[bag] * jnp.take(weight, indices, axis=0), axis=1)
    if padding_idx >= 0:
        out = jnp.where(indices == padding_idx, 0, out)
    return out


@lowering("embedding_renorm.default")
def embedding_renorm(self, indices, max_norm, norm_type):
    # Rows referenced by ``indices`` whose norm exceeds max_norm are scaled to max_norm (once each).
    acc = compute_dtype(self.dtype)
    w = self.astype(acc)
    norms = jnp.sum(jnp.abs(w) ** norm_type, axis=1) ** (1.0 / norm_type)
    used = jnp.zeros((self.shape[0],), bool).at[indices.reshape(-1)].set(True)
    scale = jnp.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return (w * scale[:, None]).astype(self.dtype)
