"""Bucketed boxes whose innermost dim is padded (attention scores ``[b, h, t, t]``) move as rows of
the padded width, read past each row's end and written as overlapping windows: the values must be
exactly the element-by-element path's, for every dtype, offset and layout, and for values that
float addition would change (-0.0, NaN)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchneuron
from torchneuron.ops import dynamic as dyn

B, H, T = 2, 3, 16


def _dims(t):
    return [((B, B),), ((H, H),), ((t, T),), ((t, T),)]


def _reference_box(flat, t, strides, offset):
    box = np.zeros((B, H, T, T), flat.dtype)
    for i in np.ndindex(B, H, t, t):
        box[i] = flat[offset + sum(a * s for a, s in zip(i, strides))]
    return box


def _flat(dtype, n):
    rng = np.random.default_rng(0)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-100, 100, n).astype(dtype)
    x = rng.standard_normal(n).astype(dtype)
    x[::7] = -0.0
    x[5::11] = np.nan
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_, np.float64])
@pytest.mark.parametrize("t,offset", [(11, 0), (16, 5), (9, 37)])
def test_padded_innermost_read_and_write_equal_the_element_path(dtype, t, offset):
    strides = (H * t * t + 3, t * t, t, 1)      # row-major innermost, a gap between batches
    n = offset + (B - 1) * strides[0] + (H - 1) * strides[1] + (t - 1) * strides[2] + t
    flat = _flat(dtype, n)
    read = jax.jit(lambda f, s, tt: dyn.box_read(f, _dims(tt), [s[i] for i in range(4)], offset, tail=1))
    box = np.asarray(read(jnp.asarray(flat), jnp.asarray(strides), jnp.asarray(t)))
    ref = _reference_box(flat, t, strides, offset)
    np.testing.assert_array_equal(box.view(np.uint8), ref.view(np.uint8))    # bit for bit

    # A box's pad is don't-care: garbage there must not reach the written tensor.
    garbage = ref.copy()
    pad = np.ones(ref.shape, bool)
    pad[:, :, :t, :t] = False
    garbage[pad] = _flat(dtype, int(pad.sum()))[::-1]
    if dtype != np.bool_:
        garbage[pad] += 1
    dense = (H * t * t, t * t, t, 1)
    write = jax.jit(lambda b, tt, s: dyn.box_write(b, _dims(tt), [B, H, tt, tt], [s[i] for i in range(4)],
                                                     contiguous=True))
    out = np.asarray(write(jnp.asarray(garbage), jnp.asarray(t), jnp.asarray(dense)))
    numel = B * H * t * t
    expect = np.zeros(B * H * T * T, flat.dtype)
    expect[:numel] = ref[:, :, :t, :t].reshape(-1)
    np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))


def _gathers(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["slice_sizes"] for e in jaxpr.eqns if e.primitive.name == "gather"]


def test_a_padded_innermost_row_major_view_is_read_as_rows():
    t = jnp.asarray(11)
    flat = jnp.zeros(B * H * T * T, jnp.float32)
    rows = _gathers(lambda f, tt: dyn.box_read(f, _dims(tt), [H * 121, 121, 11, 1], 0, tail=4), flat, t)
    assert rows == [(T,)]
    # Not stride 1 innermost (a transposed view): element by element.
    elements = _gathers(lambda f, tt: dyn.box_read(f, _dims(tt), [H * 121, 121, 1, 11], 0, tail=0), flat, t)
    assert elements == [(1,)]


def test_bucketed_eager_attention_scores_equal_cpu_bit_for_bit():
    torchneuron.config.shapes = "bucketed"
    try:
        for t in (7, 13, 23, 29):      # the first two learn that t varies
            scores = torch.randn(2, 3, t, t)
            scores[0, 0, :, 0] = -0.0
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            dev = scores.to("neuron")
            masked = dev.masked_fill(mask.to("neuron"), float("-inf"))
            got = torch.softmax(masked, -1)
            assert masked.stride() == scores.stride()
            assert torch.equal(masked.cpu(), scores.masked_fill(mask, float("-inf")))
            torch.testing.assert_close(got.cpu(), torch.softmax(scores.masked_fill(mask, float("-inf")), -1))
            assert torch.equal(torch.signbit(dev.clone().cpu()), torch.signbit(scores))
        assert torchneuron.metrics()["extra"]["bucketed_eager_compiles"] > 0
    finally:
        torchneuron.config.shapes = "static"
