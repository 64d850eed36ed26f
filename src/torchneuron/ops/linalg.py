"""Matrix products and linear algebra."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import lax
from jax._src.lax import linalg as lax_linalg  # geqrf is not re-exported by jax.lax.linalg

from ..runtime.dtypes import jax_dtype
from .numerics import compute_dtype
from .precision import MATMUL, matmul_precision
from .registry import lowering

# Factorizations and their products stay float32 whatever the matmul setting (as cuSOLVER's do).
_HIGHEST = lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=matmul_precision())


@lowering("mm.default", precision=MATMUL, promote="common", promote_args=("self", "mat2"))
def mm(self, mat2):
    return _mm(self, mat2)


def mm_transposed_self(self, mat2):
    """``self.t() @ mat2`` for a row-major ``self`` of shape (k, m): a weight gradient
    (``grad_output.t() @ input``), the one ``mm`` of a training graph XLA:CPU runs slowly as it is
    (a dot contracting both operands' leading dim: 33 ms for the LM head of bench/compile.py where
    PyTorch takes 24). Computed transposed, ``(mat2.t() @ self).t()`` with both transposes
    materialised (the barriers keep XLA from folding them back into the dot): 23 ms
    (docs/performance.md). compile/fusions.py plans it for ``mm(t(a), b)``."""
    dtype = jnp.result_type(self, mat2)
    a, b = self.astype(dtype), mat2.astype(dtype)
    product_t = lax.dot_general(lax.optimization_barrier(b.T), a, (((1,), (0,)), ((), ())),
                                precision=matmul_precision())
    return lax.optimization_barrier(product_t).T


@lowering("bmm.default", precision=MATMUL, promote="common", promote_args=("self", "mat2"))
def bmm(self, mat2):
    return _mm(self, mat2)


@lowering("mv.default", precision=MATMUL, promote="common", promote_args=("self", "vec"))
def mv(self, vec):
    return _mm(self, vec)


@lowering("dot.default", precision=MATMUL, promote="common", promote_args=("self", "other"))
def dot(self, other):
    return jnp.dot(self, other, precision=matmul_precision())


@lowering("vdot.default", precision=MATMUL, promote="common", promote_args=("self", "other"))
def vdot(self, other):
    return jnp.dot(jnp.conj(self), other, precision=matmul_precision())   # conj(self) . other, as ATen


def _mm_acc(a, b):
    """a @ b left in the accumulation dtype (float32 for half precision) for _scaled_sum to round once."""
    dtype = jnp.result_type(a, b)
    acc = compute_dtype(dtype)
    return jnp.matmul(a, b, precision=matmul_precision(), preferred_element_type=acc if acc != dtype else None)


def _scaled_sum(self, product, beta, alpha):
    """beta * self + alpha * product in the product's (accumulation) dtype, rounded once to self's."""
    dtype = self.dtype
    if jnp.issubdtype(product.dtype, jnp.integer):
        # Integer results take integer factors (C++ casts: 0.6 -> 0), as on CPU.
        beta, alpha = jnp.asarray(beta).astype(product.dtype), jnp.asarray(alpha).astype(product.dtype)
    # beta == 0 ignores `self` entirely (NaN included), as PyTorch documents.
    out = jnp.where(beta == 0, jnp.zeros_like(product), self.astype(product.dtype) * beta) + product * alpha
    return out.astype(dtype)


@lowering("addmm.default", precision=MATMUL, promote="common", promote_args=("self", "mat1", "mat2"))
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm_acc(mat1, mat2), beta, alpha)


@lowering("addmv.default", precision=MATMUL, promote="common", promote_args=("self", "mat", "vec"))
def addmv(self, mat, vec, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm_acc(mat, vec), beta, alpha)


@lowering("baddbmm.default", precision=MATMUL, promote="common", promote_args=("self", "batch1", "batch2"))
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(self, _mm_acc(batch1, batch2), beta, alpha)


@lowering("addbmm.default", precision=MATMUL, promote="common", promote_args=("self", "batch1", "batch2"))
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(self, jnp.sum(_mm_acc(batch1, batch2), axis=0), beta, alpha)


@lowering("addr.default", promote="common", promote_args=("self", "vec1", "vec2"))
def addr(self, vec1, vec2, *, beta=1, alpha=1):
    acc = compute_dtype(vec1.dtype)   # the outer product is not rounded to half precision first
    return _scaled_sum(self, jnp.outer(vec1.astype(acc), vec2.astype(acc)), beta, alpha)


@lowering("_addmm_activation.default", promote="common", promote_args=("self", "mat1", "mat2"))
def addmm_activation(self, mat1, mat2, *, beta=1, alpha=1, use_gelu=False):
    out = addmm(self, mat1, mat2, beta=beta, alpha=alpha)
    return jax.nn.gelu(out, approximate=True) if use_gelu else jnp.maximum(out, 0)


# -- linear algebra -----------------------------------------------------------------------------
# Factorisations go through jax.lax.linalg: LAPACK on CPU (the same routines PyTorch calls, so
# signs and pivots agree), cuSOLVER on CUDA, XLA's own expansions elsewhere. ``info`` outputs are
# reconstructed from the factors, with LAPACK's meaning (1-based index of the failing step, 0 = ok).

# Ops whose JAX lowering exists only as a LAPACK custom call: other PJRT platforms run them through
# the explicit, counted CPU fallback (see registry.Lowering.platforms).
_LAPACK_ONLY = ("cpu",)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _broadcast_batch(a, b):
    """Broadcast the batch dims (all but the last two) of two matrix stacks against each other."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, *, lower, left=True, transpose=False, unit=False):
    """op(a) x = b (left) or x op(a) = b, op = transpose-conjugate when ``transpose``."""
    a, b = _broadcast_batch(a, b)
    conj = transpose and jnp.iscomplexobj(a)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                        conjugate_a=conj, unit_diagonal=unit)


