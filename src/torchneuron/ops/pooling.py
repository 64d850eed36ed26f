"""Pooling: fixed-window max and average pooling, adaptive average, adaptive and fractional max
pooling, and their backwards (VJPs of the forwards, or a scatter-add of the gradient at the saved
indices of a max pool).

Indices are flat positions within each (N, C) spatial plane, as ATen returns them. Windows follow
ATen's arithmetic exactly (adaptive: [floor(i*in/out), ceil((i+1)*in/out)); fractional: the
intervals generated from ``random_samples``); NaN wins a window, otherwise the first maximum does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .nn import expand_param
from .numerics import compute_dtype, lowest, require_floating
from .registry import InvalidArguments, lowering

_HIGHEST = lax.Precision.HIGHEST


# -- fixed-window max and average pooling ---------------------------------------------------------
def _pool_geometry(in_size, kernel, stride, padding, dilation, ceil_mode):
    eff = dilation * (kernel - 1) + 1
    num = in_size + 2 * padding - eff
    out = (-(-num // stride) if ceil_mode else num // stride) + 1
    if ceil_mode and (out - 1) * stride >= in_size + padding:
        out -= 1
    return max(out, 0)


def _window_indices(in_sizes, kernel, stride, padding, dilation, ceil_mode):
    """Static (numpy) positions of every window element, -1 where the window is off the input."""
    out_sizes = [_pool_geometry(i, k, s, p, d, ceil_mode)
                 for i, k, s, p, d in zip(in_sizes, kernel, stride, padding, dilation)]
    per_dim = []
    for i, k, s, p, d, o in zip(in_sizes, kernel, stride, padding, dilation, out_sizes):
        pos = np.arange(o)[:, None] * s - p + np.arange(k)[None, :] * d   # (out, k)
        per_dim.append(np.where((pos >= 0) & (pos < i), pos, -1))
    return out_sizes, per_dim


def _flat_windows(in_sizes, kernel, stride, padding, dilation, ceil_mode):
    out_sizes, per_dim = _window_indices(in_sizes, kernel, stride, padding, dilation, ceil_mode)
    nd = len(in_sizes)
    flat = np.zeros([1] * (2 * nd), dtype=np.int64)
    valid = np.ones([1] * (2 * nd), dtype=bool)
    mult = 1
    for d in reversed(range(nd)):
        pos = per_dim[d]
        shape = [1] * (2 * nd)
        shape[d], shape[nd + d] = pos.shape
        flat = flat + np.where(pos >= 0, pos, 0).reshape(shape) * mult
        valid = valid & (pos >= 0).reshape(shape)
        mult *= in_sizes[d]
    full = tuple(out_sizes) + tuple(kernel)
    flat = np.broadcast_to(flat, full).reshape(tuple(out_sizes) + (-1,))
    valid = np.broadcast_to(valid, full).reshape(tuple(out_sizes) + (-1,))
    return out_sizes, flat, valid


def _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, nd):
    kernel = expand_param(kernel_size, nd)
    stride = expand_param(stride, nd) if stride else kernel
    padding, dilation = expand_param(padding, nd), expand_param(dilation, nd)
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    in_sizes = x.shape[2:]
    out_sizes, flat, valid = _flat_windows(in_sizes, kernel, stride, padding, dilation, ceil_mode)
    xf = _flatten_from(x, 2)
    vals = xf[..., flat]                                   # (N, C, *out, K)
    low = lowest(x.dtype)
    vals = jnp.where(valid, vals, low)
    if jnp.issubdtype(x.dtype, jnp.floating):
        # NaN wins, as in PyTorch.
        pick = jnp.argmax(jnp.where(jnp.isnan(vals), jnp.inf, vals), axis=-1)
    else:
        pick = jnp.argmax(vals, axis=-1)
    out = jnp.take_along_axis(vals, pick[..., None], axis=-1)[..., 0]
    idx = jnp.asarray(flat)[(None, None) + (slice(None),) * nd]
    idx = jnp.take_along_axis(jnp.broadcast_to(idx, vals.shape), pick[..., None], axis=-1)[..., 0]
    if not batched:
        out, idx = out[0], idx[0]
    return out, idx.astype(jnp.int64)


@lowering("max_pool2d_with_indices.default")
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


def _unbatched_channels_last_3d(metas, values):
    """ATen's CPU kernel pools an unbatched (C, D, H, W) input that is a channels_last_3d batch of
    one with its batch dim squeezed into the same layout; PyTorch's meta kernel says contiguous."""
    x = values[0]
    if x.dim() != 4:
        return None
    batch = torch.empty_strided(x.shape, x.stride(), device="meta").unsqueeze(0)
    if batch.is_contiguous() or not batch.is_contiguous(memory_format=torch.channels_last_3d):
        return None
    return [torch.empty((1, *m.shape), device="meta", memory_format=torch.channels_last_3d).stride()[1:]
            for m in metas]


@lowering("max_pool3d_with_indices.default", output_strides=_unbatched_channels_last_3d)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _flatten_from(x, dim):
    """``x`` with the dims from ``dim`` on merged into one (sized explicitly: a zero-sized batch
    leaves reshape nothing to infer a -1 from)."""
    return x.reshape(x.shape[:dim] + (int(np.prod(x.shape[dim:])),))


