"""Neural-network lowerings: convolution, pooling, normalisation, softmax, losses, attention.

Backward ops are the JAX vector-Jacobian product of the forward lowering, so forward and gradient
can never disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .numerics import compute_dtype, lowest
from .reductions import dims
from .registry import lowering

_HIGHEST = lax.Precision.HIGHEST


def _acc(x):
    """Compute dtype for normalisations and softmax: half types in float32 (as PyTorch's CPU does)."""
    return compute_dtype(x.dtype)


# -- convolution --------------------------------------------------------------------------------
def _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = weight.ndim - 2
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = lax.conv_dimension_numbers(input.shape, weight.shape if not transposed else
                                    (weight.shape[1] * groups, weight.shape[0] // groups) + weight.shape[2:],
                                    ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    stride, padding, dilation = _expand(stride, nd), _expand(padding, nd), _expand(dilation, nd)
    acc = _acc(input)   # half precision accumulates in float32 and rounds once
    if not transposed:
        out = lax.conv_general_dilated(
            input, weight, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups, precision=_HIGHEST,
            preferred_element_type=acc)
    else:
        output_padding = _expand(output_padding, nd)
        cin, cout_g = weight.shape[0], weight.shape[1]
        k = weight.shape[2:]
        w = weight.reshape((groups, cin // groups, cout_g) + k)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
                for kk, p, d, op in zip(k, padding, dilation, output_padding)]
        out = lax.conv_general_dilated(
            input, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride,
            rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups, precision=_HIGHEST,
            preferred_element_type=acc)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(acc)
    return out.astype(input.dtype)


def _expand(v, n):
    v = tuple(v)
    return v * n if len(v) == 1 else v


@lowering("convolution.default", promote="common", promote_args=("input", "weight", "bias"))
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lowering("convolution_backward.default")
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def f(x, w):
        return _conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, input, weight)
    gx, gw = vjp(grad_output.astype(input.dtype))
    gb = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


# -- pooling ------------------------------------------------------------------------------------
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
    kernel = _expand(kernel_size, nd)
    stride = _expand(stride, nd) if stride else kernel
    padding, dilation = _expand(padding, nd), _expand(dilation, nd)
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


@lowering("max_pool3d_with_indices.default")
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
    kernel = _expand(kernel_size, nd)
    stride = _expand(stride, nd) if stride else kernel
    padding = _expand(padding, nd)
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    in_sizes = x.shape[2:]
    out_sizes, flat, valid = _flat_windows(in_sizes, kernel, stride, padding, (1,) * nd, ceil_mode)
    acc = _acc(x)
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
    acc = _acc(self)
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


# -- normalisation ------------------------------------------------------------------------------
def _layer_norm(input, normalized_shape, weight, bias, eps):
    axis = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = input.astype(_acc(input))
    mean = jnp.mean(x, axis=axis, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axis, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(input.dtype), mean, rstd


@lowering("native_layer_norm.default")
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    return _layer_norm(input, normalized_shape, weight, bias, eps)


@lowering("native_layer_norm_backward.default")
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    # Recompute with the saved statistics: (x - mean) * rstd is exact, eps is already in rstd.
    def g(x, w, b):
        axis = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        xa = x.astype(_acc(x))
        m = jnp.mean(xa, axis=axis, keepdims=True)
        v = jnp.mean(jnp.square(xa - m), axis=axis, keepdims=True)
        eps = 1.0 / jnp.square(rstd) - lax.stop_gradient(v)
        out = (xa - m) * lax.rsqrt(v + lax.stop_gradient(eps))
        if w is not None:
            out = out * w
        if b is not None:
            out = out + b
        return out.astype(x.dtype)

    _, vjp = jax.vjp(g, input, weight, bias)
    gx, gw, gb = vjp(grad_out)
    return (gx if output_mask[0] else None, gw if output_mask[1] and weight is not None else None,
            gb if output_mask[2] and bias is not None else None)


def _bn_stats(x):
    axis = (0,) + tuple(range(2, x.ndim))
    xa = x.astype(_acc(x))
    mean = jnp.mean(xa, axis=axis)
    var = jnp.mean(jnp.square(xa - _bcast(mean, x)), axis=axis)
    n = x.size // x.shape[1]
    return mean, var, n


def _bcast(v, x):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _bn_apply(x, weight, bias, mean, invstd):
    xa = x.astype(_acc(x))
    out = (xa - _bcast(mean, x)) * _bcast(invstd, x)
    if weight is not None:
        out = out * _bcast(weight, x)
    if bias is not None:
        out = out + _bcast(bias, x)
    return out.astype(x.dtype)


def _bn_train(input, weight, bias, running_mean, running_var, momentum, eps):
    mean, var, n = _bn_stats(input)
    invstd = lax.rsqrt(var + eps)
    out = _bn_apply(input, weight, bias, mean, invstd)
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = (1 - momentum) * running_mean + momentum * mean
    if running_var is not None:
        new_rv = (1 - momentum) * running_var + momentum * var * (n / max(n - 1, 1))
    return out, mean, invstd, new_rm, new_rv


def _bn_eval(input, weight, bias, running_mean, running_var, eps):
    invstd = lax.rsqrt(running_var.astype(_acc(input)) + eps)
    return _bn_apply(input, weight, bias, running_mean, invstd)


@lowering("_native_batch_norm_legit.default")
def native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, rm, rv = _bn_train(input, weight, bias, running_mean, running_var, momentum, eps)
        return rm, rv, out, mean, invstd
    return (running_mean, running_var) + _bn_eval_saving_stats(input, weight, bias, running_mean, running_var, eps)


def _bn_eval_saving_stats(input, weight, bias, running_mean, running_var, eps):
    # In eval mode the "saved" statistics are the running ones (what the backward will use).
    invstd = lax.rsqrt(running_var.astype(_acc(input)) + eps)
    return _bn_apply(input, weight, bias, running_mean, invstd), running_mean, invstd


@lowering("_native_batch_norm_legit.no_stats")
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    out, mean, invstd, _, _ = _bn_train(input, weight, bias, None, None, momentum, eps)
    return out, mean, invstd


@lowering("_native_batch_norm_legit_no_training.default")
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    empty = jnp.zeros((0,), _acc(input))
    return _bn_eval(input, weight, bias, running_mean, running_var, eps), empty, empty


@lowering("native_batch_norm.default", mutates=("running_mean", "running_var"))
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, rm, rv = _bn_train(input, weight, bias, running_mean, running_var, momentum, eps)
        # Running statistics are optional here: only those given are written back.
        return tuple(v for v in (rm, rv) if v is not None) + (out, mean, invstd)
    return (running_mean, running_var) + _bn_eval_saving_stats(input, weight, bias, running_mean, running_var, eps)


@lowering("_batch_norm_with_update.default")
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, rm, rv = _bn_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return rm, rv, out, mean, invstd, jnp.zeros((0,), jnp.uint8)


@lowering("_batch_norm_no_update.default")
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    empty = jnp.zeros((0,), _acc(input))
    if running_mean is None:
        out, mean, invstd, _, _ = _bn_train(input, weight, bias, None, None, momentum, eps)
        return out, mean, invstd, jnp.zeros((0,), jnp.uint8)
    return (_bn_eval(input, weight, bias, running_mean, running_var, eps), empty, empty,
            jnp.zeros((0,), jnp.uint8))


def _bn_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                 output_mask):
    w = weight if weight is not None else jnp.ones((input.shape[1],), _acc(input))
    if train:
        def f(x, w_):
            mean, var, _ = _bn_stats(x)
            return _bn_apply(x, w_, None, mean, lax.rsqrt(var + eps))
    else:
        def f(x, w_):
            return _bn_apply(x, w_, None, running_mean, lax.rsqrt(running_var.astype(_acc(x)) + eps))
    _, vjp = jax.vjp(f, input, w)
    gx, gw = vjp(grad_out)
    gb = jnp.sum(grad_out.astype(_acc(input)), axis=(0,) + tuple(range(2, input.ndim)))
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb if output_mask[2] else None)


@lowering("native_batch_norm_backward.default")
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    return _bn_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                        eps, output_mask)


@lowering("batch_norm_backward.default")
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask, reserve):
    return _bn_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask)


