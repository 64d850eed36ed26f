"""Device checks: conditions a lowering cannot decide while it is traced.

Whether an index is in range or an integer divisor is zero depends on tensor values, which exist
only when the executable runs. A lowering states such a condition with :func:`fail_if`; the code
tracing it (an eager executable, an adaptive-eager region, a torch.compile graph) collects the
conditions with :func:`collecting` and returns them as one extra int64 output, three entries per
check: 1 if it failed, the offending value and its position. The caller reads that output at the next
synchronisation point and raises PyTorch's error (``eager/checks.py``). Outside a collecting
trace (shape inference, checks turned off) :func:`fail_if` does nothing, so lowerings stay plain
JAX functions.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

_tls = threading.local()


class DeviceZeroDivisionError(RuntimeError, ZeroDivisionError):
    """CPU PyTorch raises a RuntimeError whose message is "ZeroDivisionError": this is both."""


@dataclass(frozen=True)
class Check:
    """What a failed check raises: ``error(message.format(value=..., position=...))`` with the
    first offending value and its (flat) position."""

    error: type
    message: str


def fail_if(bad, value, error: type, message: str) -> None:
    """Record that the op fails when the traced bool array ``bad`` has a True element; ``value``
    (an int array of the same shape, or None) holds what the message reports of the first one."""
    sink = getattr(_tls, "sink", None)
    if sink is None:
        return
    bad = jnp.asarray(bad).reshape(-1)
    if not bad.size:
        return
    found = jnp.any(bad)
    flat = jnp.asarray(value).reshape(-1).astype(jnp.int64) if value is not None else None

    def first(_):   # where the first failure is: an argmax, paid only when something failed
        at = jnp.argmax(bad)
        return jnp.stack([flat[at] if flat is not None else jnp.zeros((), jnp.int64), at.astype(jnp.int64)])

    shown = lax.cond(found, first, lambda _: jnp.zeros(2, jnp.int64), None)
    sink.append((found, shown[0], shown[1], Check(error, message)))


@contextlib.contextmanager
def collecting():
    """Collect the checks of the lowerings traced inside the block: yields a list of
    (failed, value, position, Check) entries (traced values)."""
    previous = getattr(_tls, "sink", None)
    sink: list = []
    _tls.sink = sink
    try:
        yield sink
    finally:
        _tls.sink = previous


@contextlib.contextmanager
def suspended():
    """No collection inside the block (checks turned off; shape inference): yields None."""
    previous = getattr(_tls, "sink", None)
    _tls.sink = None
    try:
        yield None
    finally:
        _tls.sink = previous


def pack(entries):
    """The collected checks as one int64 output: [failed_0, value_0, position_0, failed_1, ...]."""
    flat = []
    for found, value, position, _ in entries:
        flat.extend((found.astype(jnp.int64), value, position))
    return jnp.stack(flat)


# -- the checks lowerings state -------------------------------------------------------------------
def out_of_bounds(dim: int, size: int) -> str:
    return f"index {{value}} is out of bounds for dimension {dim} with size {size}"


def index_in_range(index, size: int, message: str, error: type = IndexError, negative: bool = True) -> None:
    """PyTorch's bound check of an index tensor into a dimension of ``size``: ``-size <= index <
    size`` where negative indices count from the end (``negative``), else ``0 <= index < size``."""
    index = jnp.asarray(index)
    fail_if((index < (-size if negative else 0)) | (index >= size), index, error, message)


def nonzero_divisor(divisor) -> None:
    """Integer division (``//``, ``%``, ``fmod``, ``div(rounding_mode=...)``) by zero."""
    divisor = jnp.asarray(divisor)
    if jnp.issubdtype(divisor.dtype, jnp.integer) or divisor.dtype == jnp.bool_:
        fail_if(divisor == 0, None, DeviceZeroDivisionError, "ZeroDivisionError")
