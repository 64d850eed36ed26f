"""Python values as device arrays that executables take as runtime inputs.

Scalars (a learning rate, ``x * 0.5``) and view offsets (``x[i]``) are inputs of an executable, not
part of it, so a new value compiles nothing. Converting a Python number at every call is what jit
dispatch would otherwise do (~15-60 us); these arrays are made once per value and reused.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from . import pjrt

# Device arrays cached by value: jit dispatch converts a Python number on every call, while an
# existing array goes straight through. One table per Python type (6, 6.0 and True are equal keys).
_scalar_arrays = {bool: {}, int: {}, float: {}, complex: {}}
_negative_zero: dict = {}
_CACHED_VALUES = 4096


def scalar_array(v):
    """A Python scalar as a (weakly typed) device array."""
    table = _scalar_arrays.get(v.__class__)
    if table is None:
        return _weak_scalar(v)
    arr = table.get(v)
    if arr is not None and (v or v.__class__ is not float or math.copysign(1.0, v) > 0):
        return arr
    return _new_scalar_array(v, table)


def _new_scalar_array(v, table):
    if v.__class__ is float and v == 0.0 and math.copysign(1.0, v) < 0:
        table = _negative_zero   # -0.0 == 0.0 as a key, but x / -0.0 is -inf
        arr = table.get(v)
        if arr is not None:
            return arr
    if v != v:   # NaN never hits a dict
        return _weak_scalar(v)
    if len(table) >= _CACHED_VALUES:
        # Bounded, oldest value out first (dicts keep insertion order): a training loop brings new
        # values every step (an optimizer's bias corrections, each used once per parameter), and
        # a cache that stopped taking values once full would put every one of them on the device
        # again for each parameter from then on.
        del table[next(iter(table))]
    arr = table[v] = _weak_scalar(v)
    return arr


# What jnp.asarray makes of each Python scalar type (x64 mode): (numpy dtype, weakly typed).
_SCALAR_TYPES = {bool: (np.bool_, False), int: (np.int64, True), float: (np.float64, True),
                 complex: (np.complex128, True)}


def _weak_scalar(v):
    """``jnp.asarray(v)`` in a quarter of the time: a new runtime scalar per step (an optimizer's
    bias corrections) would otherwise cost ~60 us each."""
    kind = _SCALAR_TYPES.get(v.__class__)
    if kind is None:
        return jnp.asarray(v)
    try:
        host = np.asarray(v, dtype=kind[0])
    except OverflowError:
        return jnp.asarray(v)   # raises JAX's own error for an int beyond int64
    return pjrt.put(host, 0, weak=kind[1], committed=False)


_offset_arrays: dict = {}
_CACHED_OFFSETS = 1 << 16


def offset_array(offset: int):
    """A view's storage offset as a runtime input (int64 device scalar, cached by value)."""
    arr = _offset_arrays.get(offset)
    if arr is None:
        arr = pjrt.put(np.asarray(offset, dtype=np.int64), 0, committed=False)
        if len(_offset_arrays) >= _CACHED_OFFSETS:
            del _offset_arrays[next(iter(_offset_arrays))]   # oldest out, as for scalars
        _offset_arrays[offset] = arr
    return arr
