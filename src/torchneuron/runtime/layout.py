"""Strided views inside compiled code.

A neuron storage is one flat buffer; a tensor is (sizes, strides, offset) over it. These pure
functions turn a buffer into a tensor's logical array (read) and put a logical array back into
the buffer (write). They run at trace time, so sizes and strides are static and each case compiles
to the cheapest XLA form: slice+reshape, transpose, broadcast, padded strided slice, or a
gather/scatter. The offset is either a Python int (compiled in) or a traced integer scalar (a
runtime input: one executable serves ``x[i]`` for every ``i``); PyTorch guarantees every element
of a view lies inside its storage, which is what lets a dynamic slice start anywhere without
clamping.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax


def is_contiguous(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def reinterpret(buf, dtype):
    """The flat buffer viewed as elements of ``dtype`` (``Tensor.view(dtype)`` semantics)."""
    src = buf.dtype
    dtype = np.dtype(dtype)
    if src == dtype:
        return buf
    if src == np.bool_:
        buf, src = buf.astype(jnp.uint8), np.dtype(np.uint8)
    if jnp.issubdtype(src, jnp.complexfloating):
        buf = jnp.stack([buf.real, buf.imag], axis=-1).reshape(-1)
        src = buf.dtype
        if src == dtype:
            return buf
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = np.dtype(np.float32 if dtype == np.complex64 else np.float64)
        pairs = reinterpret(buf, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if dtype == np.bool_:
        return reinterpret(buf, np.uint8) != 0
    if src.itemsize == dtype.itemsize:
        return lax.bitcast_convert_type(buf, dtype)
    if src.itemsize > dtype.itemsize:
        return lax.bitcast_convert_type(buf, dtype).reshape(-1)
    ratio = dtype.itemsize // src.itemsize
    usable = (buf.shape[0] // ratio) * ratio
    return lax.bitcast_convert_type(buf[:usable].reshape(-1, ratio), dtype)


def _gather_indices(sizes, strides, offset):
    """Flat buffer index of every element of the view (a constant plus a traced offset)."""
    idx = np.zeros(tuple(sizes), dtype=np.int64)
    for dim, (size, stride) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[dim] = size
        idx = idx + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    if isinstance(offset, int):
        return idx + offset
    return idx + offset.astype(np.int64)


def extent(sizes, strides) -> int:
    """Elements from a view's first to its last element, both included (views without elements: 0)."""
    if any(s == 0 for s in sizes):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(sizes, strides))


def _slice(flat, offset, length):
    """``flat[offset:offset + length]`` for a static or traced ``offset``."""
    if isinstance(offset, int):
        return lax.slice(flat, (offset,), (offset + length,))
    return lax.dynamic_slice(flat, (offset,), (length,))


def read(buf, dtype, sizes, strides, offset):
    """The logical array of the view (sizes, strides, offset) of flat ``buf``."""
    sizes, strides = tuple(sizes), tuple(strides)
    flat = reinterpret(buf, dtype)
    numel = math.prod(sizes)
    if numel == 0:
        return jnp.zeros(sizes, dtype=flat.dtype)
    if is_contiguous(sizes, strides):
        if numel == flat.shape[0]:   # a dense view of the whole storage starts at 0
            return flat.reshape(sizes)
        return _slice(flat, offset, numel).reshape(sizes)
    # Broadcast (stride 0) and size-1 dims cost nothing: read the rest, then expand.
    kept = [d for d in range(len(sizes)) if sizes[d] != 1 and strides[d] != 0]
    order = sorted(kept, key=lambda d: -strides[d])
    core_sizes = [sizes[d] for d in order]
    core_strides = [strides[d] for d in order]
    core = _read_core(flat, core_sizes, core_strides, offset)
    # core is indexed in `order`; put it back in dim order, then broadcast.
    inverse = [order.index(d) for d in kept]
    core = jnp.transpose(core, inverse) if inverse != list(range(len(kept))) else core
    shaped = core.reshape([sizes[d] if d in kept else 1 for d in range(len(sizes))])
    return jnp.broadcast_to(shaped, sizes)


