"""Elementwise lowerings: arithmetic, comparisons, unary math, activations and their backwards.

Inputs arrive already promoted to the result dtype (``promote="result"``) or to their common
dtype (``promote="common"``, used by comparisons), so each body is just the math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy import special as jsp

from .checks import nonzero_divisor
from .numerics import compute_dtype
from .registry import InvalidArguments, lowering


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_


# -- arithmetic ----------------------------------------------------------------------------------
@lowering("add.Tensor", "add.Scalar", promote="result", promote_args=("self", "other"))
def add(self, other, alpha=1):
    _check_alpha(self, alpha)
    if jnp.result_type(self) == jnp.bool_:
        return jnp.logical_or(self, jnp.logical_and(other, alpha))
    return _scaled(lambda a, b: a + b, self, other, alpha)


@lowering("sub.Tensor", "sub.Scalar", promote="result", promote_args=("self", "other"))
def sub(self, other, alpha=1):
    _check_alpha(self, alpha)
    return _scaled(lambda a, b: a - b, self, other, alpha)


@lowering("rsub.Tensor", "rsub.Scalar", promote="result", promote_args=("self", "other"))
def rsub(self, other, alpha=1):
    _check_alpha(self, alpha)
    return _scaled(lambda a, b: a - b, other, self, alpha)


def _check_alpha(result, alpha) -> None:
    """ATen's alpha_check, which meta kernels skip; alpha's Python type is part of the cache key, so
    this runs once per key, while the executable is traced."""
    dtype, kind = jnp.result_type(result), jnp.result_type(alpha)
    if (_is_int(result)) and jnp.issubdtype(kind, jnp.inexact):
        raise InvalidArguments("For integral input tensors, argument alpha must not be a floating point number.")
    if not jnp.issubdtype(dtype, jnp.complexfloating) and jnp.issubdtype(kind, jnp.complexfloating):
        raise InvalidArguments("For non-complex input tensors, argument alpha must not be a complex number.")


def _scaled(op, self, other, alpha):
    """``op(self, other * alpha)`` rounded once for half precision (ATen's opmath), not per step."""
    dtype = jnp.result_type(self)
    compute = compute_dtype(dtype)
    if compute == dtype:
        return op(self, other * alpha)
    return op(self.astype(compute), jnp.asarray(other).astype(compute) * alpha).astype(dtype)


@lowering("mul.Tensor", "mul.Scalar", promote="result", promote_args=("self", "other"))
def mul(self, other):
    if jnp.result_type(self) == jnp.bool_:
        return jnp.logical_and(self, other)
    return self * other


@lowering("div.Tensor", "div.Scalar", promote="result", promote_args=("self", "other"))
def div(self, other):
    return self / other


@lowering("div.Tensor_mode", "div.Scalar_mode", promote="result", promote_args=("self", "other"))
def div_mode(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return self / other
    if rounding_mode == "floor":
        return floor_divide(self, other)
    if _is_int(self):
        nonzero_divisor(other)
        a, b = jnp.broadcast_arrays(self, jnp.asarray(other, jnp.result_type(self)))
        return lax.div(a, b)   # C's truncating integer division
    dtype = jnp.result_type(self)
    compute = compute_dtype(dtype)
    return jnp.trunc(_ieee_div(jnp.asarray(self, compute), jnp.asarray(other, compute))).astype(dtype)


@lowering("floor_divide.default", "floor_divide.Scalar", promote="result", promote_args=("self", "other"))
def floor_divide(self, other):
    if _is_int(self):
        nonzero_divisor(other)
        return jnp.floor_divide(self, other)
    dtype = jnp.result_type(self)
    compute = compute_dtype(dtype)
    return _div_floor_float(jnp.asarray(self, compute), jnp.asarray(other, compute)).astype(dtype)


def _ieee_div(a, b):
    """a / b as IEEE division. XLA rewrites a division by a broadcast operand into a multiplication by
    its reciprocal, up to an ulp off -- enough to move an exact integer quotient (5.125 / 5.125) below
    1 before floor/trunc. Both operands pass an optimisation barrier at full shape to keep the divide."""
    a, b = lax.optimization_barrier(tuple(jnp.broadcast_arrays(a, b)))
    return a / b


def _div_floor_float(a, b):
    """ATen's div_floor_floating: the quotient of a - fmod(a, b), so a quotient that rounds up to an
    integer (1 / 0.1 -> 10.000000000000002) still floors to 9; division by zero gives IEEE inf/nan,
    and a zero quotient keeps the sign of a / b."""
    mod = jnp.fmod(a, b)
    div = _ieee_div(a - mod, b)
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floordiv = jnp.floor(div)
    floordiv = jnp.where(div - floordiv > 0.5, floordiv + 1, floordiv)
    quotient = a / b   # only its sign and its IEEE inf/nan are used
    floordiv = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), quotient), floordiv)
    return jnp.where(b == 0, quotient, floordiv)


