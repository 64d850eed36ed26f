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


def kernels(table: dict) -> dict:
    """Eager kernels layered on the lowered ones (merged into the registration table)."""
    import torch

    def runtime_lr(tensor_lr_kernel):
        def fused(*args, lr, **kwargs):
            # A float ``lr`` would be compiled into the executable, so every step of an LR schedule
            # (Trainer's default) would compile anew; as a 0-dim CPU tensor it is a runtime input.
            if not isinstance(lr, torch.Tensor):
                lr = torch.tensor(lr, dtype=torch.float32)
            return tensor_lr_kernel(*args, lr=lr, **kwargs)
        return fused

    return {f"{name}.default": runtime_lr(table[f"{name}.tensor_lr"])
            for name in ("_fused_adamw_", "_fused_adam_") if f"{name}.tensor_lr" in table}
