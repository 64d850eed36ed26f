"""``_foreach_*`` and the fused optimizer steps (``_fused_adam(w)_``): one executable for a whole
list of tensors (what optimizers and grad clipping call), instead of PyTorch's composite fallback
of one op -- one executable launch -- per tensor.

Each list op applies the registered lowering of its single-tensor counterpart to every element,
so the math (integer rounding, NaN rules...) is the same as ``torch.add`` & co. Scalars and
``Scalar[]`` lists are runtime inputs (a new learning rate compiles nothing); in-place forms
(``_foreach_add_``) are derived by the kernel layer like every other op.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..runtime.dtypes import jax_dtype
from . import registry
from .numerics import compute_dtype
from .registry import lowering


def _fn(name):
    """The single-tensor lowering ``name``, looked up at trace time (modules import in any order)."""
    def call(*args, **kwargs):
        return registry.get(name).fn(*args, **kwargs)
    return call


def _promoted(x, y):
    """x and y in their common dtype (scalars are weakly typed, so a tensor's dtype wins)."""
    if y is None:
        return x, y
    dt = jnp.result_type(x, y)
    return x.astype(dt), jnp.asarray(y).astype(dt)


def _each(xs, others):
    """Per-tensor second operands: a list (List/ScalarList), or one value for all (Scalar/Tensor)."""
    if isinstance(others, list | tuple):
        return list(others)
    return [others] * len(xs)


# -- unary --------------------------------------------------------------------------------------
_UNARY = ["abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor",
          "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid",
          "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc"]


# Unary ops whose result keeps an integer input's dtype; the others compute in the default float
# dtype (as the single-tensor kernels' promotion does before calling the same lowering).
_INTEGER_PRESERVING = {"abs", "ceil", "floor", "frac", "neg", "round", "sign", "trunc"}


def _register_unary(name):
    fn = _fn(f"{name}.default")
    floating = name not in _INTEGER_PRESERVING

    def promote(x):
        exact = jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_
        return x.astype(jnp.float32) if floating and exact else x

    @lowering(f"_foreach_{name}.default")
    def unary(self):
        return [fn(promote(x)) for x in self]


for _name in _UNARY:
    _register_unary(_name)


@lowering("_foreach_zero.default")
def foreach_zero(self):
    return [jnp.zeros_like(x) for x in self]


@lowering("_foreach_copy.default")
def foreach_copy(self, src, non_blocking=False):
    return [jnp.broadcast_to((jnp.real(s) if jnp.iscomplexobj(s) and not jnp.iscomplexobj(x) else s).astype(x.dtype),
                             x.shape) for x, s in zip(self, src)]


# -- binary -------------------------------------------------------------------------------------
def _register_binary(name, single, overloads, alpha=False):
    fn = _fn(single)
    arg = {"Scalar": "scalar", "List": "other", "ScalarList": "scalars", "Tensor": "other"}
    for ov in overloads:
        if alpha and ov in ("List", "Tensor"):
            @lowering(f"_foreach_{name}.{ov}")
            def binary_alpha(self, other, *, alpha=1):
                return [fn(*_promoted(x, y), alpha) for x, y in zip(self, _each(self, other))]
        else:
            def binary(self, other):
                return [fn(*_promoted(x, y)) for x, y in zip(self, _each(self, other))]
            binary.__name__ = f"foreach_{name}_{arg[ov]}"
            lowering(f"_foreach_{name}.{ov}")(binary)


_register_binary("add", "add.Tensor", ("Scalar", "List", "ScalarList", "Tensor"), alpha=True)
_register_binary("sub", "sub.Tensor", ("Scalar", "List", "ScalarList"), alpha=True)
_register_binary("mul", "mul.Tensor", ("Scalar", "List", "ScalarList", "Tensor"))
_register_binary("div", "div.Tensor", ("Scalar", "List", "ScalarList", "Tensor"))
_register_binary("clamp_min", "clamp_min.default", ("Scalar", "List", "ScalarList"))
_register_binary("clamp_max", "clamp_max.default", ("Scalar", "List", "ScalarList"))
_register_binary("maximum", "maximum.default", ("Scalar", "List", "ScalarList"))
_register_binary("minimum", "minimum.default", ("Scalar", "List", "ScalarList"))
_register_binary("pow", "pow.Tensor_Tensor", ("List", "Scalar", "ScalarList"))


@lowering("_foreach_pow.ScalarAndTensor")
def foreach_pow_scalar_and_tensor(self, exponent):
    pow_ = _fn("pow.Tensor_Tensor")
    return [pow_(*_promoted(jnp.asarray(self), e)) for e in exponent]


# -- ternary ------------------------------------------------------------------------------------
def _register_pointwise(name, single):
    fn = _fn(single)

    def apply(self, tensor1, tensor2, values):
        out = []
        for x, a, b, v in zip(self, tensor1, tensor2, _each(self, values)):
            dt = jnp.result_type(x, a, b)
            # The scalar stays in the compute dtype: ATen does not round it to a half-precision list.
            out.append(fn(x.astype(dt), a.astype(dt), b.astype(dt), value=jnp.asarray(v).astype(compute_dtype(dt))))
        return out

    @lowering(f"_foreach_{name}.Scalar")
    def scalar(self, tensor1, tensor2, value=1):
        return apply(self, tensor1, tensor2, value)

    @lowering(f"_foreach_{name}.ScalarList")
    def scalar_list(self, tensor1, tensor2, scalars):
        return apply(self, tensor1, tensor2, scalars)

    @lowering(f"_foreach_{name}.Tensor")
    def tensor(self, tensor1, tensor2, scalars):
        return apply(self, tensor1, tensor2, [scalars[i] for i in range(len(self))])


_register_pointwise("addcmul", "addcmul.default")
_register_pointwise("addcdiv", "addcdiv.default")


def _lerp(self, end, weights):
    lerp = _fn("lerp.Tensor")
    out = []
    for x, e, w in zip(self, end, weights):
        dt = jnp.result_type(x, e)
        out.append(lerp(x.astype(dt), e.astype(dt), jnp.asarray(w).astype(compute_dtype(dt))))
    return out


@lowering("_foreach_lerp.List")
def foreach_lerp_list(self, tensors1, weights):
    return _lerp(self, tensors1, weights)


@lowering("_foreach_lerp.Scalar")
def foreach_lerp_scalar(self, tensors1, weight):
    return _lerp(self, tensors1, [weight] * len(self))


@lowering("_foreach_lerp.ScalarList")
def foreach_lerp_scalar_list(self, tensors1, weight):
    return _lerp(self, tensors1, weight)


# -- reductions and matmul ----------------------------------------------------------------------
@lowering("_foreach_norm.Scalar", static_scalars=True)
def foreach_norm(self, ord=2, dtype=None):
    norm = _fn("linalg_vector_norm.default")
    return [norm(x, ord, None, False, dtype=dtype) for x in self]


@lowering("_foreach_powsum.Scalar", static_scalars=True)
def foreach_powsum(self, ord=2, dtype=None):
    out = []
    for x in self:
        a = jnp.abs(x.astype(jax_dtype(dtype)) if dtype is not None else x)
        a = a.astype(jnp.float32) if a.dtype in (jnp.float16, jnp.bfloat16) else a
        out.append(jnp.sum((a != 0).astype(a.dtype)) if ord == 0 else jnp.sum(a ** ord))
    return out


@lowering("_foreach_max.default")
def foreach_max(self):
    return [jnp.max(x) for x in self]


@lowering("_foreach_mm.default")
def foreach_mm(self, mat2):
    mm = _fn("mm.default")
    return [mm(*_promoted(a, b)) for a, b in zip(self, mat2)]


# -- fused optimizer steps -------------------------------------------------------------------------
def _fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    """torch's fused Adam/AdamW step (``_fused_adam(w)_``), the arithmetic of its CPU kernel.

    Returns the new values of every mutated list, flattened in schema order: params, grads,
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs. ``state_steps`` were already incremented by the
    optimizer. With ``found_inf`` set (AMP overflow) nothing changes but the unscaled grads.
    """
    new_p, new_g, new_m, new_v, new_vmax = [], [], [], [], []
    skip = None if found_inf is None else (found_inf.reshape(()) == 1)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        work = jnp.float32 if jnp.finfo(p.dtype).bits < 32 else p.dtype
        pw, gw, mw, vw = (x.astype(work) for x in (p, g, m, v))
        if grad_scale is not None:
            gw = gw / grad_scale.reshape(()).astype(work)
        new_g.append(gw.astype(g.dtype))
        d = -gw if maximize else gw
        if weight_decay != 0:
            if decoupled:
                pw = pw * (1 - lr * weight_decay)
            else:
                d = d + weight_decay * pw
        step = state_steps[i].reshape(()).astype(work)
        mw = mw + (1 - beta1) * (d - mw)
        vw = beta2 * vw + (1 - beta2) * d * d
        bias1 = 1 - jnp.power(jnp.asarray(beta1, work), step)
        bias2_sqrt = jnp.sqrt(1 - jnp.power(jnp.asarray(beta2, work), step))
        if amsgrad:
            vmax = jnp.maximum(max_exp_avg_sqs[i].astype(work), vw)
            new_vmax.append(vmax)
            denom = jnp.sqrt(vmax) / bias2_sqrt + eps
        else:
            denom = jnp.sqrt(vw) / bias2_sqrt + eps
        pw = pw - (lr / bias1) * mw / denom
        new_p.append(pw)
        new_m.append(mw)
        new_v.append(vw)

    def keep(new, old):
        new = [n.astype(o.dtype) for n, o in zip(new, old)]
        return new if skip is None else [jnp.where(skip, o, n) for n, o in zip(new, old)]

    vmax_old = list(max_exp_avg_sqs)[: len(new_vmax)]
    return (*keep(new_p, params), *new_g, *keep(new_m, exp_avgs), *keep(new_v, exp_avg_sqs),
            *keep(new_vmax, vmax_old), *list(max_exp_avg_sqs)[len(new_vmax):])


def _fused_adam_lowering(decoupled):
    def lower(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
              weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        if hasattr(lr, "reshape"):
            lr = lr.reshape(())
        return _fused_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                           weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled)
    return lower


# Trainer's default optimizer (adamw_torch_fused) and Adam/AdamW(fused=True).
lowering("_fused_adamw_.default", "_fused_adamw_.tensor_lr", derive_variants=False)(_fused_adam_lowering(True))
lowering("_fused_adam_.default", "_fused_adam_.tensor_lr", derive_variants=False)(_fused_adam_lowering(False))
