"""Masking rules for bucketed dynamic dimensions: pure JAX functions on padded arrays.

A bucketed graph (``compile/dynamic.py``) evaluates every node on arrays padded along their
symbolic dims, with the invariant: along each such dim the first ``true`` elements are exact, the
rest is don't-care (it may hold anything, NaN and Inf included). ``lens`` below is one entry per
dim of an array: ``None`` for a dim that is not padded, else the dim's true size (a traced integer
scalar). The functions here make exact what would otherwise read the pad: they mask it with the
operation's identity (``jnp.where``, so NaN in the pad never propagates), count only the true
elements, and place or pick elements at true offsets.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .numerics import highest, lowest


class Factors(tuple):
    """A dim that merges several padded dims (``[b, t, c] -> [b*t, c]``) laid out as their padded
    box, row-major: ((true size or None, padded size), ...) outer to inner. Its exact elements are
    those whose every digit is below its factor's true size (not a prefix)."""

    @property
    def true(self):
        out = 1
        for t, p in self:
            out = out * (p if t is None else t)
        return out


def _dim_mask(n, true, shp, d):
    idx = lax.broadcasted_iota(jnp.int32, tuple(shp), d)
    if not isinstance(true, Factors):
        return idx < true
    mask = None
    inner = 1
    for t, p in reversed(true):
        if t is not None:
            m = (idx // inner) % p < t
            mask = m if mask is None else mask & m
        inner *= p
    return mask


def valid_mask(shape, lens, dims=None):
    """The boolean mask of the exact region of an array of ``shape`` (broadcastable to it), over
    ``dims`` (default: every padded dim); None when nothing there is padded. A dim's entry in
    ``lens`` is None, its true size (the exact region is a prefix) or ``Factors``."""
    mask = None
    for d, n in enumerate(shape):
        true = lens[d]
        if true is None or (dims is not None and d not in dims):
            continue
        shp = [1] * len(shape)
        shp[d] = n
        m = _dim_mask(n, true, shp, d)
        if m is None:
            continue
        mask = m if mask is None else mask & m
    return mask


def masked(x, lens, fill, dims=None):
    """``x`` with its pad (along ``dims``, default all padded dims) replaced by ``fill``."""
    m = valid_mask(x.shape, lens, dims)
    if m is None:
        return x
    return jnp.where(m, x, jnp.asarray(fill, dtype=x.dtype))


# The value a reduction ignores, per reduction kind.
def identity(kind: str, dtype):
    if kind in ("sum", "mean", "any"):
        return False if jnp.dtype(dtype) == jnp.bool_ else 0
    if kind == "prod" or kind == "all":
        return True if jnp.dtype(dtype) == jnp.bool_ else 1
    if kind in ("max", "argmax", "logsumexp"):
        return lowest(jnp.dtype(dtype))
    if kind in ("min", "argmin"):
        return highest(jnp.dtype(dtype))
    raise ValueError(kind)


def true_count(shape, lens, dims):
    """How many exact elements a reduction over ``dims`` sees (a traced value when padded)."""
    count = 1
    for d in dims:
        true = lens[d]
        count = count * (shape[d] if true is None else true.true if isinstance(true, Factors) else true)
    return count


def padded_count(shape, dims) -> int:
    return int(np.prod([shape[d] for d in dims], dtype=np.int64))


def rescale_mean(mean_of_padded, shape, lens, dims):
    """A mean the lowering took over the padded extent (pad masked to 0), as the true mean."""
    true = true_count(shape, lens, dims)
    return (mean_of_padded * padded_count(shape, dims) / true).astype(mean_of_padded.dtype)


def var(x, lens, dims, correction, keepdim):
    """Variance over ``dims`` counting only the exact elements."""
    n = true_count(x.shape, lens, dims)
    m = valid_mask(x.shape, lens, dims)
    xz = x if m is None else jnp.where(m, x, 0)
    mean = jnp.sum(xz, axis=tuple(dims), keepdims=True) / n
    dev = jnp.square(x - mean)
    if m is not None:
        dev = jnp.where(m, dev, 0)
    out = jnp.sum(dev, axis=tuple(dims), keepdims=keepdim) / jnp.maximum(n - correction, 0)
    return out.astype(x.dtype)


def softmax(x, lens, dim, log: bool):
    """(log_)softmax along ``dim``: pad entries take no share; the pad of the result is 0."""
    xm = masked(x, lens, -jnp.inf, dims=(dim,))
    fn = jax_log_softmax if log else jax_softmax
    return fn(xm, dim)


def jax_softmax(x, dim):
    mx = lax.stop_gradient(jnp.max(x, axis=dim, keepdims=True))
    e = jnp.exp(x - mx)
    return e / jnp.sum(e, axis=dim, keepdims=True)


def jax_log_softmax(x, dim):
    mx = lax.stop_gradient(jnp.max(x, axis=dim, keepdims=True))
    s = x - mx
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=dim, keepdims=True))


