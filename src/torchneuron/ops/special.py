"""torch.special functions beyond the unary math in ``elementwise``: orthogonal polynomials,
incomplete gamma, zeta, entropy terms and spherical Bessel functions.

The polynomials follow ATen's scalar kernels (``ATen/native/Math.h``) case by case -- the closed
forms it uses for large degrees inside [-1, 1], its special values at the interval ends, and the
three-term recurrence otherwise -- so results agree to rounding. The degree ``n`` is a tensor, so
the recurrence runs as a ``while_loop`` up to the largest degree in the batch.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from .elementwise import digamma
from .numerics import compute_dtype
from .registry import lowering


def _degree(n):
    # ATen truncates a floating degree to int64; NaN/inf become -1 (the "return 0" branch).
    if jnp.issubdtype(n.dtype, jnp.floating):
        finite = jnp.isfinite(n)
        return jnp.where(finite, jnp.trunc(jnp.where(finite, n, 0)), -1).astype(jnp.int64)
    return n.astype(jnp.int64)


def _recurrence(x, n, p0, p1, step):
    """P_n for n >= 2 from P_0 = p0, P_1 = p1 and P_d = step(d, P_{d-2}, P_{d-1})."""
    x, n = jnp.broadcast_arrays(x, n)
    p0 = jnp.broadcast_to(p0, x.shape).astype(x.dtype)
    p1 = jnp.broadcast_to(p1, x.shape).astype(x.dtype)
    top = jnp.max(n) if n.size else jnp.int64(0)

    def cond(c):
        return c[0] <= top

    def body(c):
        d, p, q, out = c
        r = step(d.astype(x.dtype), p, q)
        return d + 1, q, r, jnp.where(n == d, r, out)

    _, _, _, out = lax.while_loop(cond, body, (jnp.int64(2), p0, p1, jnp.zeros_like(x)))
    return out


def _finish(x, n, special_cases, p0, p1, rec):
    """Apply ATen's branch order: n < 0 -> 0, then the (condition, value) special cases, then
    n == 0, n == 1 and the recurrence."""
    out = jnp.where(n == 1, p1, jnp.where(n == 0, p0, rec))
    for cond, value in reversed(special_cases):
        out = jnp.where(cond, value, out)
    return jnp.where(n < 0, jnp.zeros_like(out), out)


def _binary(name, fn):
    lowering(f"{name}.default", f"{name}.x_scalar", f"{name}.n_scalar", promote="result",
             promote_args=("x", "n"))(fn)


def _chebyshev(x, n, *, kind, shifted):
    n = _degree(n)
    x, n = jnp.broadcast_arrays(x, n)
    nf = n.astype(x.dtype)
    y = x + x - 1 if shifted else x
    one = jnp.ones_like(x)
    p1 = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
    rec = _recurrence(y, n, one, p1, lambda d, p, q: (y + y) * q - p)
    even = n % 2 == 0
    # Values at the ends of the interval (x = +-1, or 1 and 0 for the shifted kinds).
    at_top = x == 1
    at_bottom = (x == 0) if shifted else (x == -1)
    top = {"t": one, "u": nf + 1, "v": one, "w": nf + nf + 1}[kind]
    bottom = {"t": jnp.where(even, 1.0, -1.0), "u": jnp.where(even, nf + 1, -(nf + 1)),
              "v": jnp.where(even, nf + nf + 1, -(nf + nf + 1)), "w": jnp.where(even, 1.0, -1.0)}[kind]
    # Closed forms for large degrees strictly inside the interval.
    theta = jnp.arccos(jnp.clip(y, -1, 1))
    inside = jnp.abs(y) < 1
    threshold = {"t": 6, "u": 8, "v": 8, "w": 8}[kind] if not shifted else {"t": 6, "u": 6, "v": 6, "w": 4}[kind]
    if kind == "t":
        closed = jnp.cos(nf * theta)
    elif kind == "u":
        s = jnp.sin(theta)
        closed = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / jnp.where(s != 0, s, 1),
                           (nf + 1) * jnp.cos((nf + 1) * theta) / y)
    elif kind == "v":
        closed = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2),
                           jnp.where(even, nf + nf + 1, -(nf + nf + 1)))
    else:
        edge = jnp.where(x > 0, nf + nf + 1, jnp.where(even, 1.0, -1.0)) if not shifted else \
            jnp.where(even, 1.0, -1.0)
        closed = jnp.where(jnp.cos(theta / 2) != 1, jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2), edge)
    cases = [(at_top, top), (at_bottom, bottom), ((n > threshold) & inside, closed)]
    return _finish(x, n, cases, one, p1, rec).astype(x.dtype)


for _kind in "tuvw":
    _binary(f"special_chebyshev_polynomial_{_kind}",
            lambda x, n, _k=_kind: _chebyshev(x, n, kind=_k, shifted=False))
    _binary(f"special_shifted_chebyshev_polynomial_{_kind}",
            lambda x, n, _k=_kind: _chebyshev(x, n, kind=_k, shifted=True))


def _hermite_limit(dtype):
    return 128 if dtype in (jnp.float32, jnp.float16, jnp.bfloat16) else 512


@lowering("special_hermite_polynomial_h.default", "special_hermite_polynomial_h.x_scalar",
          "special_hermite_polynomial_h.n_scalar", promote="result", promote_args=("x", "n"))
def hermite_h(x, n):
    n = _degree(n)
    x, n = jnp.broadcast_arrays(x, n)
    one = jnp.ones_like(x)
    rec = _recurrence(x, n, one, x + x, lambda d, p, q: (x + x) * q - 2 * (d - 1) * p)
    cases = [(n > _hermite_limit(x.dtype), jnp.full_like(x, jnp.nan))]
    return _finish(x, n, cases, one, x + x, rec)


@lowering("special_hermite_polynomial_he.default", "special_hermite_polynomial_he.x_scalar",
          "special_hermite_polynomial_he.n_scalar", promote="result", promote_args=("x", "n"))
def hermite_he(x, n):
    n = _degree(n)
    x, n = jnp.broadcast_arrays(x, n)
    one = jnp.ones_like(x)
    rec = _recurrence(x, n, one, x, lambda d, p, q: x * q - (d - 1) * p)
    cases = [(n > _hermite_limit(x.dtype), jnp.full_like(x, jnp.nan))]
    return _finish(x, n, cases, one, x, rec)


@lowering("special_laguerre_polynomial_l.default", "special_laguerre_polynomial_l.x_scalar",
          "special_laguerre_polynomial_l.n_scalar", promote="result", promote_args=("x", "n"))
def laguerre_l(x, n):
    n = _degree(n)
    x, n = jnp.broadcast_arrays(x, n)
    one = jnp.ones_like(x)
    rec = _recurrence(x, n, one, 1 - x, lambda d, p, q: (((d - 1) * 2 + (1 - x)) * q - (d - 1) * p) / d)
    cases = [(x == 0, one)]
    return _finish(x, n, cases, one, 1 - x, rec)


@lowering("special_legendre_polynomial_p.default", "special_legendre_polynomial_p.x_scalar",
          "special_legendre_polynomial_p.n_scalar", promote="result", promote_args=("x", "n"))
def legendre_p(x, n):
    n = _degree(n)
    x, n = jnp.broadcast_arrays(x, n)
    one = jnp.ones_like(x)
    rec = _recurrence(x, n, one, x, lambda d, p, q: ((2 * d - 1) * x * q - (d - 1) * p) / d)
    sign = jnp.where((x > 0) | (n % 2 == 0), 1.0, -1.0).astype(x.dtype)
    cases = [(jnp.abs(x) == 1, sign)]
    return _finish(x, n, cases, one, x, rec)


# -- gamma, zeta and friends --------------------------------------------------------------------
@lowering("igamma.default", promote="result", promote_args=("self", "other"))
def igamma(self, other):
    return jsp.gammainc(self, other)


@lowering("igammac.default", promote="result", promote_args=("self", "other"))
def igammac(self, other):
    return jsp.gammaincc(self, other)


_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)


def _hurwitz_zeta(x, q):
    """ATen's Cephes zeta(x, q), including negative non-integer q for integer x (which
    polygamma needs): direct summation until a > 9, then Euler-Maclaurin, both with early exit."""
    x, q = jnp.broadcast_arrays(x, q)
    eps = jnp.finfo(x.dtype).eps / 2
    s0 = jnp.power(q, -x)

    def cond(c):
        i, a, b, s, done = c
        return jnp.any(~done & ((i < 9) | (a <= 9)))

    def body(c):
        i, a, b, s, done = c
        active = ~done & ((i < 9) | (a <= 9))
        a2 = jnp.where(active, a + 1, a)
        b2 = jnp.where(active, jnp.power(a2, -x), b)
        s2 = jnp.where(active, s + b2, s)
        small = active & (-eps * s2 < b2) & (b2 < eps * s2)
        return jnp.where(active, i + 1, i), a2, b2, s2, done | small

    done0 = jnp.zeros(x.shape, bool)
    i, a, b, s, done = lax.while_loop(cond, body, (jnp.zeros(x.shape, jnp.int32), q, jnp.zeros_like(x), s0,
                                                   done0))
    w = a
    tail = s + b * w / (x - 1) - 0.5 * b
    acc, k, bb, finished = jnp.ones_like(x), jnp.zeros_like(x), b, done
    for coeff in _ZETA_A:
        acc = acc * (x + k)
        bb = bb / w
        t = acc * bb / coeff
        new = tail + t
        tail = jnp.where(finished, tail, new)
        finished = finished | (jnp.abs(t / new) < eps)
        k = k + 1
        acc = acc * (x + k)
        bb = bb / w
        k = k + 1
    out = jnp.where(done, s, tail)
    integer_q = (q <= 0) & (q == jnp.floor(q))
    out = jnp.where((q <= 0) & (x != jnp.floor(x)), jnp.nan, out)
    out = jnp.where(integer_q, jnp.inf, out)
    out = jnp.where(x < 1, jnp.nan, out)
    return jnp.where(x == 1, jnp.inf, out)


@lowering("special_zeta.default", "special_zeta.other_scalar", "special_zeta.self_scalar", promote="result",
          promote_args=("self", "other"))
def zeta(self, other):
    result = jnp.result_type(self, other)
    compute = compute_dtype(result)
    return _hurwitz_zeta(jnp.asarray(self, compute), jnp.asarray(other, compute)).astype(result)


def _trigamma(x):
    # ATen's trigamma: reflection below 0.5, six recurrence steps, then the asymptotic series.
    pi = jnp.pi
    reflect = x < 0.5
    sin_pi_x = jnp.sin(pi * x)
    head = jnp.where(reflect, -(pi * pi) / (sin_pi_x * sin_pi_x), 0.0)
    y = jnp.where(reflect, 1 - x, x)
    result = head
    for _ in range(6):
        result = result + 1 / (y * y)
        y = y + 1
    ixx = 1 / (y * y)
    result = result + (1 + 1 / (2 * y) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / y
    return jnp.where(reflect, -result, result)


@lowering("polygamma.default", promote="result", promote_args=("self",))
def polygamma(n, self):
    # Half-precision inputs compute in float32 (ATen's opmath): near the poles the terms cancel.
    x = self.astype(compute_dtype(self.dtype))
    if n == 0:
        out = digamma(x)
    elif n == 1:
        out = _trigamma(x)
    else:
        # (-1)^(n+1) n! zeta(n+1, x), as ATen computes it.
        sign = 1.0 if n % 2 else -1.0
        out = sign * jnp.exp(lax.lgamma(jnp.asarray(n + 1.0, x.dtype))) * _hurwitz_zeta(
            jnp.full_like(x, n + 1.0), x)
    return out.astype(self.dtype)


@lowering("special_entr.default", promote="result", promote_args=("self",))
def entr(self):
    safe = jnp.where(self > 0, self, 1)
    return jnp.where(jnp.isnan(self), self,
                     jnp.where(self > 0, -self * jnp.log(safe), jnp.where(self == 0, 0.0, -jnp.inf)))


@lowering("special_xlog1py.default", "special_xlog1py.other_scalar", "special_xlog1py.self_scalar",
          promote="result", promote_args=("self", "other"))
def xlog1py(self, other):
    return jsp.xlog1py(self, other)


@lowering("special_spherical_bessel_j0.default", promote="result", promote_args=("x",))
def spherical_bessel_j0(x):
    # sin(x)/x, with ATen's Taylor series below |x| = 0.5 and 0 at +-inf.
    x2 = x * x
    series = 1 + x2 * (-1 / 6 + x2 * (1 / 120 + x2 * (-1 / 5040 + x2 * (1 / 362880 + x2 * (
        -1 / 39916800 + x2 * (1 / 6227020800))))))
    safe = jnp.where(jnp.abs(x) < 0.5, 1, x)
    out = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe)
    return jnp.where(jnp.isinf(x), jnp.zeros_like(x), out)


@lowering("special_modified_bessel_i0.default", promote="result", promote_args=("self",))
def modified_bessel_i0(self):
    return jsp.i0(self)


@lowering("special_modified_bessel_i1.default", promote="result", promote_args=("self",))
def modified_bessel_i1(self):
    return jsp.i1(self)
