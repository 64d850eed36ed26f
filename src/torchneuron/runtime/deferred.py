"""Errors the device finds while it runs, raised where the program next waits for the device.

Some of PyTorch's checks depend on tensor values: an index out of range, an integer division by
zero. Their values exist only on the device, after the op was dispatched, so an executable that
contains such checks (see ``ops/checks.py``) returns their outcome as a small int64 array. With
``config.device_checks = "deferred"`` (the default) that array is kept here with the op and the
user's call site, and read when the program synchronises anyway — a read back to the host
(``.cpu()``, ``.item()``, ``print``), ``torch.neuron.synchronize()`` — as CUDA reports device-side
errors: eager execution stays asynchronous, and the error names the op and the line that called
it. ``"sync"`` reads each outcome right after its op (the traceback points at the op itself; every
checked op then waits for the device), ``"off"`` compiles no checks.
"""

from __future__ import annotations

import collections

import numpy as np

from . import sites

# (outcome array, ((check, op name), ...), call site) of executed work not read yet, oldest first.
_pending: collections.deque = collections.deque()
# Past this many unread outcomes the oldest half is read: memory stays bounded in a program that
# never synchronises, and those ops have long finished.
_LIMIT = 1024


def defer(outcome, checks, site) -> None:
    """Keep the outcome of checked work (``checks``: (check, op name) per entry of the outcome;
    ``site``: ``sites.place`` of its caller) until the next synchronisation point."""
    _pending.append((outcome, checks, site))
    if len(_pending) > _LIMIT:
        raise_pending(len(_pending) // 2)


def check_now(outcome, checks) -> None:
    """``device_checks="sync"``: read the outcome at once and raise in the op's own call."""
    error = _first_error(np.asarray(outcome), checks)
    if error is not None:
        kind, message, op = error
        raise kind(f"{message}\n[torchneuron] in {op}")


def raise_pending(count: int | None = None) -> None:
    """Read the outcomes of the ``count`` oldest checked ops (all by default) and raise the first
    error among them, in program order. After an error the other outcomes are dropped: the values
    those ops computed may derive from the failed one."""
    if not _pending:
        return
    n = len(_pending) if count is None else min(count, len(_pending))
    entries = [_pending.popleft() for _ in range(n)]
    if n > 1:
        # Start every outcome's copy to the host before reading the first: the program waits for
        # the device once, not once per checked op (a GPU read is a synchronisation each).
        for outcome, _, _ in entries:
            start_copy = getattr(outcome, "copy_to_host_async", None)
            if start_copy is not None:
                start_copy()
    for outcome, checks, site in entries:
        # np.asarray reads each small array directly (jax.device_get on the list spends ~50 us per
        # array in tree handling on the CPU platform).
        error = _first_error(np.asarray(outcome), checks)
        if error is not None:
            _pending.clear()
            kind, message, op = error
            raise kind(
                f"{message}\n[torchneuron] raised by {op} called at {sites.format_place(site)}. "
                "The device checked it and it is reported at the next synchronisation point "
                "(TORCHNEURON_DEVICE_CHECKS=sync reports it at the op itself; =off skips these checks).")


def pending() -> int:
    return len(_pending)


def clear() -> None:
    _pending.clear()


def _first_error(outcome, checks):
    """(exception type, message, op) of the first failed check in an outcome array, or None."""
    values = outcome.tolist()   # Python ints: indexing numpy scalars costs more than the read
    for k, (check, op) in enumerate(checks):
        if values[3 * k]:
            return check.error, check.message.format(value=values[3 * k + 1], position=values[3 * k + 2]), op
    return None