def matmul_operands(a, a_lens, a_dim, b, b_lens, b_dim):
    """Both operands of a contraction over a padded dim with their pad zeroed (masking only one
    would give 0 * inf = NaN)."""
    return masked(a, a_lens, 0, dims=(a_dim,)), masked(b, b_lens, 0, dims=(b_dim,))


def cat(arrays, lens_list, dim, out_size):
    """Concatenation along a padded dim: each piece goes at the sum of the true sizes before it."""
    first = arrays[0]
    shape = list(first.shape)
    shape[dim] = out_size
    out = jnp.zeros(shape, first.dtype)
    offset = 0
    for x, lens in zip(arrays, lens_list):
        x = x.astype(first.dtype)
        true = x.shape[dim] if lens[dim] is None else lens[dim]
        # The pad of a piece is written too and overwritten by the next piece; only what falls
        # beyond the output's extent is cut (dynamic_update_slice would move the start instead).
        room = out_size - x.shape[dim]
        start = [0] * len(shape)
        if room >= 0:
            start[dim] = jnp.minimum(offset, room)
            # Where the clamp would move the piece, shift it so its exact part lands at `offset`.
            piece = _shift(x, dim, offset - start[dim])
            out = lax.dynamic_update_slice(out, piece, tuple(start))
        else:
            piece = lax.slice_in_dim(x, 0, out_size, axis=dim)
            out = _place(out, piece, dim, offset)
        offset = offset + true
    return out


def _shift(x, dim, by):
    """``x`` rolled forward by ``by`` along ``dim`` (what lands in front is don't-care)."""
    return jnp.roll(x, by, axis=dim)


def _place(out, piece, dim, offset):
    n = out.shape[dim]
    idx = jnp.arange(n) - offset
    shp = [1] * out.ndim
    shp[dim] = n
    take = jnp.clip(idx, 0, piece.shape[dim] - 1)
    moved = jnp.take(piece, take, axis=dim)
    keep = ((idx >= 0) & (idx < piece.shape[dim])).reshape(shp)
    return jnp.where(keep, moved, out)


def reshape(x, true_in, true_out, padded_out):
    """A reshape of a padded array whose exact region is not a prefix of the padded one in memory:
    each output position takes the element at the same row-major position of the true shapes."""
    if all(isinstance(t, int) for t in (*true_in, *true_out)) and tuple(true_in) == tuple(x.shape) \
            and tuple(true_out) == tuple(padded_out):
        return x.reshape(padded_out)    # sizes compiled in and nothing padded: a plain reshape
    total = None
    for d, n in enumerate(padded_out):
        shp = [1] * len(padded_out)
        shp[d] = n
        idx = lax.broadcasted_iota(jnp.int32, tuple(shp), d)
        stride = 1
        for t in true_out[d + 1:]:
            stride = stride * t
        term = idx * stride
        total = term if total is None else total + term
    if total is None:
        return x.reshape(padded_out)
    total = jnp.broadcast_to(total, tuple(padded_out))
    coords = []
    rest = total
    for d in reversed(range(len(true_in))):
        t = true_in[d]
        coords.append(jnp.clip(rest % t, 0, x.shape[d] - 1))
        rest = rest // t
    coords.reverse()
    return x[tuple(coords)]


def select(x, dim, index, true_len):
    """``x.select(dim, index)`` along a padded dim: a negative index counts from the true end."""
    if isinstance(index, int) and index >= 0:
        return lax.index_in_dim(x, index, axis=dim, keepdims=False)
    index = jnp.where(index < 0, index + true_len, index) if not isinstance(index, int) else index + true_len
    return lax.dynamic_index_in_dim(x, index, axis=dim, keepdims=False)


def slice_from(x, dim, start, length):
    """``length`` elements of ``x`` along ``dim`` from ``start`` (a traced true offset), never
    clamped: the array is first extended by ``length`` along ``dim``."""
    pad = [(0, 0)] * x.ndim
    pad[dim] = (0, length)
    xp = jnp.pad(x, pad)
    return lax.dynamic_slice_in_dim(xp, start, length, axis=dim)


def wrap_negative(index, true_len):
    """Negative indices into a padded dim, counted from its true end."""
    return jnp.where(index < 0, index + true_len, index)


