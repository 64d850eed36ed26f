"""``nn.TransformerEncoderLayer``'s inference fast path (``_transformer_encoder_layer_fwd``).

In eval mode without autograd, PyTorch runs a whole encoder layer as this one fused op (on CPU,
CUDA and PrivateUse1 devices alike), which had no lowering and so ran on CPU. It is ATen's
``transformer_encoder_layer_forward``: self-attention as ``_native_multi_head_attention`` computes
it (packed QKV projection, queries scaled by 1/sqrt(head_dim) after their bias, masked softmax in
which a fully masked row gives zeros, output projection), a residual, layer norm before or after
each block (``norm_first``), and the ReLU/exact-GELU feed-forward block.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from .nn import _layer_norm
from .numerics import compute_dtype
from .precision import MATMUL, matmul_precision
from .registry import lowering


def _linear(x, weight, bias):
    return jnp.matmul(x, weight.T, precision=matmul_precision()) + bias


def _masked_softmax(scores, mask, mask_type):
    """ATen's _masked_softmax over the last dim: True (or nonzero) mask entries are left out."""
    if mask is None:
        return jnp.exp(scores - scores.max(-1, keepdims=True)) / jnp.exp(
            scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True)
    masked = mask.astype(jnp.bool_)
    if mask_type == 1:          # key padding mask (B, S)
        masked = masked[:, None, None, :]
    elif masked.ndim == 2:      # attention mask (L, S)
        masked = masked[None, None]
    masked = jnp.broadcast_to(masked, scores.shape)
    top = jnp.where(masked, -jnp.inf, scores).max(-1, keepdims=True)
    e = jnp.where(masked, 0, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0)))
    total = e.sum(-1, keepdims=True)
    return jnp.where(total > 0, e / jnp.where(total > 0, total, 1), 0)


def _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    b, t, d = x.shape
    head = d // num_heads
    qkv = _linear(x, qkv_weight, qkv_bias).reshape(b, t, 3, num_heads, head).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0] / math.sqrt(head), qkv[1], qkv[2]
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=matmul_precision())
    ctx = jnp.matmul(_masked_softmax(scores, mask, mask_type), v, precision=matmul_precision())
    return _linear(ctx.transpose(0, 2, 1, 3).reshape(b, t, d), proj_weight, proj_bias)


@lowering("_transformer_encoder_layer_fwd.default", precision=MATMUL)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                                  mask_type=None):
    if src.size == 0:
        return src
    acc = compute_dtype(src.dtype)
    cast = [a.astype(acc) for a in (qkv_weight, qkv_bias, proj_weight, proj_bias, ffn_weight_1, ffn_bias_1,
                                    ffn_weight_2, ffn_bias_2)]
    qkv_weight, qkv_bias, proj_weight, proj_bias, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2 = cast
    batched = src.ndim == 3
    x0 = src.astype(acc) if batched else src.astype(acc)[None]
    if mask is not None and not batched and mask_type == 1:
        mask = mask[None]

    def norm(x, w, b):
        return _layer_norm(x, (embed_dim,), w, b, eps)[0]

    x = norm(x0, norm_weight_1, norm_bias_1) if norm_first else x0
    x = _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type) + x0
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    h = _linear(x, ffn_weight_1, ffn_bias_1)
    h = 0.5 * h * (1 + lax.erf(h / math.sqrt(2))) if use_gelu else jnp.maximum(h, 0)
    x = _linear(h, ffn_weight_2, ffn_bias_2) + residual
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    x = x.astype(src.dtype)
    return x if batched else x[0]