def _lu(a):
    """(LU, 1-based int32 pivots as LAPACK/PyTorch, permutation, info)."""
    m, n = a.shape[-2:]
    if min(m, n) == 0:
        k = min(m, n)
        return (a, jnp.zeros(a.shape[:-2] + (k,), jnp.int32), jnp.broadcast_to(jnp.arange(m), a.shape[:-2] + (m,)),
                jnp.zeros(a.shape[:-2], jnp.int32))
    lu, pivots, perm = lax.linalg.lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return lu, pivots.astype(jnp.int32) + 1, perm, _first_index(diag == 0)


def _first_index(bad):
    """LAPACK info: 1 + index of the first True along the last axis, 0 when none."""
    if bad.shape[-1] == 0:
        return jnp.zeros(bad.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(bad, -1), jnp.argmax(bad, -1) + 1, 0).astype(jnp.int32)


def _perm_from_pivots(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _lu_solve(lu, perm, b, *, left=True, adjoint=False):
    """Solve with the factors of A (A[perm] = L U): A x = b, A^H x = b, x A = b or x A^H = b."""
    if not left:
        # x op(A) = b  <=>  op(A)^H x^H = b^H
        return _mH(_lu_solve(lu, perm, _mH(b), left=True, adjoint=not adjoint))
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if not adjoint:
        x = jnp.take_along_axis(b, perm[..., None], axis=-2)
        x = _tri_solve(lu, x, lower=True, unit=True)
        return _tri_solve(lu, x, lower=False)
    x = _tri_solve(lu, b, lower=False, transpose=True)
    x = _tri_solve(lu, x, lower=True, unit=True, transpose=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(x, inverse[..., None], axis=-2)


def _is_vector_rhs(a, b):
    # PyTorch's rule (linalg_solve_is_vector_rhs): B is a (batch of) vector(s).
    return b.ndim == 1 or (a.ndim - 1 == b.ndim and b.shape == a.shape[:-1])


@lowering("linalg_lu_factor_ex.default")
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    lu, pivots, _, info = _lu(A)
    return lu, pivots, info


@lowering("linalg_lu.default")
def linalg_lu(A, *, pivot=True):
    lu, pivots, perm, _ = _lu(A)
    return _unpack(lu, perm, True, True)


def _unpack(lu, perm, unpack_data, unpack_pivots):
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    P = L = U = empty
    if unpack_pivots:
        # A = P L U with P[perm[i], i] = 1.
        P = jnp.swapaxes((perm[..., None] == jnp.arange(m)).astype(lu.dtype), -1, -2)
    if unpack_data:
        L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        U = jnp.triu(lu[..., :k, :])
    return P, L, U


@lowering("lu_unpack.default")
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m = LU_data.shape[-2]
    perm = _perm_from_pivots(LU_pivots, m) if unpack_pivots and LU_pivots.shape[-1] else \
        jnp.broadcast_to(jnp.arange(m), LU_data.shape[:-2] + (m,))
    return _unpack(LU_data, perm, unpack_data, unpack_pivots)


@lowering("linalg_lu_solve.default")
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    return _lu_solve(LU, perm, B, left=left, adjoint=adjoint)


@lowering("_linalg_solve_ex.default")
def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    lu, pivots, perm, info = _lu(A)
    vector = left and _is_vector_rhs(A, B)
    b = B[..., None] if vector else B
    x = _lu_solve(lu, perm, b, left=left)
    return (x[..., 0] if vector else x), lu, pivots, info


@lowering("linalg_inv_ex.default")
def linalg_inv_ex(A, *, check_errors=False):
    lu, _, perm, info = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, perm, eye), info


def _det_parts(A, contiguous):
    # ATen factors A^T when A is real and C-contiguous (LAPACK wants column-major; det(A^T) = det(A)),
    # and its backward solves with the returned LU accordingly: the factorisation must be the same.
    if contiguous and not jnp.iscomplexobj(A):
        A = jnp.swapaxes(A, -1, -2)
    lu, pivots, perm, _ = _lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=jnp.int32), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    return lu, pivots, diag, parity


