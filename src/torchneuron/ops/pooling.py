"""Pooling with indices beyond the fixed-window max pools in ``nn``: adaptive and fractional max
pooling, and their backwards (a scatter-add of the gradient at the saved indices).

Indices are flat positions within each (N, C) spatial plane, as ATen returns them. Windows follow
ATen's arithmetic exactly (adaptive: [floor(i*in/out), ceil((i+1)*in/out)); fractional: the
intervals generated from ``random_samples``); NaN wins a window, otherwise the first maximum does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .nn import scatter_to_indices
from .numerics import compute_dtype, lowest
from .registry import lowering


def _window_max(x, starts, sizes, nd):
    """Max and flat in-plane index over windows [starts[d], starts[d] + sizes[d]) per output.

    x: (N, C, *in); starts[d]: int array broadcastable to (N, C, *out) for dim d; sizes[d]: static
    window extent (positions past the window's own end are masked with ``valid``)."""
    in_sizes = x.shape[2:]
    lead = x.shape[:2]
    flat = x.reshape(lead + (int(np.prod(in_sizes)),))
    pos = 0
    valid = True
    for d in range(nd):
        off = np.arange(sizes[d][1]).reshape([1] * (2 + nd) + [1] * d + [-1] + [1] * (nd - 1 - d))
        start = jnp.expand_dims(starts[d], tuple(range(2 + nd, 2 + 2 * nd)))
        p = start + off
        end = sizes[d][0]
        if jnp.ndim(end):
            end = jnp.expand_dims(end, tuple(range(2 + nd, 2 + 2 * nd)))
        valid = valid & (p < end)
        p = jnp.clip(p, 0, in_sizes[d] - 1)
        pos = pos * in_sizes[d] + p
    pos = jnp.broadcast_to(pos, jnp.broadcast_shapes(jnp.shape(pos), jnp.shape(valid)))
    out_shape = pos.shape[:2 + nd]
    window = int(np.prod(pos.shape[2 + nd:]))
    pos = jnp.broadcast_to(pos, lead + pos.shape[2:]).reshape(lead + out_shape[2:] + (window,))
    valid = jnp.broadcast_to(valid, lead + jnp.shape(valid)[2:]).reshape(lead + out_shape[2:] + (window,))
    vals = jnp.take_along_axis(flat, pos.reshape(lead + (int(np.prod(pos.shape[2:])),)), axis=2).reshape(pos.shape)
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    low = lowest(x.dtype)
    vals = jnp.where(valid, vals, low)
    key = jnp.where(jnp.isnan(vals), jnp.inf, vals) if floating else vals
    pick = jnp.argmax(key, axis=-1)
    out = jnp.take_along_axis(vals, pick[..., None], -1)[..., 0]
    idx = jnp.take_along_axis(pos, pick[..., None], -1)[..., 0]
    return out, idx.astype(jnp.int64)


def _adaptive_bounds(in_size, out_size):
    i = np.arange(out_size)
    start = (i * in_size) // out_size
    end = -(-((i + 1) * in_size) // out_size)
    return start, end


def _adaptive_max(self, output_size, nd):
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    starts, sizes = [], []
    for d in range(nd):
        s, e = _adaptive_bounds(x.shape[2 + d], output_size[d])
        shape = [1] * (2 + nd)
        shape[2 + d] = -1
        starts.append(jnp.asarray(s.reshape(shape)))
        sizes.append((jnp.asarray(e.reshape(shape)), int((e - s).max()) if len(s) else 1))
    out, idx = _window_max(x, starts, sizes, nd)
    return (out, idx) if batched else (out[0], idx[0])


@lowering("adaptive_max_pool2d.default")
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max(self, output_size, 2)


@lowering("adaptive_max_pool3d.default")
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max(self, output_size, 3)


@lowering("adaptive_max_pool2d_backward.default")
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return scatter_to_indices(grad_output, self, indices, 2)


@lowering("adaptive_max_pool3d_backward.default")
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return scatter_to_indices(grad_output, self, indices, 3)


def _intervals(sample, in_size, out_size, pool):
    """ATen's generate_intervals: window starts from one random sample in [0, 1)."""
    if out_size == 0:
        return jnp.zeros(sample.shape + (0,), jnp.int64)
    i = jnp.arange(out_size, dtype=sample.dtype)
    if out_size > 1:
        alpha = jnp.asarray((in_size - pool) / (out_size - 1), sample.dtype)
        seq = (jnp.trunc((i + sample[..., None]) * alpha) - jnp.trunc(sample[..., None] * alpha)).astype(jnp.int64)
        return seq.at[..., out_size - 1].set(in_size - pool)
    return jnp.full(sample.shape + (1,), in_size - pool, jnp.int64)


def _fractional_max(self, kernel_size, output_size, random_samples, nd):
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    samples = random_samples if batched else random_samples[None]
    samples = samples.astype(compute_dtype(x.dtype))
    starts, sizes = [], []
    for d in range(nd):
        # samples[..., 0] drives the last (width) dim, [..., 1] the one before, ...
        seq = _intervals(samples[..., nd - 1 - d], x.shape[2 + d], output_size[d], kernel_size[d])
        shape = list(seq.shape[:2]) + [1] * nd
        shape[2 + d] = output_size[d]
        starts.append(seq.reshape(shape))
        sizes.append((jnp.asarray(x.shape[2 + d]), kernel_size[d]))
    out, idx = _window_max(x, starts, sizes, nd)
    return (out, idx) if batched else (out[0], idx[0])


@lowering("fractional_max_pool2d.default")
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max(self, kernel_size, output_size, random_samples, 2)


@lowering("fractional_max_pool3d.default")
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max(self, kernel_size, output_size, random_samples, 3)


@lowering("fractional_max_pool2d_backward.default")
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return scatter_to_indices(grad_output, self, indices, 2)


@lowering("fractional_max_pool3d_backward.default")
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return scatter_to_indices(grad_output, self, indices, 3)
