"""Resampling: interpolation (upsample_*), reflection/replication padding, grid sampling and
im2col/col2im, with their backwards.

Interpolation is separable: for each spatial dim a static (out x in) weight matrix is built on the
host from ATen's index arithmetic (``UpSample.h``: source-index rules, bicubic A = -0.75, the
antialiased filters), then applied with one contraction per dim. Backwards are the transposed
contractions, obtained as JAX VJPs, so forward and gradient cannot disagree.

uint8 images (bilinear/bicubic, with or without antialias) follow ATen's fixed-point path instead,
bit for bit: int16 weights at a per-dim precision, one integer pass per resized dim (width first),
each rounded and clamped to 0..255. Other integer dtypes have no CPU kernel and are refused.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .numerics import compute_dtype, require_floating
from .registry import lowering

_HIGHEST = lax.Precision.HIGHEST


def _acc(x):
    return compute_dtype(x.dtype)


# -- source-index rules (UpSample.h) ------------------------------------------------------------
def _scale(in_size, out_size, align_corners, scale):
    """area_pixel_compute_scale."""
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    if scale is not None and scale > 0:
        return 1.0 / scale
    return in_size / out_size if out_size else 0.0


def _source_index(scale, dst, align_corners, cubic):
    """area_pixel_compute_source_index, float32 like ATen's opmath for float inputs."""
    dst = dst.astype(np.float32)
    scale = np.float32(scale)
    if align_corners:
        return scale * dst
    src = scale * (dst + np.float32(0.5)) - np.float32(0.5)
    return src if cubic else np.maximum(src, np.float32(0))


def _linear_matrix(in_size, out_size, align_corners, scale):
    m = np.zeros((out_size, in_size), np.float64)
    if out_size == 0 or in_size == 0:
        return m
    s = _scale(in_size, out_size, align_corners, scale)
    src = _source_index(s, np.arange(out_size), align_corners, False)
    i0 = np.floor(src).astype(np.int64)
    i0 = np.minimum(i0, in_size - 1)
    step = (i0 < in_size - 1).astype(np.int64)
    lam1 = (src - i0).astype(np.float32)
    lam0 = np.float32(1) - lam1
    rows = np.arange(out_size)
    np.add.at(m, (rows, i0), lam0)
    np.add.at(m, (rows, i0 + step), lam1)
    return m


def _cubic_coeffs(t, a=-0.75):
    def cc1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def cc2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [cc2(t + 1), cc1(t), cc1(1 - t), cc2(2 - t)]


def _cubic_matrix(in_size, out_size, align_corners, scale):
    m = np.zeros((out_size, in_size), np.float64)
    if out_size == 0 or in_size == 0:
        return m
    s = _scale(in_size, out_size, align_corners, scale)
    src = _source_index(s, np.arange(out_size), align_corners, True)
    i0 = np.floor(src).astype(np.int64)
    t = (src - i0).astype(np.float32)
    rows = np.arange(out_size)
    for k, w in enumerate(_cubic_coeffs(t)):
        np.add.at(m, (rows, np.clip(i0 - 1 + k, 0, in_size - 1)), w)
    return m


def _aa_matrix(in_size, out_size, align_corners, scale, cubic):
    """Antialiased bilinear/bicubic weights (_compute_weights_aa in UpSampleKernel.cpp)."""
    m = np.zeros((out_size, in_size), np.float64)
    if out_size == 0 or in_size == 0:
        return m
    interp = 4 if cubic else 2
    s = _scale(in_size, out_size, align_corners, scale)
    support = (interp * 0.5) * s if s >= 1.0 else interp * 0.5
    invscale = 1.0 / s if s >= 1.0 else 1.0

    def filt(x):
        x = abs(x)
        if cubic:
            a = -0.5
            if x < 1:
                return ((a + 2) * x - (a + 3)) * x * x + 1
            if x < 2:
                return (((x - 5) * x + 8) * x - 4) * a
            return 0.0
        return 1.0 - x if x < 1 else 0.0

    for i in range(out_size):
        center = s * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(int(center + support + 0.5), in_size) - xmin
        w = np.array([filt((j + xmin - center + 0.5) * invscale) for j in range(xsize)])
        total = w.sum()
        if total != 0:
            w = w / total
        m[i, xmin:xmin + xsize] = w
    return m