def _read_core(flat, sizes, strides, offset):
    """Dims already sorted by decreasing stride, none of size 1 or stride 0."""
    if not sizes:
        return _slice(flat, offset, 1).reshape(())
    if is_contiguous(sizes, strides):
        return _slice(flat, offset, math.prod(sizes)).reshape(sizes)
    nested = all(strides[i] % strides[i + 1] == 0 and sizes[i + 1] * strides[i + 1] <= strides[i]
                 for i in range(len(sizes) - 1))
    if nested:
        # Cut the region into a dense block whose dims are the stride ratios, then slice it. The
        # block runs past the view's last element by a fixed amount: pad by that much (a static
        # offset needs padding only where the block passes the buffer's end).
        length = sizes[0] * strides[0]
        if isinstance(offset, int):
            pad = max(0, offset + length - flat.shape[0])
        else:
            pad = length - extent(sizes, strides)
        if pad:
            flat = jnp.pad(flat, (0, pad))
        block_shape = [sizes[0]] + [strides[i] // strides[i + 1] for i in range(len(sizes) - 1)] + [strides[-1]]
        block = _slice(flat, offset, length).reshape(block_shape)
        limits = list(sizes) + [1]
        return lax.slice(block, [0] * len(block_shape), limits).reshape(sizes)
    return flat[_gather_indices(sizes, strides, offset)]


def write(buf, value, dtype, sizes, strides, offset):
    """``buf`` with the view (sizes, strides, offset) replaced by ``value`` (already shaped)."""
    sizes, strides = tuple(sizes), tuple(strides)
    numel = math.prod(sizes)
    if numel == 0:
        return buf
    target_dtype = np.dtype(dtype)
    value = value.astype(target_dtype)
    if buf.dtype != target_dtype:
        # Writing through a view(dtype): do it in the view's element type, then convert back.
        typed = reinterpret(buf, target_dtype)
        updated = write(typed, value, target_dtype, sizes, strides, offset)
        return reinterpret(updated, buf.dtype)[: buf.shape[0]]
    if is_contiguous(sizes, strides):
        if numel == buf.shape[0]:   # a dense view of the whole storage starts at 0
            return value.reshape(-1)
        return lax.dynamic_update_slice(buf, value.reshape(-1), (offset,))
    kept = [d for d in range(len(sizes)) if sizes[d] != 1]
    if all(strides[d] != 0 for d in kept):
        order = sorted(kept, key=lambda d: -strides[d])
        core_sizes = [sizes[d] for d in order]
        core_strides = [strides[d] for d in order]
        if is_contiguous(core_sizes, core_strides):
            # A permuted dense block (e.g. x.t()): transpose into memory order, write a slice.
            squeezed = value.reshape([sizes[d] for d in kept])
            in_memory = jnp.transpose(squeezed, [kept.index(d) for d in order])
            return lax.dynamic_update_slice(buf, in_memory.reshape(-1), (offset,))
    idx = _gather_indices(sizes, strides, offset).reshape(-1)
    return buf.at[idx].set(value.reshape(-1))


def to_layout(value, sizes, strides):
    """Flatten a logical array into a fresh buffer laid out with the given (dense) strides."""
    sizes, strides = tuple(sizes), tuple(strides)
    if is_contiguous(sizes, strides):
        return value.reshape(-1)
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d]))
    return jnp.transpose(value, order).reshape(-1)


def is_dense(sizes, strides) -> bool:
    """True when the strides describe a permutation of a contiguous layout (no gaps, no overlap)."""
    dims = [d for d in range(len(sizes)) if sizes[d] != 1]
    order = sorted(dims, key=lambda d: -strides[d])
    return is_contiguous([sizes[d] for d in order], [strides[d] for d in order])
