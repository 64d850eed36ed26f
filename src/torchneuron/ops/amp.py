"""Automatic mixed precision: the two fused ops ``torch.amp.GradScaler`` calls every step.

``_amp_foreach_non_finite_check_and_unscale_`` multiplies every gradient by ``inv_scale`` and sets
``found_inf`` to 1 if any gradient holds an inf or NaN (it never clears it: the scaler zeroes it);
``_amp_update_scale_`` backs the scale off after an overflow or grows it after ``growth_interval``
clean steps. Both follow ATen's CPU kernels: half-precision gradients are unscaled in float32, the
new scale is the float32 rounding of a float64 product, and growth that would overflow to inf is
skipped. Without them every step ran both on CPU (a device->host->device round trip).
"""

from __future__ import annotations

import jax.numpy as jnp

from .numerics import compute_dtype
from .registry import lowering


@lowering("_amp_foreach_non_finite_check_and_unscale_.default")
def amp_foreach_non_finite_check_and_unscale_(self, found_inf, inv_scale):
    inv = inv_scale.reshape(())
    found = found_inf.reshape(())
    grads = []
    for g in self:
        v = g.astype(compute_dtype(g.dtype))
        found = jnp.where(jnp.all(jnp.isfinite(v)), found, jnp.ones((), found.dtype))
        grads.append((v * inv.astype(v.dtype)).astype(g.dtype))
    # Mutated arguments in schema order: each gradient, then found_inf.
    return (*grads, found.reshape(found_inf.shape))


@lowering("_amp_update_scale_.default")
def amp_update_scale_(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor,
                      growth_interval):
    scale = self.reshape(())
    wide = scale.astype(jnp.float64)
    overflow = found_inf.reshape(()) != 0
    successful = growth_tracker.reshape(()) + 1
    grow = successful == growth_interval
    grown = (wide * scale_growth_factor).astype(scale.dtype)
    backed_off = (wide * scale_backoff_factor).astype(scale.dtype)
    new_scale = jnp.where(overflow, backed_off, jnp.where(grow & jnp.isfinite(grown), grown, scale))
    new_tracker = jnp.where(overflow | grow, jnp.zeros_like(successful), successful)
    return new_scale.reshape(self.shape), new_tracker.astype(growth_tracker.dtype).reshape(growth_tracker.shape)