def _nearest_index(in_size, out_size, scale, exact):
    """nearest_idx / nearest_neighbor_exact_compute_source_index."""
    dst = np.arange(out_size)
    if not exact and out_size == in_size:
        return dst
    if not exact and out_size == 2 * in_size:
        return dst >> 1
    s = np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(in_size / out_size)
    src = np.floor((dst.astype(np.float32) + (np.float32(0.5) if exact else 0)) * s).astype(np.int64)
    return np.minimum(src, in_size - 1)


# -- applying per-dim rules ---------------------------------------------------------------------
def _apply_matrices(x, matrices):
    """Contract each of the trailing spatial dims of x with its (out x in) matrix."""
    acc = _acc(x)
    y = x.astype(acc)
    nd = len(matrices)
    for d, m in enumerate(matrices):
        axis = x.ndim - nd + d
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(m, acc), axes=([axis], [1]), precision=_HIGHEST), -1, axis)
    return y.astype(x.dtype)


def _gather_nearest(x, indices):
    nd = len(indices)
    for d, idx in enumerate(indices):
        x = jnp.take(x, jnp.asarray(idx), axis=x.ndim - nd + d)
    return x


def _scales(scales, nd):
    scales = list(scales) if scales is not None else [None] * nd
    return scales + [None] * (nd - len(scales))


