"""View ops as pure functions, for graphs only.

In eager mode a view is metadata over the same storage, built by PyTorch's own CPU kernels (see
``eager/registration.py``), so these get no eager kernel (``graph_only=True``). Inside a
torch.compile graph every value is a logical array and functionalization has already turned
"writes through views" into explicit scatters, so a view is simply the array it shows.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..runtime import layout
from ..runtime.dtypes import jax_dtype
from .registry import lowering


def _dim(d, ndim):
    return d % ndim if ndim else 0


def infer_size(size, numel):
    """``size`` with its -1 (if any) resolved for an array of ``numel`` elements."""
    size = [int(s) for s in size]
    if -1 in size:
        i = size.index(-1)
        known = math.prod(s for j, s in enumerate(size) if j != i)
        size[i] = numel // known if known else 0
    return tuple(size)


@lowering("view.default", "_unsafe_view.default", "reshape.default", graph_only=True)
def view(self, size):
    return jnp.reshape(self, infer_size(size, self.size))


@lowering("_reshape_alias.default", graph_only=True)
def reshape_alias(self, size, stride):
    return jnp.reshape(self, tuple(size))


@lowering("view.dtype", graph_only=True)
def view_dtype(self, dtype):
    target = np.dtype(jax_dtype(dtype))
    if target == self.dtype:
        return self
    if self.ndim == 0:
        return layout.reinterpret(self.reshape(1), target).reshape(())
    # Rows along the last dim are contiguous in logical order, so reinterpreting the flat array
    # and re-splitting the last dim matches Tensor.view(dtype).
    src_bits = 8 if self.dtype == np.bool_ else np.dtype(self.dtype).itemsize * 8
    dst_bits = 8 if target == np.bool_ else target.itemsize * 8
    last = self.shape[-1] * src_bits // dst_bits
    return layout.reinterpret(self.reshape(-1), target).reshape(self.shape[:-1] + (last,))


@lowering("permute.default", graph_only=True)
def permute(self, dims):
    if self.ndim == 0:
        return self
    return jnp.transpose(self, [_dim(d, self.ndim) for d in dims])


@lowering("t.default", graph_only=True)
def t(self):
    return self.T if self.ndim == 2 else self


@lowering("transpose.int", graph_only=True)
def transpose(self, dim0, dim1):
    if self.ndim < 2:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@lowering("expand.default", graph_only=True)
def expand(self, size, *, implicit=False):
    lead = len(size) - self.ndim
    final = tuple(self.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(size))
    return jnp.broadcast_to(self, final)


def _clamp_range(start, end, n):
    start = 0 if start is None else start
    end = n if end is None else end
    if start < 0:
        start += n
    if end < 0:
        end += n
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end


@lowering("slice.Tensor", graph_only=True)
def slice_(self, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, self.ndim)
    start, end = _clamp_range(start, end, self.shape[dim])
    return lax.slice_in_dim(self, start, end, step, axis=dim)


@lowering("select.int", graph_only=True)
def select(self, dim, index):
    dim = _dim(dim, self.ndim)
    n = self.shape[dim]
    return lax.index_in_dim(self, index + n if index < 0 else index, dim, keepdims=False)


@lowering("squeeze.default", graph_only=True)
def squeeze(self):
    return jnp.squeeze(self) if self.ndim else self


@lowering("squeeze.dim", graph_only=True)
def squeeze_dim(self, dim):
    return squeeze_dims(self, [dim])


@lowering("squeeze.dims", graph_only=True)
def squeeze_dims(self, dim):
    if self.ndim == 0:
        return self
    axes = tuple(sorted({_dim(d, self.ndim) for d in dim if self.shape[_dim(d, self.ndim)] == 1}))
    return jnp.squeeze(self, axes) if axes else self


@lowering("unsqueeze.default", graph_only=True)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, dim % (self.ndim + 1))


@lowering("alias.default", "detach.default", "lift_fresh.default", graph_only=True)
def alias(self):
    return self


@lowering("as_strided.default", graph_only=True)
def as_strided(self, size, stride, storage_offset=None):
    # Sizes and strides index the storage; inside a graph the storage of ``self`` is taken to be its
    # contiguous flattening (the compile interpreter rebuilds it first when it is not).
    offset = 0 if storage_offset is None else storage_offset   # a traced offset has no truth value
    return layout.read(self.reshape(-1), self.dtype, tuple(size), tuple(stride), offset)


@lowering("split.Tensor", graph_only=True)
def split(self, split_size, dim=0):
    dim = _dim(dim, self.ndim)
    n = self.shape[dim]
    if split_size <= 0:
        return [self]
    sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    return split_with_sizes(self, sizes or [0], dim)


@lowering("split_with_sizes.default", graph_only=True)
def split_with_sizes(self, split_sizes, dim=0):
    dim = _dim(dim, self.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + s, axis=dim))
        start += s
    return out


@lowering("unbind.int", graph_only=True)
def unbind(self, dim=0):
    dim = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, dim, keepdims=False) for i in range(self.shape[dim])]


@lowering("diagonal.default", graph_only=True)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@lowering("unfold.default", graph_only=True)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    d = _dim(dimension, self.ndim)
    count = (self.shape[d] - size) // step + 1
    idx = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    windows = jnp.take(self, jnp.asarray(idx), axis=d)          # [..., count, size, ...]
    return jnp.moveaxis(windows, d + 1, -1)


@lowering("view_as_real.default", graph_only=True)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lowering("view_as_complex.default", graph_only=True)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])