def scatter_to_indices(grad_output, self, indices, nd):
    """Backward of every pooling op that returns flat window indices (max, adaptive, fractional):
    each gradient element is added at the input position its index names."""
    lead = self.shape[:-nd]
    n = int(np.prod(self.shape[-nd:]))
    g = _flatten_from(grad_output, len(lead))
    idx = _flatten_from(indices, len(lead))
    zeros = jnp.zeros(lead + (n,), grad_output.dtype)
    lead_idx = jnp.indices(idx.shape, sparse=True)[:-1]
    return zeros.at[tuple(lead_idx) + (idx,)].add(g).reshape(self.shape)


@lowering("max_pool2d_with_indices_backward.default")
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return scatter_to_indices(grad_output, self, indices, 2)


@lowering("max_pool3d_with_indices_backward.default")
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return scatter_to_indices(grad_output, self, indices, 3)


def _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    kernel = expand_param(kernel_size, nd)
    stride = expand_param(stride, nd) if stride else kernel
    padding = expand_param(padding, nd)
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    if x.dtype == jnp.bool_:   # integer dtypes average as ATen's integer kernels do; bool has none
        require_floating(f"avg_pool{nd}d", x)
    in_sizes = x.shape[2:]
    out_sizes, flat, valid = _flat_windows(in_sizes, kernel, stride, padding, (1,) * nd, ceil_mode)
    acc = compute_dtype(x.dtype)
    xf = _flatten_from(x, 2).astype(acc)
    total = jnp.sum(jnp.where(valid, xf[..., flat], 0), axis=-1)
    if divisor_override:
        divisor = np.float64(divisor_override)
    elif count_include_pad:
        # Window size clipped to the padded input (not to the ceil_mode overhang).
        counts = np.ones(tuple(out_sizes), dtype=np.float64)
        for d in range(nd):
            o = np.arange(out_sizes[d])
            start = o * stride[d] - padding[d]
            end = np.minimum(start + kernel[d], in_sizes[d] + padding[d])
            shape = [1] * nd
            shape[d] = out_sizes[d]
            counts = counts * (end - start).reshape(shape)
        divisor = counts
    else:
        divisor = valid.sum(-1).astype(np.float64)
    out = (total / jnp.asarray(divisor, acc)).astype(x.dtype)
    return out if batched else out[0]


@lowering("avg_pool2d.default")
def avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@lowering("avg_pool2d_backward.default")
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                         divisor_override, 2), self)
    return vjp(grad_output)[0]


@lowering("avg_pool3d.default")
def avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@lowering("avg_pool3d_backward.default")
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                         divisor_override, 3), self)
    return vjp(grad_output)[0]


def _adaptive_matrix(in_size, out_size, dtype):
    m = np.zeros((out_size, in_size), dtype=np.float64)
    for i in range(out_size):
        start = (i * in_size) // out_size
        end = -(-((i + 1) * in_size) // out_size)
        m[i, start:end] = 1.0 / (end - start)
    return jnp.asarray(m, dtype)


def _adaptive_avg(self, output_size, nd):
    require_floating(f"adaptive_avg_pool{nd}d", self)   # the matrix would round to integer weights
    acc = compute_dtype(self.dtype)
    x = self.astype(acc)
    for d in range(nd):
        axis = self.ndim - nd + d
        m = _adaptive_matrix(self.shape[axis], output_size[d], acc)
        x = jnp.moveaxis(jnp.tensordot(x, m, axes=([axis], [1]), precision=_HIGHEST), -1, axis)
    return x.astype(self.dtype)


@lowering("_adaptive_avg_pool2d.default")
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg(self, output_size, 2)


@lowering("_adaptive_avg_pool2d_backward.default")
def adaptive_avg_pool2d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: _adaptive_avg(x, grad_output.shape[-2:], 2), self)
    return vjp(grad_output)[0]


@lowering("_adaptive_avg_pool3d.default")
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg(self, output_size, 3)


@lowering("_adaptive_avg_pool3d_backward.default")
def adaptive_avg_pool3d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: _adaptive_avg(x, grad_output.shape[-3:], 3), self)
    return vjp(grad_output)[0]


# -- adaptive and fractional max pooling ----------------------------------------------------------

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
    require_floating(f"adaptive_max_pool{nd}d", self)
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


def _check_samples(x, samples, nd):
    """ATen's checks of ``_random_samples``, in its order and words (the 2-D meta kernel makes them
    too; the 3-D one leaves them to the CPU kernel). ATen reads samples[n, c] for batch rows n < N:
    an unbatched input takes (1, C, nd) samples too, and rows past N are ignored."""
    if samples.dtype != x.dtype:
        raise InvalidArguments("Expect _random_samples to have the same dtype as input")
    if samples.ndim != 3:
        raise InvalidArguments(f"Expect _random_samples to have 3 dimensions, got {samples.ndim}")
    if samples.shape[0] < x.shape[0]:
        raise InvalidArguments("Expect _random_samples.size(0) no less then input batch size.")
    if samples.shape[1] != x.shape[1]:
        raise InvalidArguments("Expect _random_samples.size(1) equals to input channel size.")
    if samples.shape[2] != nd:
        raise InvalidArguments(f"Expect _random_samples.size(2) equals to {nd}; got {samples.shape[2]}.")


def _fractional_max(self, kernel_size, output_size, random_samples, nd):
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    _check_samples(x, random_samples, nd)
    samples = random_samples[:x.shape[0]].astype(compute_dtype(x.dtype))
    starts, sizes = [], []
    # Which sample drives which dim, as ATen reads them: 2-D takes (W, H), 3-D takes (T, H, W).
    order = (1, 0) if nd == 2 else (0, 1, 2)
    for d in range(nd):
        seq = _intervals(samples[..., order[d]], x.shape[2 + d], output_size[d], kernel_size[d])
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