# -- uint8: ATen's fixed-point resampling (UpSampleKernel.cpp, after Pillow-SIMD) ---------------
def _keys_filter(x, a):
    x = abs(x)
    if x < 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _u8_taps(in_size, out_size, align_corners, scale, cubic, antialias):
    """Per output index: (first input index, float weights), as ATen's _compute_index_ranges_weights
    computes them in double for uint8 (plus the largest weight, which sets the precision)."""
    interp = 4 if cubic else 2
    if cubic:
        a = -0.5 if antialias else -0.75     # Pillow's antialiased cubic, OpenCV's plain one
        filt = lambda x: _keys_filter(x, a)  # noqa: E731
    else:
        filt = lambda x: max(0.0, 1.0 - abs(x))  # noqa: E731
    s = _scale(in_size, out_size, align_corners, scale)
    taps, wt_max = [], 0.0
    if antialias:
        support = interp * 0.5 * s if s >= 1.0 else interp * 0.5
        width = int(math.ceil(support)) * 2 + 1
        invscale = 1.0 / s if s >= 1.0 else 1.0
        for i in range(out_size):
            center = s * (i + 0.5)
            xmin = max(int(center - support + 0.5), 0)
            xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), width)
            w = [filt((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
            total = sum(w)
            if total != 0.0:
                w = [v / total for v in w]
                wt_max = max(wt_max, *w)
            taps.append((xmin, w))
        return taps, wt_max
    support = interp // 2
    for i in range(out_size):
        if align_corners:
            real = s * i
        else:
            real = s * (i + 0.5) - 0.5
            real = real if cubic or real >= 0 else 0.0
        index = min(int(np.floor(np.float32(real))), in_size - 1)   # floorf, as ATen
        lam = min(max(real - index, 0.0), 1.0)
        lo = index - support + 1
        xmin = max(lo, 0)
        xsize = min(max(min(index + support + 1, in_size) - xmin, 0), interp)
        # Taps outside the input fold onto the edge samples.
        w, k = [0.0] * interp, 0
        for j in range(interp):
            if lo + j <= 0:
                k = 0
            elif lo + j >= in_size - 1:
                k = xsize - 1
            w[k] += filt(j + 1 - support - lam)
            wt_max = max(wt_max, w[k])
            k += 1
        taps.append((xmin, w[:xsize]))
    return taps, wt_max


def _u8_matrix(in_size, out_size, align_corners, scale, cubic, antialias):
    """The int16 weights as an (out x in) int32 matrix, and their precision in bits."""
    taps, wt_max = _u8_taps(in_size, out_size, align_corners, scale, cubic, antialias)
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    m = np.zeros((out_size, in_size), np.int32)
    for i, (xmin, w) in enumerate(taps):
        for j, v in enumerate(w):
            v *= 1 << precision
            m[i, xmin + j] = int(v - 0.5) if v < 0 else int(v + 0.5)   # round half away from zero
    return m, precision


def _upsample_uint8(x, output_size, mode, align_corners, scales):
    cubic, antialias = mode in ("cubic", "aa-cubic"), mode.startswith("aa-")
    nd = len(output_size)
    y = x
    for d in reversed(range(nd)):           # the contiguous (width) dim first, as ATen
        axis = x.ndim - nd + d
        if y.shape[axis] == output_size[d]:
            continue
        m, precision = _u8_matrix(y.shape[axis], output_size[d], align_corners, scales[d], cubic, antialias)
        acc = jnp.tensordot(y.astype(jnp.int32), jnp.asarray(m), axes=([axis], [1]),
                            preferred_element_type=jnp.int32)
        acc = jnp.moveaxis(acc, -1, axis) + (1 << (precision - 1))
        y = jnp.clip(jnp.right_shift(acc, precision), 0, 255).astype(jnp.uint8)
    return y


_ATEN_NAMES = {("linear", 1): "upsample_linear1d", ("linear", 2): "upsample_bilinear2d",
               ("linear", 3): "upsample_trilinear3d", ("cubic", 2): "upsample_bicubic2d",
               ("aa-linear", 2): "_upsample_bilinear2d_aa", ("aa-cubic", 2): "_upsample_bicubic2d_aa"}


def _upsample(x, output_size, mode, align_corners, scales):
    nd = len(output_size)
    in_sizes = x.shape[-nd:]
    scales = _scales(scales, nd)
    if mode in ("nearest", "nearest-exact"):
        idx = [_nearest_index(i, o, s, mode == "nearest-exact") for i, o, s in zip(in_sizes, output_size, scales)]
        return _gather_nearest(x, idx)
    # ATen resamples uint8 images in 2-d bilinear/bicubic only; nothing else integer.
    if x.dtype == jnp.uint8 and nd == 2:
        return _upsample_uint8(x, output_size, mode, align_corners, scales)
    require_floating(_ATEN_NAMES[mode, nd], x)
    build = {"linear": _linear_matrix, "cubic": _cubic_matrix}.get(mode)
    if build is not None:
        mats = [build(i, o, align_corners, s) for i, o, s in zip(in_sizes, output_size, scales)]
    else:
        mats = [_aa_matrix(i, o, align_corners, s, mode == "aa-cubic")
                for i, o, s in zip(in_sizes, output_size, scales)]
    return _apply_matrices(x, mats)


def _vec_sizes(input, output_size, scale_factors, nd):
    if output_size is not None:
        return list(output_size), [None] * nd
    return [int(math.floor(s * f)) for s, f in zip(input.shape[-nd:], scale_factors)], list(scale_factors)


def _register(name, nd, mode, has_align):
    if has_align:
        @lowering(f"{name}.default")
        def fwd(self, output_size, align_corners, *scales):
            return _upsample(self, output_size, mode, align_corners, scales)

        @lowering(f"{name}_backward.default")
        def bwd(grad_output, output_size, input_size, align_corners, *scales):
            zeros = jnp.zeros(tuple(input_size), grad_output.dtype)
            _, vjp = jax.vjp(lambda x: _upsample(x, output_size, mode, align_corners, scales), zeros)
            return vjp(grad_output)[0]

        @lowering(f"{name}.vec", graph_only=True)   # CompositeImplicitAutograd
        def vec(input, output_size, align_corners, scale_factors):
            sizes, scales = _vec_sizes(input, output_size, scale_factors, nd)
            return _upsample(input, sizes, mode, align_corners, scales)
    else:
        @lowering(f"{name}.default")
        def fwd(self, output_size, *scales):
            return _upsample(self, output_size, mode, False, scales)

        @lowering(f"{name}_backward.default")
        def bwd(grad_output, output_size, input_size, *scales):
            zeros = jnp.zeros(tuple(input_size), grad_output.dtype)
            _, vjp = jax.vjp(lambda x: _upsample(x, output_size, mode, False, scales), zeros)
            return vjp(grad_output)[0]

        @lowering(f"{name}.vec", graph_only=True)   # CompositeImplicitAutograd
        def vec(input, output_size, scale_factors):
            sizes, scales = _vec_sizes(input, output_size, scale_factors, nd)
            return _upsample(input, sizes, mode, False, scales)


for _name, _nd, _mode, _align in [
    ("upsample_nearest1d", 1, "nearest", False), ("upsample_nearest2d", 2, "nearest", False),
    ("upsample_nearest3d", 3, "nearest", False), ("_upsample_nearest_exact1d", 1, "nearest-exact", False),
    ("_upsample_nearest_exact2d", 2, "nearest-exact", False),
    ("_upsample_nearest_exact3d", 3, "nearest-exact", False),
    ("upsample_linear1d", 1, "linear", True), ("upsample_bilinear2d", 2, "linear", True),
    ("upsample_trilinear3d", 3, "linear", True), ("upsample_bicubic2d", 2, "cubic", True),
    ("_upsample_bilinear2d_aa", 2, "aa-linear", True), ("_upsample_bicubic2d_aa", 2, "aa-cubic", True),
]:
    _register(_name, _nd, _mode, _align)


# -- padding ------------------------------------------------------------------------------------
def _pad_index(in_size, lo, hi, mode):
    """Source position of every output position of one padded dim (negative pads crop)."""
    i = np.arange(in_size + lo + hi) - lo
    if mode == "edge":
        return np.clip(i, 0, in_size - 1)
    i = np.abs(i)                                   # reflect about 0 ...
    return np.where(i >= in_size, 2 * (in_size - 1) - i, i)   # ... and about in_size - 1


def _pad(x, padding, mode):
    nd = len(padding) // 2
    for i in range(nd):
        axis = x.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        if lo or hi:
            x = jnp.take(x, jnp.asarray(_pad_index(x.shape[axis], lo, hi, mode)), axis=axis)
    return x


def _register_pad(kind, nd, mode):
    name = f"{kind}_pad{nd}d"

    @lowering(f"{name}.default")
    def fwd(self, padding):
        return _pad(self, padding, mode)

    @lowering(f"{name}_backward.default")
    def bwd(grad_output, self, padding):
        _, vjp = jax.vjp(lambda x: _pad(x, padding, mode), self)
        return vjp(grad_output.astype(self.dtype))[0]


for _nd in (1, 2, 3):
    _register_pad("reflection", _nd, "reflect")
    _register_pad("replication", _nd, "edge")


# -- grid sampling ------------------------------------------------------------------------------
def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, lo2, hi2):
    """reflect_coordinates over [lo2/2, hi2/2]."""
    if lo2 == hi2:
        return jnp.zeros_like(coord)
    lo = lo2 / 2
    span = (hi2 - lo2) / 2
    c = jnp.abs(coord - lo)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span)
    return jnp.where(flips % 2 == 0, extra + lo, span - extra + lo)


def _source(coord, size, padding_mode, align_corners):
    c = _unnormalize(coord, size, align_corners)
    if padding_mode == 1:        # border
        c = jnp.clip(c, 0, size - 1)
    elif padding_mode == 2:      # reflection
        c = _reflect(c, 0, 2 * (size - 1)) if align_corners else _reflect(c, -1, 2 * size - 1)
        c = jnp.clip(c, 0, size - 1)
    return c


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """input (N, C, *spatial), grid (N, *out, nd) with coordinates in x (last dim), y, z order."""
    nd = input.ndim - 2
    n, c = input.shape[:2]
    sizes = input.shape[2:]
    acc = _acc(input)
    x = input.astype(acc).reshape(n, c, -1)
    g = grid.astype(acc)
    out_shape = g.shape[1:-1]
    coords = [g[..., nd - 1 - d] for d in range(nd)]           # per spatial dim (d, h, w order)
    strides = [int(np.prod(sizes[d + 1:])) for d in range(nd)]

    def gather(idx_list, weight):
        inside = jnp.ones(idx_list[0].shape, bool)
        flat = jnp.zeros(idx_list[0].shape, jnp.int64)
        for d, idx in enumerate(idx_list):
            inside = inside & (idx >= 0) & (idx < sizes[d])
            flat = flat + jnp.clip(idx, 0, sizes[d] - 1).astype(jnp.int64) * strides[d]
        vals = jnp.take_along_axis(x, flat.reshape(n, 1, -1), axis=2).reshape((n, c) + out_shape)
        w = jnp.where(inside, weight, 0)[:, None]
        return vals * w

    if interpolation_mode == 2:    # bicubic: 4^nd taps, each tap padded on its own
        src = [_unnormalize(co, s, align_corners) for co, s in zip(coords, sizes)]
        base = [jnp.floor(s) for s in src]
        ts = [s - b for s, b in zip(src, base)]
        coeffs = [_cubic_coeffs(t) for t in ts]
        out = 0
        for taps in np.ndindex(*(4,) * nd):
            idx, weight = [], 1
            for d, k in enumerate(taps):
                i = base[d] - 1 + k
                if padding_mode == 1:
                    i = jnp.clip(i, 0, sizes[d] - 1)
                elif padding_mode == 2:
                    i = _reflect(i, 0, 2 * (sizes[d] - 1)) if align_corners else _reflect(i, -1, 2 * sizes[d] - 1)
                    i = jnp.clip(i, 0, sizes[d] - 1)
                idx.append(i.astype(jnp.int64))
                weight = weight * coeffs[d][k]
            out = out + gather(idx, weight)
        return out.astype(input.dtype)
    src = [_source(co, s, padding_mode, align_corners) for co, s in zip(coords, sizes)]
    if interpolation_mode == 1:    # nearest, ties to even as nearbyint
        idx = [jnp.round(s).astype(jnp.int64) for s in src]
        return gather(idx, jnp.ones(idx[0].shape, acc)).astype(input.dtype)
    lo = [jnp.floor(s) for s in src]
    frac = [s - f for s, f in zip(src, lo)]
    out = 0
    for corner in np.ndindex(*(2,) * nd):
        idx, weight = [], 1
        for d, k in enumerate(corner):
            idx.append((lo[d] + k).astype(jnp.int64))
            weight = weight * (frac[d] if k else 1 - frac[d])
        out = out + gather(idx, weight)
    return out.astype(input.dtype)


@lowering("grid_sampler_2d.default", "grid_sampler_3d.default")
def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    require_floating(f"grid_sampler_{input.ndim - 2}d", input)
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lowering("grid_sampler_2d_backward.default", "grid_sampler_3d_backward.default")
def grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                          output_mask):
    _, vjp = jax.vjp(lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners),
                     input, grid)
    gi, gg = vjp(grad_output.astype(input.dtype))
    return (gi if output_mask[0] else None), gg


