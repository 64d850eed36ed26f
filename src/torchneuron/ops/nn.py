"""Neural-network lowerings: convolution, normalisation, softmax (pooling and losses have their
own files).

Backward ops are the JAX vector-Jacobian product of the forward lowering, so forward and gradient
can never disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .numerics import compute_dtype
from .precision import CONVOLUTION, convolution_precision
from .reductions import dims
from .registry import lowering


def _acc(x):
    """Compute dtype for normalisations and softmax: half types in float32 (as PyTorch's CPU does)."""
    return compute_dtype(x.dtype)


# -- convolution ----------------------------------------------------------------------------------
def _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = weight.ndim - 2
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = lax.conv_dimension_numbers(input.shape, weight.shape if not transposed else
                                    (weight.shape[1] * groups, weight.shape[0] // groups) + weight.shape[2:],
                                    ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    stride, padding, dilation = expand_param(stride, nd), expand_param(padding, nd), expand_param(dilation, nd)
    acc = _acc(input)   # half precision accumulates in float32 and rounds once
    if not transposed:
        out = lax.conv_general_dilated(
            input, weight, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups, precision=convolution_precision(),
            preferred_element_type=acc)
    else:
        output_padding = expand_param(output_padding, nd)
        cin, cout_g = weight.shape[0], weight.shape[1]
        k = weight.shape[2:]
        w = weight.reshape((groups, cin // groups, cout_g) + k)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
                for kk, p, d, op in zip(k, padding, dilation, output_padding)]
        out = lax.conv_general_dilated(
            input, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride,
            rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups, precision=convolution_precision(),
            preferred_element_type=acc)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(acc)
    return out.astype(input.dtype)


def expand_param(v, n):
    """A per-dim conv/pool parameter (kernel, stride...) given once or per dim, as ``n`` values."""
    v = tuple(v)
    return v * n if len(v) == 1 else v


@lowering("convolution.default", precision=CONVOLUTION, promote="common", promote_args=("input", "weight", "bias"))
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    if input.shape[1] == 0:
        # ATen's "empty" convolution backend: an input without channels gives a result without
        # channels (whatever the weight's), as PyTorch's meta kernel says too.
        out = out[:, :0]
    return out


@lowering("convolution_backward.default", precision=CONVOLUTION)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    if input.shape[1] == 0:
        # An input without channels gives a result without channels (see convolution): nothing
        # flows back to the input, the weight or the bias.
        return (jnp.zeros(input.shape, input.dtype) if output_mask[0] else None,
                jnp.zeros(weight.shape, weight.dtype) if output_mask[1] else None,
                jnp.zeros(tuple(bias_sizes), grad_output.dtype) if output_mask[2] and bias_sizes else None)

    def f(x, w):
        return _conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, input, weight)
    gx, gw = vjp(grad_output.astype(input.dtype))
    gb = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


# -- normalisation --------------------------------------------------------------------------------
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


# In eval mode ATen's CPU (and CUDA) kernels save no statistics: save_mean and save_invstd are empty
# (shape (0,)), where the meta kernels say (C,); the shapes come from the lowering itself.
@lowering("_native_batch_norm_legit.default", shape_from_lowering=True)
def native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, rm, rv = _bn_train(input, weight, bias, running_mean, running_var, momentum, eps)
        return rm, rv, out, mean, invstd
    return (running_mean, running_var) + _bn_eval_saving_stats(input, weight, bias, running_mean, running_var, eps)


def _bn_eval_saving_stats(input, weight, bias, running_mean, running_var, eps):
    # Nothing is saved in eval mode (the backward reads the running statistics), as on CPU.
    empty = jnp.zeros((0,), _acc(input))
    return _bn_eval(input, weight, bias, running_mean, running_var, eps), empty, empty


@lowering("_native_batch_norm_legit.no_stats")
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    out, mean, invstd, _, _ = _bn_train(input, weight, bias, None, None, momentum, eps)
    return out, mean, invstd


@lowering("_native_batch_norm_legit_no_training.default", shape_from_lowering=True)
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    empty = jnp.zeros((0,), _acc(input))
    return _bn_eval(input, weight, bias, running_mean, running_var, eps), empty, empty


@lowering("native_batch_norm.default", mutates=("running_mean", "running_var"), shape_from_lowering=True)
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


@lowering("_batch_norm_no_update.default", shape_from_lowering=True)
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


# -- softmax --------------------------------------------------------------------------------------
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
