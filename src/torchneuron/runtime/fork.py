"""What a process forked after the neuron runtime started may do: nothing on the device.

The PJRT client's threads do not survive ``fork()``: a child that runs a cached executable may
work, one that compiles hangs forever, and one that exits normally crashes while tearing the
client down. So, as CUDA does ("Cannot re-initialize CUDA in forked subprocess"), a child forked
after the runtime started raises a clear error at its first device operation, and keeps the
parent's runtime objects alive so that its exit does not touch them. A child forked before the
runtime started (nothing ran on the device yet) starts its own runtime as usual.

Entry points register themselves with :func:`forbid`: in the child their attribute is swapped for
one that raises, so the parent's hot paths pay nothing.
"""

from __future__ import annotations

import ctypes
import os

_bad = False
_forbidden: list = []   # (owner, attribute name, what the entry point does)
_kept: list = []


def in_bad_fork() -> bool:
    """True in a process forked after its parent started the neuron runtime."""
    return _bad


def fork_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"torchneuron: Cannot re-initialize the neuron device in forked subprocess ({what}). This "
        "process was forked after its parent started the neuron runtime, whose PJRT client does not "
        "survive fork(). To use neuron tensors with multiprocessing, you must use the 'spawn' start "
        "method: multiprocessing.set_start_method('spawn'), or "
        "DataLoader(..., multiprocessing_context='spawn'); or keep worker code on CPU tensors.")


def forbid(owner, name: str, what) -> None:
    """Make ``owner.name`` raise :func:`fork_error` in a bad-fork child. ``what`` says what the
    entry point does: a string, or a function of its first argument (a kernel names its op)."""
    _forbidden.append((owner, name, what))
    if _bad:   # a module first imported in the child
        setattr(owner, name, _refusal(what))


def _refusal(what):
    def refuse(*args, **kwargs):
        raise fork_error(what(args[0]) if callable(what) else what)
    return refuse


def runtime_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):   # pragma: no cover - jax internals moved
        return True


def _keep_alive() -> None:
    """Leak the parent's JAX client, arrays and executables in the child: destroying them without
    the client's threads crashes the interpreter at exit."""
    from jax._src import xla_bridge
    for backend in list(xla_bridge._backends.values()):
        objects = [backend, *backend.live_arrays(), *backend.live_executables()]
        for obj in objects:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        _kept.append(len(objects))


def _after_fork_in_child() -> None:
    global _bad
    if _bad or not runtime_started():
        return
    _bad = True
    try:
        _keep_alive()
    except Exception:   # pragma: no cover - best effort: the error below still protects the child
        pass
    for owner, name, what in _forbidden:
        setattr(owner, name, _refusal(what))


os.register_at_fork(after_in_child=_after_fork_in_child)