@lowering("native_group_norm.default")
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = input.reshape(N, group, C // group * HxW).astype(_acc(input))   # explicit: N may be 0
    mean = jnp.mean(x, axis=-1)
    var = jnp.mean(jnp.square(x - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((x - mean[..., None]) * rstd[..., None]).reshape(input.shape)
    shape = (1, C) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@lowering("native_group_norm_backward.default")
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    acc = _acc(input)
    shape = (1, C) + (1,) * (input.ndim - 2)
    x = input.reshape(N, group, C // group * HxW).astype(acc)
    xhat = (x - mean[..., None]) * rstd[..., None]
    w = weight.astype(acc) if weight is not None else jnp.ones((C,), acc)
    g = (grad_out.astype(acc) * w.reshape(shape)).reshape(x.shape)
    gx = rstd[..., None] * (g - jnp.mean(g, axis=-1, keepdims=True)
                            - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    reduce_axes = (0,) + tuple(range(2, input.ndim))
    gw = jnp.sum(grad_out.astype(acc) * xhat.reshape(input.shape), axis=reduce_axes)
    gb = jnp.sum(grad_out.astype(acc), axis=reduce_axes)
    return (gx.reshape(input.shape).astype(input.dtype) if output_mask[0] else None,
            gw if output_mask[1] else None, gb if output_mask[2] else None)


# -- softmax ------------------------------------------------------------------------------------
@lowering("_softmax.default")
def softmax(self, dim, half_to_float):
    out = jax.nn.softmax(self.astype(_acc(self)), axis=dims(dim, self.ndim))
    return out if half_to_float else out.astype(self.dtype)


@lowering("_log_softmax.default")
def log_softmax(self, dim, half_to_float):
    out = jax.nn.log_softmax(self.astype(_acc(self)), axis=dims(dim, self.ndim))
    return out if half_to_float else out.astype(self.dtype)


@lowering("_softmax_backward_data.default")
def softmax_backward_data(grad_output, output, dim, input_dtype):
    g = grad_output.astype(_acc(output))
    o = output.astype(_acc(output))
    return o * (g - jnp.sum(g * o, axis=dims(dim, o.ndim), keepdims=True))


@lowering("_log_softmax_backward_data.default")
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g = grad_output.astype(_acc(output))
    o = output.astype(_acc(output))
    return g - jnp.exp(o) * jnp.sum(g, axis=dims(dim, o.ndim), keepdims=True)


# -- losses -------------------------------------------------------------------------------------
def reduce_loss(loss, reduction):
    """ATen's Reduction enum: 0 none, 1 mean, 2 sum (shared by every loss lowering)."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _nll_targets(self, target, weight, ignore_index):
    """(class dim, target classes with ignored ones at 0, per-target weight with ignored ones 0)."""
    cdim = 1 if self.ndim >= 2 else 0   # 0 for unbatched input
    t = target.astype(jnp.int64)
    valid = t != ignore_index
    safe = jnp.where(valid, t, 0)
    w = weight[safe] if weight is not None else jnp.ones(safe.shape, self.dtype)
    return cdim, safe, jnp.where(valid, w, 0).astype(self.dtype)


def _nll(self, target, weight, reduction, ignore_index):
    cdim, safe, w = _nll_targets(self, target, weight, ignore_index)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe, cdim), axis=cdim).squeeze(cdim) if self.ndim >= 2 \
        else self[safe]
    loss = -picked * w
    total_weight = jnp.sum(w)
    if reduction == 1:
        return jnp.sum(loss) / total_weight, total_weight
    if reduction == 2:
        return jnp.sum(loss), total_weight
    return loss, total_weight


@lowering("nll_loss_forward.default", "nll_loss2d_forward.default")
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll(self, target, weight, reduction, ignore_index)


@lowering("nll_loss_backward.default", "nll_loss2d_backward.default")
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    # -grad * weight at each target class, 0 elsewhere: a compare against the class index fuses
    # with the log-softmax backward that follows, where a scatter would materialise a zero
    # (batch x classes) tensor first.
    cdim, safe, w = _nll_targets(self, target, weight, ignore_index)
    coef = -grad_output.astype(self.dtype).reshape(() if reduction else target.shape) * w
    if reduction == 1:
        coef = coef / total_weight.astype(self.dtype)
    classes = lax.broadcasted_iota(jnp.int64, self.shape, cdim)
    hit = classes == jnp.expand_dims(safe, cdim)
    return jnp.where(hit, jnp.expand_dims(coef, cdim), jnp.zeros((), self.dtype))


@lowering("mse_loss.default", promote="result", promote_args=("self", "target"))
def mse_loss(self, target, reduction=1):
    return reduce_loss(jnp.square(self - target), reduction)


@lowering("mse_loss_backward.default", promote="result", promote_args=("grad_output", "self", "target"))
def mse_loss_backward(grad_output, self, target, reduction):
    scale = 2.0 / self.size if reduction == 1 else 2.0
    return grad_output * (self - target) * scale


@lowering("l1_loss.default", promote="result", promote_args=("self", "target"), graph_only=True)
def l1_loss(self, target, reduction=1):
    return reduce_loss(jnp.abs(self - target), reduction)


def _smooth_l1(self, target, beta):
    d = jnp.abs(self - target)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta) if beta > 0 else d


@lowering("smooth_l1_loss.default", promote="result", promote_args=("self", "target"))
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    return reduce_loss(_smooth_l1(self, target, beta), reduction)


@lowering("smooth_l1_loss_backward.default", promote="result", promote_args=("grad_output", "self", "target"))
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    _, vjp = jax.vjp(lambda x: reduce_loss(_smooth_l1(x, target, beta), reduction), self)
    return vjp(jnp.broadcast_to(grad_output, () if reduction else self.shape).astype(self.dtype))[0]


def _huber(self, target, delta):
    d = jnp.abs(self - target)
    return jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


@lowering("huber_loss.default", promote="result", promote_args=("self", "target"))
def huber_loss(self, target, reduction=1, delta=1.0):
    return reduce_loss(_huber(self, target, delta), reduction)


@lowering("huber_loss_backward.default", promote="result", promote_args=("grad_output", "self", "target"))
def huber_loss_backward(grad_output, self, target, reduction, delta):
    _, vjp = jax.vjp(lambda x: reduce_loss(_huber(x, target, delta), reduction), self)
    return vjp(jnp.broadcast_to(grad_output, () if reduction else self.shape).astype(self.dtype))[0]


def _bce(self, target, weight):
    log_p = jnp.maximum(jnp.log(self), -100)
    log_1p = jnp.maximum(jnp.log1p(-self), -100)
    loss = -(target * log_p + (1 - target) * log_1p)
    return loss * weight if weight is not None else loss


@lowering("binary_cross_entropy.default", promote="result", promote_args=("self", "target", "weight"))
def binary_cross_entropy(self, target, weight=None, reduction=1):
    return reduce_loss(_bce(self, target, weight), reduction)


@lowering("binary_cross_entropy_backward.default", promote="result",
          promote_args=("grad_output", "self", "target", "weight"))
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    eps = 1e-12
    g = grad_output * (self - target) / jnp.maximum((1 - self) * self, eps)
    if weight is not None:
        g = g * weight
    return g / self.size if reduction == 1 else g


@lowering("binary_cross_entropy_with_logits.default", promote="result",
          promote_args=("self", "target", "weight", "pos_weight"))
def bce_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    # Half precision computes in float32 and rounds once (the kernel casts the result).
    acc = _acc(self)
    self, target = self.astype(acc), target.astype(acc)
    weight = None if weight is None else weight.astype(acc)
    pos_weight = None if pos_weight is None else pos_weight.astype(acc)
    log_sig = jax.nn.log_sigmoid(self)
    log_sig_neg = jax.nn.log_sigmoid(-self)
    if pos_weight is not None:
        loss = -(pos_weight * target * log_sig + (1 - target) * log_sig_neg)
    else:
        loss = -(target * log_sig + (1 - target) * log_sig_neg)
    if weight is not None:
        loss = loss * weight
    return reduce_loss(loss, reduction)