# -- storages with a bucket's capacity -------------------------------------------------------------
# A bucketed executable reads a dynamic input straight from its storage buffer and writes each result
# into a fresh buffer of the padded box's size, laid out as the true tensor: sizes, strides and
# offsets are runtime inputs, so one executable serves every size in its bucket (no per-shape pad
# or cut program). ``dims`` gives, per dim of the view, its factors ((true, padded), ...) outer to
# inner: one factor for a plain dim, several for a dim that merges dynamic dims (``Factors``).
def _index_dtype(n):
    return jnp.int64 if n >= 2**31 - 1 else jnp.int32


def _factor_coords(pos, factors):
    """(index along the true dim, in range) of box positions ``pos`` of a dim with ``factors``."""
    rest, true_index, scale, valid = pos, 0, 1, None
    for t, p in reversed(factors):
        digit = rest % p if len(factors) > 1 else rest
        rest = rest // p
        if not (isinstance(t, int) and t == p):
            ok = digit < t
            valid = ok if valid is None else valid & ok
        true_index = true_index + digit * scale
        scale = scale * t
    return true_index, valid


def _box_index(dims, strides, offset, n):
    """(flat index into a buffer of ``n`` elements, exact-region mask or None) of every position of
    the padded box of a view with ``dims``, ``strides`` and ``offset``."""
    shape = tuple(int(np.prod([p for _, p in fs])) for fs in dims)
    itype = _index_dtype(max(n, 1))
    idx, valid = jnp.asarray(offset, itype), None
    for d, fs in enumerate(dims):
        pos = lax.broadcasted_iota(itype, shape, d)
        true_index, ok = _factor_coords(pos, [(_as(t, itype), p) for t, p in fs])
        idx = idx + true_index * _as(strides[d], itype)
        if ok is not None:
            valid = ok if valid is None else valid & ok
    return jnp.broadcast_to(idx, shape), valid


def static_tail(dims) -> int:
    """How many trailing dims of a box are not padded (one factor whose true size is its padded
    size, compiled in): the block a row-wise read or write moves whole."""
    k = 0
    for fs in reversed(dims):
        if len(fs) != 1 or not (isinstance(fs[0][0], int) and fs[0][0] == fs[0][1]):
            break
        k += 1
    return k


def box_read(flat, dims, strides, offset, tail: int = 0):
    """The padded box of the view (``strides``, ``offset`` into ``flat``): exact where every factor
    is below its true size, zeros elsewhere. ``tail``: how many trailing dims the view is known
    (from its key) to hold contiguously; those that are not padded are read as whole rows."""
    k = min(tail, static_tail(dims))
    inner = int(np.prod([fs[0][1] for fs in dims[len(dims) - k:]], dtype=np.int64)) if k else 1
    if k == 0 and tail > 0 and _padded_innermost(dims):
        return _read_padded_rows(flat, dims, strides, offset)
    if inner == 1 or k == len(dims):
        idx, valid = _box_index(dims, strides, offset, flat.shape[0])
        values = flat[jnp.clip(idx, 0, flat.shape[0] - 1)]
        if valid is None:
            return values
        return jnp.where(valid, values, jnp.zeros((), flat.dtype))
    lead = dims[:len(dims) - k]
    starts, valid = _box_index(lead, strides, offset, flat.shape[0])
    starts = jnp.clip(starts, 0, max(flat.shape[0] - inner, 0))
    rows = lax.gather(flat, starts.reshape(-1, 1),
                      lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)),
                      slice_sizes=(inner,), mode=lax.GatherScatterMode.CLIP)
    rows = rows.reshape(*starts.shape, *[fs[0][1] for fs in dims[len(dims) - k:]])
    if valid is None:
        return rows
    return jnp.where(valid.reshape(*valid.shape, *([1] * k)), rows, jnp.zeros((), flat.dtype))


def _padded_innermost(dims) -> bool:
    """Whether a box's innermost dim is one padded factor (and there are dims before it)."""
    return len(dims) > 1 and len(dims[-1]) == 1 and not (isinstance(dims[-1][0][0], int)
                                                       and dims[-1][0][0] == dims[-1][0][1])


def _read_padded_rows(flat, dims, strides, offset):
    """The box of a view whose innermost dim is padded and has stride 1 (attention scores
    ``[b, h, t, t]``): one window of the padded width per row, read past the row's true end (the
    next row's elements land in the pad and are masked out). ``flat`` is extended by one row of
    zeros so that no window is clamped back into the true data. Element by element, the same read
    costs a gather with index arithmetic per element: ~2x the time on XLA:CPU."""
    true, width = dims[-1][0]
    ext = jnp.concatenate([flat, jnp.zeros((width,), flat.dtype)])
    starts, valid = _box_index(dims[:-1], strides[:-1], offset, ext.shape[0])
    starts = jnp.clip(starts, 0, flat.shape[0])
    rows = lax.gather(ext, starts.reshape(-1, 1),
                      lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)),
                      slice_sizes=(width,), mode=lax.GatherScatterMode.CLIP)
    rows = rows.reshape(*starts.shape, width)
    ok = lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1) < _as(true, jnp.int32)
    if valid is not None:
        ok = ok & valid[..., None]
    return jnp.where(ok, rows, jnp.zeros((), flat.dtype))