@lowering("_linalg_det.default", contiguity_of="A")
def linalg_det(A, *, contiguous):
    lu, pivots, diag, parity = _det_parts(A, contiguous)
    return parity * jnp.prod(diag, axis=-1), lu, pivots


@lowering("_linalg_slogdet.default", contiguity_of="A")
def linalg_slogdet(A, *, contiguous):
    lu, pivots, diag, parity = _det_parts(A, contiguous)
    absdiag = jnp.abs(diag)
    if jnp.iscomplexobj(A):
        phase = jnp.prod(jnp.where(absdiag == 0, 0, diag / jnp.where(absdiag == 0, 1, absdiag)), axis=-1)
        sign = parity * phase
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    return sign, jnp.sum(jnp.log(absdiag), axis=-1), lu, pivots


def _cholesky(A, upper):
    if A.shape[-1] == 0:
        return A, jnp.zeros(A.shape[:-2], jnp.int32)
    # LAPACK potrf reads one triangle only (the lower one, or the upper one for upper=True).
    herm = jnp.triu(A) + _mH(jnp.triu(A, 1)) if upper else jnp.tril(A) + _mH(jnp.tril(A, -1))
    L = lax.linalg.cholesky(herm, symmetrize_input=False)
    failed = ~jnp.isfinite(jnp.real(jnp.diagonal(L, axis1=-2, axis2=-1)))
    # XLA fills a failed factor with NaN: LAPACK's info (the order of the first leading minor that
    # is not positive-definite) is recomputed, only when some matrix failed.
    info = lax.cond(jnp.any(failed), _minor_not_positive_definite, lambda a: jnp.zeros(a.shape[:-2], jnp.int32),
                    herm)
    return (_mH(L) if upper else L), info


def _minor_not_positive_definite(A):
    """1 + the first k at which an unblocked Cholesky of A meets a pivot that is not > 0; 0 if none."""
    n = A.shape[-1]
    idx = jnp.arange(n)

    def column(k, state):
        L, info = state
        done = idx < k
        row = jnp.where(done, L[..., k, :], 0)
        pivot = jnp.real(A[..., k, k]) - jnp.sum(jnp.abs(row) ** 2, axis=-1)
        bad = ~(pivot > 0)   # NaN too
        info = jnp.where((info == 0) & bad, k + 1, info)
        d = jnp.sqrt(jnp.where(bad, 1, pivot)).astype(A.dtype)
        below = (A[..., :, k] - jnp.einsum("...ij,...j->...i", jnp.where(done, L, 0), jnp.conj(row), precision=_HIGHEST)) / d[..., None]
        col = jnp.where(idx > k, below, jnp.where(idx == k, d[..., None], 0))
        return L.at[..., :, k].set(col), info

    _, info = lax.fori_loop(0, n, column, (jnp.zeros_like(A), jnp.zeros(A.shape[:-2], jnp.int32)))
    return info


@lowering("linalg_cholesky_ex.default")
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    return _cholesky(self, upper)


