"""Matrix products and linear algebra."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .registry import lowering

# PyTorch's float32 matmuls are full precision by default; keep them so on every PJRT platform.
_PRECISION = lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=_PRECISION)


@lowering("mm.default", promote="common", promote_args=("self", "mat2"))
def mm(self, mat2):
    return _mm(self, mat2)


@lowering("bmm.default", promote="common", promote_args=("self", "mat2"))
def bmm(self, mat2):
    return _mm(self, mat2)


@lowering("mv.default", promote="common", promote_args=("self", "vec"))
def mv(self, vec):
    return _mm(self, vec)


@lowering("dot.default", "vdot.default", promote="common", promote_args=("self", "other"))
def dot(self, other):
    return jnp.dot(self, other, precision=_PRECISION)


def _scaled_sum(self, product, beta, alpha):
    # beta == 0 ignores `self` entirely (NaN included), as PyTorch documents.
    return jnp.where(beta == 0, jnp.zeros_like(product), self * beta) + product * alpha


@lowering("addmm.default", promote="common", promote_args=("self", "mat1", "mat2"))
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm(mat1, mat2), beta, alpha)


@lowering("addmv.default", promote="common", promote_args=("self", "mat", "vec"))
def addmv(self, mat, vec, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm(mat, vec), beta, alpha)


@lowering("baddbmm.default", promote="common", promote_args=("self", "batch1", "batch2"))
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm(batch1, batch2), beta, alpha)


@lowering("addbmm.default", promote="common", promote_args=("self", "batch1", "batch2"))
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(self, jnp.sum(_mm(batch1, batch2), axis=0), beta, alpha)


@lowering("addr.default", promote="common", promote_args=("self", "vec1", "vec2"))
def addr(self, vec1, vec2, *, beta=1, alpha=1):
    return _scaled_sum(self, jnp.outer(vec1, vec2), beta, alpha)


@lowering("_addmm_activation.default", promote="common", promote_args=("self", "mat1", "mat2"))
def addmm_activation(self, mat1, mat2, *, beta=1, alpha=1, use_gelu=False):
    import jax
    out = addmm(self, mat1, mat2, beta=beta, alpha=alpha)
    return jax.nn.gelu(out, approximate=True) if use_gelu else jnp.maximum(out, 0)
