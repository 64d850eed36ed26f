"""Lowerings that Hugging Face models need beyond the core families: the mixture-of-experts
routing and grouped matmuls of transformers' ``grouped_mm`` experts implementation.

transformers counts tokens per expert with ``torch.histc`` on integer expert ids (on every device
but CPU/MPS) and multiplies each expert's contiguous block of rows with ``torch._grouped_mm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .registry import lowering


@lowering("histc.default")
def histc(self, bins=100, min=0, max=0):
    x = self.reshape(-1)
    work = jnp.float32 if not jnp.issubdtype(self.dtype, jnp.floating) or jnp.finfo(self.dtype).bits < 32 \
        else self.dtype
    x = x.astype(work)
    lo = jnp.asarray(min, work)
    hi = jnp.asarray(max, work)
    # min == max: the data's own range; a degenerate range is widened by 1 on each side (PyTorch).
    auto = lo == hi
    if x.size:
        lo = jnp.where(auto, jnp.min(x), lo)
        hi = jnp.where(auto, jnp.max(x), hi)
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo)
    hi = jnp.where(same, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    pos = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int32)
    pos = jnp.clip(pos, 0, bins - 1)         # x == max belongs to the last bin
    counts = jnp.zeros((bins,), jnp.int32).at[pos].add(inside.astype(jnp.int32), mode="drop")
    return counts.astype(self.dtype)


def _group_ids(offs, n, groups):
    """Group of each of ``n`` positions given cumulative group ends ``offs`` (``groups`` = past the end)."""
    return jnp.searchsorted(offs.astype(jnp.int32), jnp.arange(n, dtype=jnp.int32), side="right")


def _acc(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 else None


@lowering("_grouped_mm.default", shape_from_lowering=True)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    from ..runtime.dtypes import jax_dtype
    result_dtype = jax_dtype(out_dtype) if out_dtype is not None else self.dtype
    acc = _acc(self.dtype)
    a, b = self, mat2
    if a.ndim == 3 and b.ndim == 3:          # a batch of independent matmuls
        out = jnp.matmul(a, b, preferred_element_type=acc)
        if bias is not None:
            out = out + bias[:, None, :]
    elif a.ndim == 2 and b.ndim == 3:        # rows of `a` grouped by offs, one weight per group
        groups = b.shape[0]
        sizes = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), offs.astype(jnp.int32)]))
        # Rows past the last offset belong to no group: ragged_dot leaves them zero.
        out = jax.lax.ragged_dot(a, b, sizes, preferred_element_type=acc)
        if bias is not None:
            gid = _group_ids(offs, a.shape[0], groups)
            out = out + jnp.where((gid < groups)[:, None], bias[jnp.minimum(gid, groups - 1)], 0)
    elif a.ndim == 2 and b.ndim == 2:        # the contraction dim grouped: one output per group
        groups = offs.shape[0]
        gid = _group_ids(offs, a.shape[1], groups)
        onehot = (gid[None, :] == jnp.arange(groups)[:, None]).astype(a.dtype)
        out = jnp.einsum("mk,gk,kn->gmn", a, onehot, b, preferred_element_type=acc)
        if bias is not None:
            out = out + bias[:, None, :]
    elif a.ndim == 3 and b.ndim == 2:        # columns of `b` grouped, one left matrix per group
        groups = a.shape[0]
        gid = _group_ids(offs, b.shape[1], groups)
        onehot = (gid[None, :] == jnp.arange(groups)[:, None]).astype(a.dtype)
        out = jnp.einsum("gmk,kn,gn->mn", a, b, onehot, preferred_element_type=acc)
        if bias is not None:
            out = out + jnp.where((gid < groups)[None, :], bias[jnp.minimum(gid, groups - 1), jnp.arange(b.shape[1])], 0)
    else:
        raise ValueError(f"_grouped_mm: unsupported operand ranks {a.ndim}D x {b.ndim}D")
    return out.astype(result_dtype)