@lowering("remainder.Tensor", "remainder.Scalar", "remainder.Scalar_Tensor", promote="result",
          promote_args=("self", "other"))
def remainder(self, other):
    nonzero_divisor(other)   # integers only; floats give NaN like CPU
    return jnp.remainder(self, other)


@lowering("fmod.Tensor", "fmod.Scalar", promote="result", promote_args=("self", "other"))
def fmod(self, other):
    nonzero_divisor(other)
    return jnp.fmod(self, other)


@lowering("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar", promote="result",
          promote_args=("self", "exponent"))
def pow_(self, exponent):
    if _is_int(self):
        if isinstance(exponent, int):
            return lax.integer_pow(self, exponent)
        # A negative integer power is 0 except for bases 1 and -1 (ATen's powi).
        exponent = jnp.asarray(exponent)
        positive = jnp.power(self, jnp.maximum(exponent, 0))
        odd = (exponent % 2) != 0
        negative = jnp.where(self == 1, 1, jnp.where(self == -1, jnp.where(odd, -1, 1), 0)).astype(positive.dtype)
        return jnp.where(exponent < 0, negative, positive)
    return jnp.power(self, exponent)


@lowering("float_power.Tensor_Tensor", "float_power.Tensor_Scalar", "float_power.Scalar", promote="result",
          promote_args=("self", "exponent"), graph_only=True)
def float_power(self, exponent):
    return jnp.power(self, exponent)


@lowering("max.other", promote="result", promote_args=("self", "other"), graph_only=True)
@lowering("maximum.default", promote="result", promote_args=("self", "other"))
def maximum(self, other):
    return jnp.maximum(self, other)


@lowering("min.other", promote="result", promote_args=("self", "other"), graph_only=True)
@lowering("minimum.default", promote="result", promote_args=("self", "other"))
def minimum(self, other):
    return jnp.minimum(self, other)


@lowering("fmax.default", promote="result", promote_args=("self", "other"))
def fmax(self, other):
    return jnp.fmax(self, other)


@lowering("fmin.default", promote="result", promote_args=("self", "other"))
def fmin(self, other):
    return jnp.fmin(self, other)


@lowering("atan2.default", promote="result", promote_args=("self", "other"))
def atan2(self, other):
    return jnp.arctan2(self, other)


@lowering("hypot.default", promote="result", promote_args=("self", "other"))
def hypot(self, other):
    return jnp.hypot(self, other)


@lowering("copysign.Tensor", "copysign.Scalar", promote="result", promote_args=("self", "other"))
def copysign(self, other):
    return jnp.copysign(self, other)


@lowering("nextafter.default", promote="result", promote_args=("self", "other"))
def nextafter(self, other):
    return jnp.nextafter(self, other)


@lowering("xlogy.Tensor", "xlogy.Scalar_Self", "xlogy.Scalar_Other", promote="result",
          promote_args=("self", "other"))
def xlogy(self, other):
    return jsp.xlogy(self, other)


@lowering("logaddexp.default", promote="result", promote_args=("self", "other"))
def logaddexp(self, other):
    return jnp.logaddexp(self, other)


@lowering("logaddexp2.default", promote="result", promote_args=("self", "other"))
def logaddexp2(self, other):
    return jnp.logaddexp2(self, other)