@lowering("cholesky.default")
def cholesky(self, upper=False):
    return _cholesky(self, upper)[0]


@lowering("cholesky_inverse.default")
def cholesky_inverse(self, upper=False):
    # A = L L^H (or U^H U): A^-1 = L^-H L^-1.
    L = _mH(self) if upper else self
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=L.dtype), L.shape)
    linv = _tri_solve(L, eye, lower=True)
    return _mH(linv) @ linv


@lowering("_cholesky_solve_helper.default")
def cholesky_solve_helper(self, A, upper):
    L = _mH(A) if upper else A
    y = _tri_solve(L, self, lower=True)
    return _tri_solve(L, y, lower=True, transpose=True)


@lowering("triangular_solve.default")
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(A, self, lower=not upper, transpose=transpose, unit=unitriangular)
    batch = jnp.broadcast_shapes(A.shape[:-2], self.shape[:-2])
    return x, jnp.broadcast_to(A, batch + A.shape[-2:])


@lowering("linalg_solve_triangular.default")
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    return _tri_solve(self, B, lower=not upper, left=left, unit=unitriangular)


@lowering("_linalg_eigh.default")
def linalg_eigh(A, UPLO="L", compute_v=True):
    lower = UPLO.upper() == "L"
    # Mirror the triangle LAPACK reads into a Hermitian matrix.
    tri = jnp.tril(A) if lower else jnp.triu(A)
    off = jnp.tril(A, -1) if lower else jnp.triu(A, 1)
    herm = tri + _mH(off)
    if A.shape[-1] == 0:
        w = jnp.zeros(A.shape[:-1], jnp.real(A).dtype)
        return w, (A if compute_v else jnp.zeros((0,), A.dtype))
    v, w = lax.linalg.eigh(herm, lower=True, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@lowering("_linalg_svd.default")
def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    m, n = A.shape[-2:]
    if min(m, n) == 0:
        k = min(m, n)
        s = jnp.zeros(A.shape[:-2] + (k,), jnp.real(A).dtype)
        if not compute_uv:
            return jnp.zeros((0,), A.dtype), s, jnp.zeros((0,), A.dtype)
        um, vn = (m, n) if full_matrices else (k, k)
        U = jnp.broadcast_to(jnp.eye(m, um, dtype=A.dtype), A.shape[:-2] + (m, um))
        Vh = jnp.broadcast_to(jnp.eye(vn, n, dtype=A.dtype), A.shape[:-2] + (vn, n))
        return U, s, Vh
    if not compute_uv:
        s = lax.linalg.svd(A, full_matrices=False, compute_uv=False)
        return jnp.zeros((0,), A.dtype), s, jnp.zeros((0,), A.dtype)
    U, s, Vh = lax.linalg.svd(A, full_matrices=full_matrices, compute_uv=True)
    return U, s, Vh


@lowering("linalg_qr.default")
def linalg_qr(A, mode="reduced"):
    m, n = A.shape[-2:]
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    q, r = jnp.linalg.qr(A, mode="complete" if mode == "complete" else "reduced")
    return q, r


@lowering("geqrf.default")
def geqrf(self):
    return lax_linalg.geqrf(self)


@lowering("linalg_householder_product.default")
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@lowering("ormqr.default")
def ormqr(self, input2, input3, left=True, transpose=False):
    # Q is the m x m product of the reflectors; pad the reflectors to square for jax's ormqr.
    m = self.shape[-2]
    a, taus = self, input2
    if a.shape[-1] < m:
        a = jnp.concatenate([a, jnp.zeros(a.shape[:-1] + (m - a.shape[-1],), a.dtype)], axis=-1)
    else:
        a = a[..., :m]
    taus = jnp.concatenate([taus, jnp.zeros(taus.shape[:-1] + (m - taus.shape[-1],), taus.dtype)], -1)[..., :m]
    q = lax.linalg.householder_product(a, taus)
    return q @ input3 if left and not transpose else _mH(q) @ input3 if left else \
        input3 @ q if not transpose else input3 @ _mH(q)


@lowering("linalg_lstsq.default")
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    m, n = self.shape[-2:]
    driver = driver or "gelsy"
    vector = b.ndim == self.ndim - 1
    bb = b[..., None] if vector else b
    A, bb = _broadcast_batch(self, bb)
    batch = A.shape[:-2]
    real = jnp.real(A).dtype
    eps = jnp.finfo(real).eps
    if rcond is None:
        rcond = eps * max(m, n)
    # Minimum-norm least squares through the SVD: what gelsd computes, and gelsy/gels agree with
    # it whenever A has full rank (the only case where they are defined to).
    U, s, Vh = lax.linalg.svd(A, full_matrices=False, compute_uv=True)
    smax = jnp.max(s, axis=-1, keepdims=True) if s.shape[-1] else jnp.zeros(batch + (1,), real)
    keep = s > rcond * smax
    sinv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(A.dtype)
    x = _mH(Vh) @ (sinv[..., None] * (_mH(U) @ bb))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    if m > n and driver != "gelsy":
        resid = jnp.sum(jnp.abs(A @ x - bb) ** 2, axis=-2).astype(real)
    else:
        resid = jnp.zeros((0,), real)
    if driver == "gels":
        rank = jnp.zeros((0,), jnp.int64)
    sv = s if driver in ("gelsd", "gelss") else jnp.zeros((0,), real)
    return (x[..., 0] if vector else x), resid, rank, sv


@lowering("linalg_matrix_exp.default")
def linalg_matrix_exp(self):
    if self.shape[-1] == 0:
        return self
    # expm has no half-precision kernel: compute in float32, round once.
    flat = self.reshape((-1,) + self.shape[-2:]).astype(compute_dtype(self.dtype))
    return jax.vmap(jsl.expm)(flat).reshape(self.shape).astype(self.dtype)


@lowering("linalg_eig.default", platforms=_LAPACK_ONLY)
def linalg_eig(self):
    w, v = jnp.linalg.eig(self)
    return w, v


@lowering("_linalg_eigvals.default", platforms=_LAPACK_ONLY)
def linalg_eigvals(self):
    return jnp.linalg.eigvals(self)


@lowering("linalg_cross.default", promote="common", promote_args=("self", "other"))
def linalg_cross(self, other, *, dim=-1):
    shape = jnp.broadcast_shapes(self.shape, other.shape)
    return jnp.cross(jnp.broadcast_to(self, shape), jnp.broadcast_to(other, shape), axis=dim)


# -- distances ----------------------------------------------------------------------------------
def _pairwise(x1, x2, p, use_mm):
    """(..., P, R) p-norm distances between the rows of x1 (..., P, M) and x2 (..., R, M)."""
    x1, x2 = _broadcast_batch(x1, x2)
    if p == 2 and use_mm:
        # ATen's matrix-multiply form: |a|^2 + |b|^2 - 2 a.b, clamped at 0.
        sq1 = jnp.sum(x1 * x1, -1, keepdims=True)
        sq2 = jnp.sum(x2 * x2, -1, keepdims=True)
        d2 = sq1 + _mT(sq2) - 2 * _mm(x1, _mT(x2))
        return jnp.sqrt(jnp.maximum(d2, 0))
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum((diff != 0).astype(x1.dtype), -1)
    if p == 1:
        return jnp.sum(diff, -1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, -1))
    if p == float("inf"):
        return jnp.max(diff, -1) if diff.shape[-1] else jnp.zeros(diff.shape[:-1], x1.dtype)
    return jnp.sum(diff ** p, -1) ** (1.0 / p)


