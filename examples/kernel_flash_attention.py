"""Blockwise (flash-style) causal attention as a Pallas kernel, registered with torchneuron.kernel.

The forward is a Pallas kernel: one program per (batch, head, block of queries) streams over the
key/value blocks up to the diagonal with an online softmax, so the T x T score matrix never exists.
Pallas has no reverse-mode rule, so the kernel gives ``backward=``: a jax.numpy function that
recomputes attention and differentiates it (it does materialise the scores; a Pallas backward
kernel is the next step for long sequences).

On the CPU platform (the default here) torchneuron traces Pallas kernels in interpret mode
automatically; on GPU/TPU platforms they compile natively.

    .venv/bin/python examples/kernel_flash_attention.py
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import torchneuron


def _flash_forward(q, k, v, scale, block_q, block_k):
    batch, heads, seq, dim = q.shape
    block_q, block_k = min(block_q, seq), min(block_k, seq)
    if seq % block_q or seq % block_k:
        raise ValueError(f"sequence length {seq} must be a multiple of block_q={block_q} and block_k={block_k}")

    def kernel(q_ref, k_ref, v_ref, o_ref):
        qi = pl.program_id(2)
        qb = q_ref[...].astype(jnp.float32) * scale                       # [block_q, dim]
        q_pos = qi * block_q + jnp.arange(block_q)[:, None]

        def step(j, carry):
            m, denom, acc = carry
            kb = k_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)  # [block_k, dim]
            vb = v_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
            s = qb @ kb.T
            k_pos = j * block_k + jnp.arange(block_k)[None, :]
            s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            return m_new, alpha * denom + p.sum(axis=-1), alpha[:, None] * acc + p @ vb

        # Causal: only key blocks that start at or before this query block's last row.
        n_blocks = ((qi + 1) * block_q + block_k - 1) // block_k
        init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
                jnp.zeros((block_q, dim), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(0, n_blocks, step, init)
        o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)

    q_spec = pl.BlockSpec((None, None, block_q, dim), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, seq, dim), lambda b, h, i: (b, h, 0, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, heads, seq // block_q),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
    )(q, k, v)


def _dense_attention(q, k, v, scale):
    """Causal attention in jax.numpy (what the backward differentiates)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    seq = q.shape[2]
    s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


def _flash_backward(q, k, v, scale, block_q, block_k, grad):
    _, pullback = jax.vjp(lambda q, k, v: _dense_attention(q, k, v, scale), q, k, v)
    dq, dk, dv = pullback(grad)
    return dq, dk, dv, None, None, None    # one gradient per argument of the kernel


@torchneuron.kernel("examples::flash_attention", backward=_flash_backward)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    return _flash_forward(q, k, v, scale, block_q, block_k)


def reference(q, k, v, scale):
    """The same computation as PyTorch composite ops."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def main():
    torch.manual_seed(0)
    batch, heads, seq, dim = 2, 4, 128, 32
    q, k, v = (torch.randn(batch, heads, seq, dim) for _ in range(3))
    scale = 1 / math.sqrt(dim)
    for device in ("cpu", "neuron"):
        qd, kd, vd = (t.detach().to(device).requires_grad_() for t in (q, k, v))
        out = flash_attention(qd, kd, vd, scale, 32, 32)
        out.square().sum().backward()
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = reference(qr, kr, vr, scale)
        ref.square().sum().backward()
        torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
        for got, want in ((qd, qr), (kd, kr), (vd, vr)):
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)
        print(f"{device:6s}: values and gradients match scaled_dot_product_attention(is_causal=True)")

    # Inside torch.compile: the Pallas forward and the jnp backward are traced into the forward and
    # backward graphs' executables.
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, scale, 32, 32), backend="neuron")
    qd, kd, vd = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
    out = compiled(qd, kd, vd)
    out.square().sum().backward()
    torch.testing.assert_close(out.cpu(), reference(q, k, v, scale), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(qd.grad.cpu(), qr.grad, rtol=1e-4, atol=1e-4)
    print("torch.compile(backend='neuron'): values and gradients match")


if __name__ == "__main__":
    main()
