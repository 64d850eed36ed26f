"""Losses: NLL, MSE, L1, smooth L1, Huber, binary cross-entropy (with logits), and those without a
decomposition into lowered ops (or whose decomposition loses the ATen subgradient): multi-margin,
multilabel-margin, CTC.

Hinges use ``where(z > 0, z, 0)`` rather than ``maximum`` so the gradient at the hinge is ATen's
(zero), not JAX's tie-splitting one half. CTC follows ``LossCTC.cpp``: the alpha recursion in log
space as a ``scan`` over time, and ATen's own gradient formula (which assumes log_softmax inputs)
computed from the saved alphas and a beta recursion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import checks
from .numerics import compute_dtype, require_floating
from .registry import lowering


# -- reductions, NLL, regression and binary cross-entropy losses ----------------------------------
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
    classes = self.shape[1 if self.ndim >= 2 else 0]
    t = target.astype(jnp.int64)
    checks.fail_if((t != ignore_index) & ((t < 0) | (t >= classes)), t, IndexError, "Target {value} is out of bounds.")
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


def log_softmax_nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight,
                             output, dim, input_dtype):
    """``_log_softmax_backward_data(nll_loss_backward(...), output, dim)``, the backward of
    cross-entropy, as one pass over the logits (compile/fusions.py finds the pair in graphs).

    The NLL gradient has one non-zero per row, its coefficient, so the row sum the log-softmax
    backward needs is that coefficient: no (batch x classes) reduction, and one fused elementwise
    pass (``g - exp(output) * coef``) instead of a select, a reduction and a second pass. The sum of
    one non-zero and zeros is exact, so the result is the unfused formula's, element for element.
    """
    del dim, input_dtype   # the class dim (the pattern requires it); the result has output's dtype
    cdim, safe, w = _nll_targets(self, target, weight, ignore_index)
    coef = -grad_output.astype(self.dtype).reshape(() if reduction else target.shape) * w
    if reduction == 1:
        coef = coef / total_weight.astype(self.dtype)
    acc = compute_dtype(output.dtype)   # as the log-softmax backward: half types in float32
    coef = jnp.expand_dims(coef, cdim)
    hit = lax.broadcasted_iota(jnp.int64, self.shape, cdim) == jnp.expand_dims(safe, cdim)
    g = jnp.where(hit, coef, jnp.zeros((), self.dtype)).astype(acc)
    return g - jnp.exp(output.astype(acc)) * coef.astype(acc)


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
    require_floating("smooth_l1_loss", self, target, allow_complex=False)
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
    require_floating("huber_loss", self, target, allow_complex=False)
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
    acc = compute_dtype(self.dtype)
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


# -- margin losses --------------------------------------------------------------------------------

def _hinge(z):
    return jnp.where(z > 0, z, 0)


def _as_rows(x):
    """(N, C) view of a batched, single (C) or 0-dim input."""
    return x if x.ndim == 2 else x.reshape(1, -1) if x.ndim == 1 else x.reshape(1, 1)


def _multi_margin(self, target, p, margin, weight, reduction):
    x = _as_rows(self)
    t = target.reshape(-1).astype(jnp.int64)
    c = x.shape[1]
    xy = jnp.take_along_axis(x, t[:, None], axis=1)
    z = _hinge(margin - xy + x)
    z = z * z if p == 2 else z
    if weight is not None:
        z = z * weight[t][:, None]
    z = jnp.where(jnp.arange(c)[None, :] == t[:, None], 0, z)
    loss = jnp.sum(z, axis=1) / c
    if self.ndim < 2:
        loss = loss.reshape(())
    return reduce_loss(loss, reduction)


@lowering("multi_margin_loss.default", static_scalars=True)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(self, target, p, margin, weight, reduction)


@lowering("multi_margin_loss_backward.default", static_scalars=True)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), self)
    return vjp(grad_output.astype(self.dtype))[0]


def _multilabel(self, target):
    x = _as_rows(self)
    t = _as_rows(target).astype(jnp.int64)
    c = x.shape[1]
    # Targets are the entries before the first -1.
    valid = jnp.cumprod(t != -1, axis=1).astype(bool)
    safe = jnp.where(valid, t, 0)
    rows = jnp.arange(x.shape[0])[:, None]
    is_target = jnp.zeros(x.shape, x.dtype).at[rows, safe].max(valid.astype(x.dtype))
    xt = jnp.take_along_axis(x, safe, axis=1)
    z = 1 - xt[:, :, None] + x[:, None, :]
    mask = valid[:, :, None] & (is_target[:, None, :] == 0)
    loss = jnp.sum(jnp.where(mask, _hinge(z), 0), axis=(1, 2)) / c
    if self.ndim < 2:
        loss, is_target = loss.reshape(()), is_target.reshape(self.shape)
    return loss, is_target


@lowering("multilabel_margin_loss_forward.default")
def multilabel_margin_loss_forward(self, target, reduction):
    loss, is_target = _multilabel(self, target)
    return reduce_loss(loss, reduction), is_target


@lowering("multilabel_margin_loss_backward.default")
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x: reduce_loss(_multilabel(x, target)[0], reduction), self)
    return vjp(grad_output.astype(self.dtype))[0]


# -- CTC ------------------------------------------------------------------------------------------
def _padded_targets(targets, target_lengths):
    """(N, max_len) targets from the padded 2-D or the concatenated 1-D layout."""
    n = len(target_lengths)
    width = max(max(target_lengths, default=0), 1)
    if targets.ndim == 2:
        return targets[:, :width] if targets.shape[1] >= width else jnp.pad(targets, ((0, 0), (0, width - targets.shape[1])))
    offsets = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
    pos = offsets[:, None] + np.arange(width)[None, :]
    ok = np.arange(width)[None, :] < np.asarray(target_lengths)[:, None]
    flat = targets.reshape(-1)
    gathered = flat[jnp.asarray(np.where(ok, np.minimum(pos, max(flat.shape[0] - 1, 0)), 0))] if flat.shape[0] else \
        jnp.zeros(pos.shape, targets.dtype)
    return jnp.where(jnp.asarray(ok), gathered, 0)


def _extended(targets, target_lengths, blank):
    """l'(s): blank at even s, the (s-1)/2-th label at odd s; (N, 2*max_len+1)."""
    tp = _padded_targets(targets, target_lengths).astype(jnp.int64)
    max_len = max(max(target_lengths, default=0), 0)
    s = np.arange(2 * max_len + 1)
    lab = tp[:, np.clip((s - 1) // 2, 0, max(tp.shape[1] - 1, 0))] if tp.shape[1] else jnp.zeros((tp.shape[0], s.shape[0]), jnp.int64)
    return jnp.where(jnp.asarray(s % 2 == 0)[None, :], blank, lab)


def _lse3(a, b, c):
    m = jnp.maximum(jnp.maximum(a, b), c)
    m = jnp.where(jnp.isinf(m), 0, m)
    return jnp.log(jnp.exp(a - m) + jnp.exp(b - m) + jnp.exp(c - m)) + m


def _shift(x, k, fill):
    """x moved k places along the last axis (right for k > 0, left for k < 0), ``fill`` coming in;
    any width, a 1-wide extended target (all targets empty) included."""
    width = x.shape[-1]
    pad = ((0, 0), (k, 0)) if k > 0 else ((0, 0), (0, -k))
    padded = jnp.pad(x, pad, constant_values=fill)
    return padded[:, :width] if k > 0 else padded[:, -k:]


def _ctc_alpha(log_probs, targets, input_lengths, target_lengths, blank):
    lp = jnp.transpose(log_probs, (1, 0, 2))                 # (N, T, C)
    n, t_max, _ = lp.shape
    ext = _extended(targets, target_lengths, blank)          # (N, S)
    s_len = ext.shape[1]
    tl = jnp.asarray(np.asarray(target_lengths, np.int64))
    s = jnp.arange(s_len)
    in_range = s[None, :] <= 2 * tl[:, None]
    # s-2 transition allowed when l'(s) != l'(s-2) (never for blanks).
    # (Where the shift brings in the fill, the shifted alpha/beta is -inf: what skip says there is moot.)
    skip = ext != _shift(ext, 2, blank)
    neg = jnp.asarray(-jnp.inf, lp.dtype)
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(ext[:, None, :], (n, t_max, s_len)), axis=2)   # (N, T, S)
    a0 = jnp.where((s[None, :] == 0) | ((s[None, :] == 1) & (tl[:, None] > 0)), emit[:, 0, :], neg)
    a0 = jnp.where(in_range, a0, neg)

    def step(prev, e):
        la2 = _shift(prev, 1, neg)
        la3 = jnp.where(skip, _shift(prev, 2, neg), neg)
        cur = jnp.where(in_range, _lse3(prev, la2, la3) + e, neg)
        return cur, cur

    _, rest = lax.scan(step, a0, jnp.swapaxes(emit[:, 1:, :], 0, 1))
    alpha = jnp.concatenate([a0[:, None, :], jnp.swapaxes(rest, 0, 1)], axis=1) if t_max > 1 else a0[:, None, :]
    il = jnp.asarray(np.asarray(input_lengths, np.int64))
    # Time steps at or past each input length are never computed by ATen: keep them -inf.
    alpha = jnp.where(jnp.arange(t_max)[None, :, None] < il[:, None, None], alpha, neg)
    last = jnp.take_along_axis(alpha, jnp.clip(il - 1, 0, t_max - 1)[:, None, None], axis=1)[:, 0, :]
    end1 = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    end2 = jnp.where(tl > 0, jnp.take_along_axis(last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0], neg)
    m = jnp.maximum(end1, end2)
    m = jnp.where(jnp.isinf(m), 0, m)
    nll = -(jnp.log(jnp.exp(end1 - m) + jnp.exp(end2 - m)) + m)
    return nll, alpha, ext, emit


def _ctc_batched(log_probs):
    return log_probs if log_probs.ndim == 3 else log_probs[:, None, :]


@lowering("_ctc_loss.default")
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    nll, alpha, _, _ = _ctc_alpha(_ctc_batched(log_probs), targets, input_lengths, target_lengths, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    if log_probs.ndim == 2:
        return nll.reshape(()), alpha[0]
    return nll, alpha


@lowering("_ctc_loss_backward.default")
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    unbatched = log_probs.ndim == 2
    lp3 = _ctc_batched(log_probs)
    nll_raw, alpha, ext, emit = _ctc_alpha(lp3, targets, input_lengths, target_lengths, blank)
    n, t_max, s_len = emit.shape
    tl = jnp.asarray(np.asarray(target_lengths, np.int64))
    il = jnp.asarray(np.asarray(input_lengths, np.int64))
    s = jnp.arange(s_len)
    in_range = s[None, :] <= 2 * tl[:, None]
    skip_next = ext != _shift(ext, -2, blank)
    neg = jnp.asarray(-jnp.inf, emit.dtype)
    t_idx = jnp.arange(t_max)
    # beta, backwards in time; each sequence starts at its own last step il-1.
    def step(nxt, inputs):
        e, t = inputs
        lb2 = _shift(nxt, -1, neg)
        lb3 = jnp.where(skip_next, _shift(nxt, -2, neg), neg)
        cur = jnp.where(in_range, _lse3(nxt, lb2, lb3) + e, neg)
        start = jnp.where(in_range & ((s[None, :] == 2 * tl[:, None]) | (s[None, :] == 2 * tl[:, None] - 1)), e, neg)
        cur = jnp.where((t == il - 1)[:, None], start, jnp.where((t < il - 1)[:, None], cur, neg))
        return cur, cur

    init = jnp.full((n, s_len), neg)
    _, betas = lax.scan(step, init, (jnp.swapaxes(emit, 0, 1)[::-1], t_idx[::-1]))
    beta = jnp.swapaxes(betas[::-1], 0, 1)                     # (N, T, S)
    nll = neg_log_likelihood.reshape(-1).astype(emit.dtype)
    post = jnp.exp(alpha + beta + nll[:, None, None])          # alpha*beta / p(l|x)
    c = lp3.shape[2]
    occ = jnp.zeros((n, t_max, c), emit.dtype).at[
        jnp.arange(n)[:, None, None], t_idx[None, :, None], jnp.broadcast_to(ext[:, None, :], (n, t_max, s_len))
    ].add(jnp.where(jnp.isnan(post), 0, post))
    lp = jnp.transpose(lp3, (1, 0, 2))                          # (N, T, C)
    g = (jnp.exp(lp) - occ * jnp.exp(-lp)) * grad.reshape(-1)[:, None, None]
    g = jnp.where((t_idx[None, :] < il[:, None])[:, :, None], g, 0)
    if zero_infinity:
        g = jnp.where(jnp.isinf(nll_raw)[:, None, None], 0, g)
    g = jnp.transpose(g, (1, 0, 2))
    return g[:, 0, :] if unbatched else g