@lowering("lerp.Scalar", "lerp.Tensor", promote="result", promote_args=("self", "end", "weight"))
def lerp(self, end, weight):
    # ATen's formula (exact at both ends), in float32 for half precision.
    dtype = jnp.result_type(self)
    x, y, w = (jnp.asarray(v).astype(compute_dtype(dtype)) for v in (self, end, weight))
    out = jnp.where(jnp.abs(w) < 0.5, x + w * (y - x), y - (y - x) * (1 - w))
    return out.astype(dtype)


@lowering("addcmul.default", promote="result", promote_args=("self", "tensor1", "tensor2"))
def addcmul(self, tensor1, tensor2, *, value=1):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        value = jnp.asarray(value).astype(self.dtype)   # ATen converts the Scalar first: int(1.5) == 1
    # One rounding for half precision, like ATen's opmath kernel (not one per multiply/add).
    dt = compute_dtype(self.dtype)
    return (self.astype(dt) + value * tensor1.astype(dt) * tensor2.astype(dt)).astype(self.dtype)


@lowering("addcdiv.default", promote="result", promote_args=("self", "tensor1", "tensor2"))
def addcdiv(self, tensor1, tensor2, *, value=1):
    dt = compute_dtype(self.dtype)
    return (self.astype(dt) + value * (tensor1.astype(dt) / tensor2.astype(dt))).astype(self.dtype)


# -- comparisons and logic ----------------------------------------------------------------------
def _compare(name, fn):
    lowering(f"{name}.Tensor", f"{name}.Scalar", promote="common", promote_args=("self", "other"))(fn)


_compare("eq", lambda self, other: self == other)
_compare("ne", lambda self, other: self != other)
_compare("lt", lambda self, other: self < other)
_compare("le", lambda self, other: self <= other)
_compare("gt", lambda self, other: self > other)
_compare("ge", lambda self, other: self >= other)


@lowering("logical_and.default")
def logical_and(self, other):
    return jnp.logical_and(self != 0, other != 0)


@lowering("logical_or.default")
def logical_or(self, other):
    return jnp.logical_or(self != 0, other != 0)


@lowering("logical_xor.default")
def logical_xor(self, other):
    return jnp.logical_xor(self != 0, other != 0)


@lowering("logical_not.default")
def logical_not(self):
    return self == 0


@lowering("gcd.default", promote="result", promote_args=("self", "other"))
def gcd(self, other):
    return jnp.gcd(self, other)   # non-negative; gcd(0, 0) = 0, as ATen