# -- im2col / col2im ----------------------------------------------------------------------------
def _im2col_indices(sizes, kernel, dilation, padding, stride):
    """Static gather positions (into the padded image) of every (channel-offset, block) pair."""
    out = [(s + 2 * p - (d * (k - 1) + 1)) // st + 1 for s, k, d, p, st in zip(sizes, kernel, dilation, padding, stride)]
    kh, kw = kernel
    rows = (np.arange(kh)[:, None, None, None] * dilation[0] + np.arange(out[0])[None, None, :, None] * stride[0])
    cols = (np.arange(kw)[None, :, None, None] * dilation[1] + np.arange(out[1])[None, None, None, :] * stride[1])
    rows = np.broadcast_to(rows, (kh, kw, out[0], out[1])).reshape(kh * kw, -1)
    cols = np.broadcast_to(cols, (kh, kw, out[0], out[1])).reshape(kh * kw, -1)
    return rows, cols, out


@lowering("im2col.default")
def im2col(self, kernel_size, dilation, padding, stride):
    batched = self.ndim == 4
    x = self if batched else self[None]
    n, c = x.shape[:2]
    xp = jnp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    rows, cols, _ = _im2col_indices(x.shape[2:], kernel_size, dilation, padding, stride)
    out = xp[:, :, rows, cols].reshape(n, c * rows.shape[0], rows.shape[1])
    return out if batched else out[0]


@lowering("col2im.default")
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    if self.dtype == jnp.bool_:   # overlapping blocks add up: no bool sum (none on CPU either)
        require_floating("col2im", self)
    batched = self.ndim == 3
    x = self if batched else self[None]
    n = x.shape[0]
    k = kernel_size[0] * kernel_size[1]
    c = x.shape[1] // k
    h, w = output_size
    rows, cols, _ = _im2col_indices((h, w), kernel_size, dilation, padding, stride)
    vals = x.reshape(n, c, k, x.shape[2])
    out = jnp.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), x.dtype).at[:, :, rows, cols].add(vals)
    out = out[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + w]
    return out if batched else out[0]