def _cdist_uses_mm(x1, x2, compute_mode):
    # compute_mode: None/0 -> mm when either side has more than 25 rows, 1 -> always, 2 -> never.
    if compute_mode == 1:
        return True
    if compute_mode == 2:
        return False
    return x1.shape[-2] > 25 or x2.shape[-2] > 25


@lowering("_cdist_forward.default", precision=MATMUL)
def cdist_forward(x1, x2, p, compute_mode):
    return _pairwise(x1, x2, p, _cdist_uses_mm(x1, x2, compute_mode))


def _distance_grad(diff, dist, p):
    """d dist / d x1 of each pair (diff = x1 - x2), zero where the distance is zero (ATen)."""
    dist = dist[..., None]
    safe = jnp.where(dist == 0, 1, dist)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff)
    if p == 2:
        g = diff / safe
    elif p == float("inf"):
        g = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p < 2:
        g = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
        g = jnp.where((diff == 0) & (p < 1), 0, g)
    else:
        g = diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1)
    return jnp.where(dist == 0, 0, g)


@lowering("_cdist_backward.default")
def cdist_backward(grad, x1, x2, p, cdist):
    if x1.size == 0 or x2.size == 0 or grad.size == 0:
        return jnp.zeros_like(x1)     # ATen's early exit keeps x1's own shape
    a, b = _broadcast_batch(x1, x2)
    diff = a[..., :, None, :] - b[..., None, :, :]
    # Like ATen, the gradient keeps the broadcast batch shape; autograd reduces it to x1's.
    return jnp.sum(grad[..., None] * _distance_grad(diff, cdist, p), axis=-2)