@lowering("lcm.default", promote="result", promote_args=("self", "other"))
def lcm(self, other):
    # ATen: |a / gcd(a, b) * b| (the division is exact), 0 when both are 0; C++ computes it in int
    # at least (integer promotion), so small types wrap only when the result is stored.
    dtype = jnp.result_type(self)
    a, b = jnp.asarray(self, jnp.int64), jnp.asarray(other, jnp.int64)
    g = jnp.gcd(a, b)
    return jnp.where(g == 0, 0, jnp.abs(a // jnp.where(g == 0, 1, g) * b)).astype(dtype)


@lowering("bitwise_and.Tensor", "bitwise_and.Scalar", promote="result", promote_args=("self", "other"))
def bitwise_and(self, other):
    return jnp.bitwise_and(self, other)


@lowering("bitwise_or.Tensor", "bitwise_or.Scalar", promote="result", promote_args=("self", "other"))
def bitwise_or(self, other):
    return jnp.bitwise_or(self, other)


@lowering("bitwise_xor.Tensor", "bitwise_xor.Scalar", promote="result", promote_args=("self", "other"))
def bitwise_xor(self, other):
    return jnp.bitwise_xor(self, other)


@lowering("bitwise_not.default")
def bitwise_not(self):
    return jnp.logical_not(self) if jnp.result_type(self) == jnp.bool_ else jnp.invert(self)


@lowering("bitwise_left_shift.Tensor", "bitwise_left_shift.Tensor_Scalar", promote="result",
          promote_args=("self", "other"))
def left_shift(self, other):
    return jnp.left_shift(self, other)


@lowering("bitwise_right_shift.Tensor", "bitwise_right_shift.Tensor_Scalar", promote="result",
          promote_args=("self", "other"))
def right_shift(self, other):
    return jnp.right_shift(self, other)


@lowering("where.self", promote="common", promote_args=("self", "other"))
def where(condition, self, other):
    return jnp.where(condition, self, other)


@lowering("clamp.default", "clamp.Tensor", promote="result", promote_args=("self", "min", "max"))
def clamp(self, min=None, max=None):
    if min is not None:
        self = jnp.where(jnp.isnan(self), self, jnp.maximum(self, min)) if not _is_int(self) else jnp.maximum(self, min)
    if max is not None:
        self = jnp.where(jnp.isnan(self), self, jnp.minimum(self, max)) if not _is_int(self) else jnp.minimum(self, max)
    return self


@lowering("clamp_min.default", "clamp_min.Tensor", promote="result", promote_args=("self", "min"))
def clamp_min(self, min):
    return clamp(self, min=min)


@lowering("clamp_max.default", "clamp_max.Tensor", promote="result", promote_args=("self", "max"))
def clamp_max(self, max):
    return clamp(self, max=max)


@lowering("isnan.default")
def isnan(self):
    return jnp.isnan(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowering("isinf.default")
def isinf(self):
    return jnp.isinf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowering("isposinf.default")
def isposinf(self):
    return jnp.isposinf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowering("isneginf.default")
def isneginf(self):
    return jnp.isneginf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowering("signbit.default")
def signbit(self):
    return jnp.signbit(self) if not _is_int(self) else self < 0


@lowering("nan_to_num.default", promote="result", promote_args=("self",))
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if _is_int(self):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


def digamma(x):
    """ATen's digamma: -inf at +0 (+inf at -0), NaN at the negative integers (poles)."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jsp.digamma(x))


# -- unary math ---------------------------------------------------------------------------------
def _unary(name, fn, promote="result"):
    lowering(f"{name}.default", promote=promote, promote_args=("self",),
             graph_only=name in _COMPOSITE_UNARY)(fn)


# CompositeImplicitAutograd in PyTorch: eager mode runs their decompositions.
_COMPOSITE_UNARY = {"square", "conj_physical", "special_ndtr"}


for _name, _fn in {
    "abs": jnp.abs, "neg": jnp.negative, "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1,
    "log": jnp.log, "log2": jnp.log2, "log10": jnp.log10, "log1p": jnp.log1p, "sqrt": jnp.sqrt,
    "rsqrt": lax.rsqrt, "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "asin": jnp.arcsin,
    "acos": jnp.arccos, "atan": jnp.arctan, "sinh": jnp.sinh, "cosh": jnp.cosh, "tanh": jnp.tanh,
    "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh, "sigmoid": jax.nn.sigmoid,
    "erf": jsp.erf, "erfc": jsp.erfc, "erfinv": jsp.erfinv, "reciprocal": jnp.reciprocal,
    "lgamma": jsp.gammaln, "digamma": digamma, "i0": jsp.i0, "sinc": jnp.sinc,
    "deg2rad": jnp.deg2rad, "rad2deg": jnp.rad2deg, "square": jnp.square,
    "conj_physical": jnp.conj, "_conj_physical": jnp.conj, "angle": jnp.angle,
    "special_i0e": jsp.i0e, "special_i1": jsp.i1, "special_i1e": jsp.i1e,
    "special_ndtri": jsp.ndtri, "special_erfcx": jsp.erfcx, "special_ndtr": jsp.ndtr,
    "special_log_ndtr": jsp.log_ndtr,
}.items():
    _unary(_name, _fn)


def _keep_int(fn):
    return lambda self: self if _is_int(self) else fn(self)


for _name, _fn in {"ceil": jnp.ceil, "floor": jnp.floor, "trunc": jnp.trunc, "round": jnp.round}.items():
    _unary(_name, _keep_int(_fn))


@lowering("round.decimals", promote="result", promote_args=("self",))
def round_decimals(self, *, decimals=0):
    scale = 10.0 ** decimals
    return jnp.round(self * scale) / scale


@lowering("frac.default", promote="result", promote_args=("self",))
def frac(self):
    return self - jnp.trunc(self)


@lowering("sign.default", promote="result", promote_args=("self",))
def sign(self):
    if jnp.result_type(self) == jnp.bool_:
        return self
    return jnp.sign(self)


@lowering("sgn.default", promote="result", promote_args=("self",))
def sgn(self):
    if jnp.iscomplexobj(self):
        mag = jnp.abs(self)
        return jnp.where(mag == 0, 0, self / jnp.where(mag == 0, 1, mag))
    return sign(self)


@lowering("logit.default", promote="result", promote_args=("self",))
def logit(self, eps=None):
    if eps is not None:
        self = jnp.clip(self, eps, 1 - eps)
    return jnp.log(self / (1 - self))


@lowering("mvlgamma.default", promote="result", promote_args=("self",))
def mvlgamma(self, p):
    return jsp.multigammaln(self, p)


# -- activations and their backwards ------------------------------------------------------------
@lowering("relu.default", promote="result", promote_args=("self",))
def relu(self):
    return jnp.maximum(self, 0)


@lowering("threshold.default", promote="result", promote_args=("self",))
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, value, self)


@lowering("threshold_backward.default", promote="result", promote_args=("grad_output", "self"))
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, 0, grad_output)


# GELU as ATen computes it, in the opmath dtype: x/2 * (1 + erf(x/sqrt(2))). XLA's erf is one
# rational polynomial, while the erfc form (jax.nn.gelu) evaluates both of erfc's branches and an
# exp per element, about 4x the work in a transformer's MLP.
@lowering("gelu.default", promote="result", promote_args=("self",))
def gelu(self, *, approximate="none"):
    x = self.astype(compute_dtype(self.dtype))
    if approximate == "tanh":
        inner = np.sqrt(2 / np.pi).astype(x.dtype) * (x + 0.044715 * x * x * x)
        out = 0.5 * x * (1 + jnp.tanh(inner))
    else:
        out = 0.5 * x * (1 + jsp.erf(x * np.sqrt(0.5).astype(x.dtype)))
    return out.astype(self.dtype)


@lowering("gelu_backward.default", promote="result", promote_args=("grad_output", "self"))
def gelu_backward(grad_output, self, *, approximate="none"):
    dt = compute_dtype(self.dtype)
    x, g = self.astype(dt), grad_output.astype(dt)
    if approximate == "tanh":
        k = np.sqrt(2 / np.pi).astype(dt)
        t = jnp.tanh(k * (x + 0.044715 * x * x * x))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1 + jsp.erf(x * np.sqrt(0.5).astype(dt)))
        pdf = jnp.exp(-0.5 * x * x) * (1 / np.sqrt(2 * np.pi)).astype(dt)
        d = cdf + x * pdf
    return (g * d).astype(self.dtype)


@lowering("silu.default", promote="result", promote_args=("self",))
def silu(self):
    return self * jax.nn.sigmoid(self)


@lowering("silu_backward.default", promote="result", promote_args=("grad_output", "self"), graph_only=True)
def silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


@lowering("sigmoid_backward.default", promote="result", promote_args=("grad_output", "output"))
def sigmoid_backward(grad_output, output):
    return grad_output * output * (1 - output)


@lowering("tanh_backward.default", promote="result", promote_args=("grad_output", "output"))
def tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


@lowering("leaky_relu.default", promote="result", promote_args=("self",))
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@lowering("leaky_relu_backward.default", promote="result", promote_args=("grad_output", "self"))
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@lowering("elu.default", promote="result", promote_args=("self",))
def elu(self, alpha=1, scale=1, input_scale=1):
    return jnp.where(self > 0, self * scale, alpha * scale * jnp.expm1(self * input_scale))


@lowering("elu_backward.default", promote="result", promote_args=("grad_output", "self_or_result"))
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    x = self_or_result
    if is_result:
        neg = grad_output * input_scale * (x + alpha * scale)
    else:
        neg = grad_output * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x > 0, grad_output * scale, neg)


@lowering("hardtanh.default", promote="result", promote_args=("self",))
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, min_val, max_val)


@lowering("hardtanh_backward.default", promote="result", promote_args=("grad_output", "self"))
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output)


@lowering("softplus.default", promote="result", promote_args=("self",))
def softplus(self, beta=1, threshold=20):
    scaled = self * beta
    return jnp.where(scaled > threshold, self, jnp.log1p(jnp.exp(scaled)) / beta)


@lowering("softplus_backward.default", promote="result", promote_args=("grad_output", "self"))
def softplus_backward(grad_output, self, beta, threshold):
    scaled = self * beta
    return jnp.where(scaled > threshold, grad_output, grad_output * jax.nn.sigmoid(scaled))


@lowering("hardsigmoid.default", promote="result", promote_args=("self",))
def hardsigmoid(self):
    return jnp.clip(self / 6 + 0.5, 0, 1)


@lowering("hardsigmoid_backward.default", promote="result", promote_args=("grad_output", "self"))
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), grad_output / 6, 0)


@lowering("hardswish.default", promote="result", promote_args=("self",))
def hardswish(self):
    return self * jnp.clip(self + 3, 0, 6) / 6


@lowering("hardswish_backward.default", promote="result", promote_args=("grad_output", "self"))
def hardswish_backward(grad_output, self):
    # ATen's boundaries: 0 up to and at -3, the slope strictly inside, the gradient from 3 on.
    return jnp.where(self <= -3, 0, jnp.where(self < 3, grad_output * ((self / 3) + 0.5), grad_output))


@lowering("mish.default", promote="result", promote_args=("self",))
def mish(self):
    return self * jnp.tanh(jax.nn.softplus(self))


@lowering("mish_backward.default", promote="result", promote_args=("grad_output", "self"), graph_only=True)
def mish_backward(grad_output, self):
    sp = jax.nn.softplus(self)
    t = jnp.tanh(sp)
    return grad_output * (t + self * (1 - t * t) * jax.nn.sigmoid(self))


@lowering("log_sigmoid_forward.default", promote="result", promote_args=("self",))
def log_sigmoid_forward(self):
    # The buffer is exp(-|x|) on CPU (same shape as the input); the backward lowering ignores it.
    return jax.nn.log_sigmoid(self), jnp.exp(-jnp.abs(self))


@lowering("log_sigmoid_backward.default", promote="result", promote_args=("grad_output", "self"))
def log_sigmoid_backward(grad_output, self, buffer):
    return grad_output * jax.nn.sigmoid(-self)


@lowering("softshrink.default", promote="result", promote_args=("self",))
def softshrink(self, lambd=0.5):
    return jnp.where(self > lambd, self - lambd, jnp.where(self < -lambd, self + lambd, 0))


@lowering("hardshrink.default", promote="result", promote_args=("self",))
def hardshrink(self, lambd=0.5):
    # Zero inside [-lambd, lambd]; NaN is outside (it propagates, as on CPU).
    return jnp.where((self >= -lambd) & (self <= lambd), 0, self)


@lowering("prelu.default", promote="result", promote_args=("self", "weight"), graph_only=True)
@lowering("_prelu_kernel.default", promote="result", promote_args=("self", "weight"))
def prelu(self, weight):
    if weight.ndim == 1 and self.ndim >= 2:
        weight = weight.reshape((1, -1) + (1,) * (self.ndim - 2))
    return jnp.where(self > 0, self, self * weight)


@lowering("frexp.Tensor")
def frexp(self):
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


@lowering("softshrink_backward.default", promote="result", promote_args=("grad_output", "self"))
def softshrink_backward(grad_output, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), 0, grad_output)


@lowering("hardshrink_backward.default", promote="result", promote_args=("grad_out", "self"))
def hardshrink_backward(grad_out, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), 0, grad_out)


@lowering("rrelu_with_noise.default", random=True)
def rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key):
    """Returns the new noise (slopes; 1 for non-negative inputs) and the output, as ATen does."""
    if not training:
        slope = (lower + upper) / 2
        return noise, jnp.where(self >= 0, self, self * slope)
    compute = compute_dtype(self.dtype)
    r = jax.random.uniform(key, self.shape, compute, lower, upper).astype(self.dtype)
    slopes = jnp.where(self >= 0, jnp.ones_like(self), r)
    return slopes.astype(noise.dtype), self * slopes
