"""Lowerings that move data around: concatenation, padding, flips, triangles, *_scatter."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..runtime import layout
from . import registry
from .registry import lowering


def _common(tensors):
    dtype = jnp.result_type(*[t.dtype for t in tensors]) if tensors else jnp.float32
    return [t.astype(dtype) for t in tensors]


@lowering("cat.default")
def cat(tensors, dim=0):
    # PyTorch skips legacy empty 1-D tensors whose rank differs from the others.
    ranks = [t.ndim for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not ranks:
        return jnp.concatenate(_common(list(tensors)), axis=0)
    ndim = ranks[0]
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and ndim != 1)]
    return jnp.concatenate(_common(kept), axis=dim % ndim)


@lowering("stack.default")
def stack(tensors, dim=0):
    ndim = tensors[0].ndim + 1
    return jnp.stack(_common(list(tensors)), axis=dim % ndim)


@lowering("flip.default")
def flip(self, dims):
    return jnp.flip(self, axis=tuple(d % max(self.ndim, 1) for d in dims)) if self.ndim else self


@lowering("roll.default")
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(dims))


@lowering("constant_pad_nd.default", promote="result", promote_args=("self",))
def constant_pad_nd(self, pad, value=0):
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        d = self.ndim - 1 - i
        config[d] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value, self.dtype), config)


@lowering("repeat.default")
def repeat(self, repeats):
    extra = len(repeats) - self.ndim
    x = self.reshape((1,) * extra + self.shape)
    return jnp.tile(x, tuple(repeats))


@lowering("tril.default")
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lowering("triu.default")
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


@lowering("slice_scatter.default", promote="result", promote_args=("self", "src"))
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    idx = [slice(None)] * self.ndim
    idx[dim] = slice(start, end, step)
    return self.at[tuple(idx)].set(src)


@lowering("select_scatter.default", promote="result", promote_args=("self", "src"))
def select_scatter(self, src, dim, index):
    idx = [slice(None)] * self.ndim
    idx[dim] = index
    return self.at[tuple(idx)].set(src)


@lowering("diagonal_scatter.default", promote="result", promote_args=("self", "src"))
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    n1, n2 = self.shape[dim1], self.shape[dim2]
    if offset >= 0:
        length = max(min(n1, n2 - offset), 0)
        rows, cols = jnp.arange(length), jnp.arange(length) + offset
    else:
        length = max(min(n1 + offset, n2), 0)
        rows, cols = jnp.arange(length) - offset, jnp.arange(length)
    moved = jnp.moveaxis(self, (dim1, dim2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src)
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


@lowering("as_strided_scatter.default", promote="result", promote_args=("self", "src"))
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    flat = self.reshape(-1)
    out = layout.write(flat, src, flat.dtype, tuple(size), tuple(stride), storage_offset or 0)
    return out.reshape(self.shape)


@lowering("diag_embed.default")
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    n = self.shape[-1] + abs(offset)
    out = jnp.zeros(self.shape[:-1] + (n, n), self.dtype)
    i = jnp.arange(self.shape[-1])
    rows, cols = (i, i + offset) if offset >= 0 else (i - offset, i)
    out = out.at[..., rows, cols].set(self)
    ndim = out.ndim
    return jnp.moveaxis(out, (-2, -1), (dim1 % ndim, dim2 % ndim))


def _copy_of_view(view_name):
    """``<view>_copy``: apply the view's metadata rules to an index array (at trace time), gather."""
    packet, _, overload = view_name.partition(".")

    def fn(self, *args, **kwargs):
        numel = 1
        for s in self.shape:
            numel *= s
        probe = torch.arange(numel).reshape(self.shape)
        view = getattr(getattr(torch.ops.aten, packet), overload)
        positions = view(probe, *args, **kwargs).contiguous().numpy()
        return self.reshape(-1)[np.asarray(positions, dtype=np.int64)] if numel else \
            jnp.zeros(positions.shape, self.dtype)
    return fn


for _copy, _view in {
    "alias_copy.default": "alias.default", "view_copy.default": "view.default",
    "expand_copy.default": "expand.default", "permute_copy.default": "permute.default",
    "transpose_copy.int": "transpose.int", "t_copy.default": "t.default",
    "unsqueeze_copy.default": "unsqueeze.default", "squeeze_copy.dims": "squeeze.dims",
    "slice_copy.Tensor": "slice.Tensor", "select_copy.int": "select.int",
    "diagonal_copy.default": "diagonal.default", "unfold_copy.default": "unfold.default",
    "as_strided_copy.default": "as_strided.default",
}.items():
    registry.add(registry.Lowering(name=_copy, fn=_copy_of_view(_view), derive_variants=False))
