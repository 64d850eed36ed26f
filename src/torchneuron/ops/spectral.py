"""FFTs: the three primitives every ``torch.fft`` function decomposes into (and their backwards).

``normalization`` is ATen's fft_norm_mode: 0 = none, 1 = 1/sqrt(n), 2 = 1/n, where n is the
product of the signal sizes along ``dim`` (the real-domain sizes for r2c/c2r).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .registry import lowering


def _scale(x, n, normalization):
    if normalization == 1:
        return x * (1.0 / math.sqrt(n)) if n else x
    if normalization == 2:
        return x * (1.0 / n) if n else x
    return x


def _complex(x):
    if jnp.iscomplexobj(x):
        return x
    return x.astype(jnp.complex64 if x.dtype != jnp.float64 else jnp.complex128)


@lowering("_fft_r2c.default")
def fft_r2c(self, dim, normalization, onesided):
    axes = tuple(d % self.ndim for d in dim)
    x = self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self
    out = jnp.fft.fftn(x, axes=axes)
    if onesided:
        last = axes[-1]
        out = jnp.take(out, jnp.arange(self.shape[last] // 2 + 1), axis=last)
    n = math.prod(self.shape[a] for a in axes)
    return _scale(out, n, normalization)


@lowering("_fft_c2r.default")
def fft_c2r(self, dim, normalization, last_dim_size):
    axes = tuple(d % self.ndim for d in dim)
    sizes = [self.shape[a] for a in axes[:-1]] + [last_dim_size]
    # norm="forward" leaves the inverse transform unscaled; the scaling is ATen's.
    out = jnp.fft.irfftn(_complex(self), s=sizes, axes=axes, norm="forward")
    return _scale(out, math.prod(sizes), normalization)


@lowering("_fft_c2c.default")
def fft_c2c(self, dim, normalization, forward):
    x = _complex(self)
    if not dim:
        return x
    axes = tuple(d % self.ndim for d in dim)
    out = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    n = math.prod(self.shape[a] for a in axes)
    return _scale(out, n, normalization)
