"""Buffer donation: an executable that writes a storage reuses that storage's buffer.

A device buffer is immutable, so an op that writes a storage (``x.add_(1)``, ``x[i] = v``, an
optimizer step, a graph's mutated input) returns the storage's new buffer. Without donation XLA
allocates that result beside the old buffer and copies every element it does not change: an
in-place loop holds two copies of the storage at its peak, and writing one row of a KV cache costs
a copy of the whole cache. Executables therefore donate the input buffers of the storages they
write (``jax.jit(..., donate_argnums=...)``): XLA writes the result where the input was, and the
old ``jax.Array`` is deleted by the call.

Donation is only safe for a buffer nothing else refers to. A storage record owns its buffer, but
buffers are immutable values and are shared where that saves work: the zero buffer every
never-written storage of one size starts with (``memory._zeros``), a NumPy view of a buffer being
read back, a buffer another storage got from a whole-storage copy, one an adaptive-eager region
holds. So before each call ``make_private`` checks the written slots' Python reference counts (the
record, the call's buffer list, and the count's own argument) and gives a shared buffer's slot a
private copy on the device: the call then costs what it cost without donation (one buffer-sized
copy), and nobody else's buffer is deleted. A NumPy view that holds the buffer below Python's
reach makes PJRT copy instead of donating (it never deletes a buffer with external references).
"""

from __future__ import annotations

import sys

import jax
import jax.extend.core

from ..metrics import metrics
from . import memory, pjrt

_refcount = sys.getrefcount
# References of a buffer only its storage owns, as seen from make_private: the record's ``buf``,
# the call's buffer list, and getrefcount's argument.
_OWNED = 3


def make_private(bufs: list, slots, device_index, owned: int = _OWNED) -> None:
    """Give every slot in ``slots`` (the storages a call writes) a buffer that only its storage
    refers to, so that the call may donate it (``owned``: the references of such a buffer)."""
    for slot in slots:
        if _refcount(bufs[slot]) > owned:
            bufs[slot] = private_copy(bufs[slot], device_index)


def keep_inputs(exe, bufs, device_index) -> list:
    """``bufs`` for a call of ``exe`` whose caller keeps using the buffers it passes (adaptive eager
    running recorded ops one by one on its own table of buffers): the donated slots get copies."""
    if not exe.donated:
        return bufs
    bufs = list(bufs)
    for slot in exe.donated:
        bufs[slot] = private_copy(bufs[slot], device_index)
    return bufs


def private_copy(buf, device_index):
    """A copy of ``buf`` on its device (no host round trip, nothing compiled)."""
    metrics.extra["donation_copies"] += 1
    zeros = memory.private_zeros(buf, device_index or 0)   # torch.empty(...) then an in-place op
    if zeros is not None:
        return zeros
    return jax.device_put(buf, pjrt.device(device_index or 0), may_alias=False)


def argnums(writes) -> tuple:
    """``donate_argnums`` of an executable whose inputs start with its storage buffers in slot
    order (``runtime/inputs.py``): the slots it writes."""
    return tuple(sorted(set(writes)))


def donated_slots(compiled) -> tuple:
    """The buffer slots a loaded executable donates (stored entries keep their donation)."""
    try:
        leaves = jax.tree.leaves(compiled.args_info)
    except AttributeError:   # not a jax Compiled: assume nothing is donated
        return ()
    return tuple(i for i, a in enumerate(leaves) if getattr(a, "donated", False))


def lower(fn, args, writes_of):
    """``fn`` traced once on ``args`` and lowered with the buffers it writes donated:
    ``writes_of(fn)`` (known only once it was traced) names their slots. The second lowering
    starts from the traced program (jaxpr), so the function itself is not run twice."""
    traced = jax.jit(fn).trace(*args)
    donate = argnums(writes_of(fn))
    if not donate:
        return traced.lower()
    body = jax.extend.core.jaxpr_as_fun(traced.jaxpr)

    def program(*flat):
        return tuple(body(*flat))

    # The module's name is part of JAX's compilation-cache key: the traced function's.
    program.__name__ = getattr(fn, "__name__", "program")
    return jax.jit(program, donate_argnums=donate).lower(*args)


def shapes_of(args) -> list:
    """Abstract stand-ins for a call's arguments, to lower its executable again after the call
    donated some of them (a donated ``jax.Array`` is deleted)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
            if isinstance(a, jax.Array) else a for a in args]