# Unsigned integers of each width: a row-wise write with overlapping windows adds bit patterns,
# exact for every value (-0.0 and NaN payloads included), where adding floats would not be.
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _write_padded_rows(box, dims, strides):
    """``box_write`` of a row-major result whose innermost dim is padded: each row moves as one
    window of the padded width to its true start. Neighbouring windows overlap (a row's pad covers
    the next row's start), so the pad is zeroed and the windows are *added* as bit patterns into
    zeros: every position receives its true value from one window and zeros from the others. The
    buffer is one row longer while writing, so no window is dropped or clamped."""
    true, width = dims[-1][0]
    capacity = int(np.prod(box.shape))
    dtype = box.dtype
    bits = box.astype(jnp.uint8) if dtype == jnp.bool_ else lax.bitcast_convert_type(box, _BITS[dtype.itemsize])
    ok = lax.broadcasted_iota(jnp.int32, box.shape, box.ndim - 1) < _as(true, jnp.int32)
    bits = jnp.where(ok, bits, jnp.zeros((), bits.dtype))
    starts, valid = _box_index(dims[:-1], strides[:-1], 0, capacity + width)
    if valid is not None:
        starts = jnp.where(valid, starts, capacity + width)    # out of range: dropped
    out = lax.scatter_add(jnp.zeros((capacity + width,), bits.dtype), starts.reshape(-1, 1),
                          bits.reshape(-1, width),
                          lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                                      scatter_dims_to_operand_dims=(0,)),
                          mode=lax.GatherScatterMode.FILL_OR_DROP)[:capacity]
    return out.astype(jnp.bool_) if dtype == jnp.bool_ else lax.bitcast_convert_type(out, dtype)


def box_scatter(flat, box, dims, strides, offset):
    """``flat`` with the view (``strides``, ``offset``) set to the exact region of ``box`` (an
    in-place op's new value); the rest of the buffer (other views of the storage) is kept."""
    idx, valid = _box_index(dims, strides, offset, flat.shape[0])
    if valid is not None:
        idx = jnp.where(valid, idx, flat.shape[0])     # out of range: dropped
    return flat.at[idx.reshape(-1)].set(box.reshape(-1).astype(flat.dtype), mode="drop")


def box_write(box, dims, sizes, strides, contiguous: bool = False):
    """A flat buffer of the box's size holding the true tensor of the padded ``box`` laid out with
    ``sizes`` and dense ``strides`` (traced or static), zeros after its last element. With
    ``contiguous`` (the layout is row-major, known from the graph) the trailing dims that are not
    padded move as whole rows, and only the rows' positions are computed.

    The box is scattered to its destinations (coordinates times strides: multiplications only), its
    pad dropped. Gathering each destination's source instead needs a division and a modulo by a
    runtime size per element, which XLA:CPU does not vectorise: 3-4x the time of the scatter for an
    attention score tensor."""
    capacity = int(np.prod(box.shape))
    k = static_tail(dims) if contiguous else 0
    if k == len(dims):                 # nothing padded: the box is the tensor
        return box.reshape(-1)
    if contiguous and k == 0 and _padded_innermost(dims) and box.dtype.itemsize in _BITS \
            and not jnp.issubdtype(box.dtype, jnp.complexfloating):
        return _write_padded_rows(box, dims, strides)
    inner = int(np.prod(box.shape[len(dims) - k:], dtype=np.int64)) if k else 1
    if contiguous:
        # Row-major strides of the leading dims, counted in rows of ``inner`` elements.
        lead_sizes = list(sizes[:len(dims) - k])
        row_strides, acc = [], 1
        for size in reversed(lead_sizes):
            row_strides.append(acc)
            acc = acc * size
        dims, strides = dims[:len(dims) - k], row_strides[::-1]
    rows = capacity // inner
    dst, valid = _box_index(dims, strides, 0, rows)
    if valid is not None:
        dst = jnp.where(valid, dst, rows)     # out of range: dropped
    updates = box.reshape(rows, inner) if inner > 1 else box.reshape(-1)
    out = jnp.zeros(updates.shape, box.dtype)
    return out.at[dst.reshape(-1)].set(updates, mode="drop").reshape(-1)


def _as(v, itype):
    return v if isinstance(v, int) else jnp.asarray(v).astype(itype)