def _upper_pairs(n):
    i, j = np.triu_indices(n, 1)
    return i, j


@lowering("_pdist_forward.default")
def pdist_forward(self, p=2.0):
    i, j = _upper_pairs(self.shape[0])
    diff = jnp.abs(self[i] - self[j])
    if p == 0:
        return jnp.sum((diff != 0).astype(self.dtype), -1)
    if p == 1:
        return jnp.sum(diff, -1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, -1))
    if p == float("inf"):
        return jnp.max(diff, -1) if diff.shape[-1] else jnp.zeros(diff.shape[:-1], self.dtype)
    return jnp.sum(diff ** p, -1) ** (1.0 / p)


@lowering("_pdist_backward.default")
def pdist_backward(grad, self, p, pdist):
    i, j = _upper_pairs(self.shape[0])
    g = grad[:, None] * _distance_grad(self[i] - self[j], pdist, p)
    return jnp.zeros_like(self).at[i].add(g).at[j].add(-g)


# -- grouped matmuls ------------------------------------------------------------------------------
# transformers' grouped_mm experts implementation multiplies each mixture-of-experts expert's
# contiguous block of rows with torch._grouped_mm.
def _group_ids(offs, n, groups):
    """Group of each of ``n`` positions given cumulative group ends ``offs`` (``groups`` = past the end)."""
    return jnp.searchsorted(offs.astype(jnp.int32), jnp.arange(n, dtype=jnp.int32), side="right")


def _acc(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 else None


@lowering("_grouped_mm.default", precision=MATMUL, shape_from_lowering=True)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    result_dtype = jax_dtype(out_dtype) if out_dtype is not None else self.dtype
    acc = _acc(self.dtype)
    a, b = self, mat2
    if a.ndim == 3 and b.ndim == 3:          # a batch of independent matmuls
        out = jnp.matmul(a, b, precision=matmul_precision(), preferred_element_type=acc)
        if bias is not None:
            out = out + bias[:, None, :]
    elif a.ndim == 2 and b.ndim == 3:        # rows of `a` grouped by offs, one weight per group
        groups = b.shape[0]
        sizes = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), offs.astype(jnp.int32)]))
        # Rows past the last offset belong to no group: ragged_dot leaves them zero.
        out = jax.lax.ragged_dot(a, b, sizes, precision=matmul_precision(), preferred_element_type=acc)
        if bias is not None:
            gid = _group_ids(offs, a.shape[0], groups)
            out = out + jnp.where((gid < groups)[:, None], bias[jnp.minimum(gid, groups - 1)], 0)
    elif a.ndim == 2 and b.ndim == 2:        # the contraction dim grouped: one output per group
        groups = offs.shape[0]
        gid = _group_ids(offs, a.shape[1], groups)
        onehot = (gid[None, :] == jnp.arange(groups)[:, None]).astype(a.dtype)
        out = jnp.einsum("mk,gk,kn->gmn", a, onehot, b, precision=matmul_precision(), preferred_element_type=acc)
        if bias is not None:
            out = out + bias[:, None, :]
    elif a.ndim == 3 and b.ndim == 2:        # columns of `b` grouped, one left matrix per group
        groups = a.shape[0]
        gid = _group_ids(offs, b.shape[1], groups)
        onehot = (gid[None, :] == jnp.arange(groups)[:, None]).astype(a.dtype)
        out = jnp.einsum("gmk,kn,gn->mn", a, b, onehot, precision=matmul_precision(), preferred_element_type=acc)
        if bias is not None:
            out = out + jnp.where((gid < groups)[None, :], bias[jnp.minimum(gid, groups - 1), jnp.arange(b.shape[1])], 0)
    else:
        raise ValueError(f"_grouped_mm: unsupported operand ranks {a.ndim}D x {b.ndim}D")
    return out.astype(result_dtype)
