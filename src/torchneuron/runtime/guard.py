"""The neuron device guard that autograd's engine calls, and the errors it must not lose.

PyTorch's Python-backend guard (``torch._C._acc.DeviceGuard``) answers every device and stream
question by calling our ``type_`` method. Autograd's engine holds a stream guard around each
backward node it evaluates; when an op inside that node raises from a ``__torch_dispatch__`` (a
tensor subclass such as DTensor, a dispatch mode, FakeTensor while AOTAutograd traces a joint
graph), PyTorch unwinds with the Python error still pending, the guard's destructor calls
``type_``, the call fails because of that pending error, and the failure inside a destructor ends
the process (``std::terminate``: "terminate called without an active exception").

``device_type`` therefore takes a pending error off the thread before answering, and keeps it; the
engine then reports a ``SystemError`` ("returned NULL without setting an exception"), which
``run_backward`` below replaces with the error the op raised. Everything else is unchanged."""

from __future__ import annotations

import ctypes
import threading

import torch

PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1

# ctypes checks the thread's error indicator after a Python-API call and raises what is pending;
# PyErr_Occurred itself changes nothing, so the call is a probe that surfaces a pending error.
_probe = ctypes.pythonapi.PyErr_Occurred
_probe.restype = ctypes.c_void_p

_lost: list[BaseException] = []
_lock = threading.Lock()
_LOST_MARK = "without setting an exception"


def device_type():
    """The guard's ``type_``: PrivateUse1, with any pending Python error kept for run_backward."""
    try:
        _probe()
    except BaseException as err:   # the error an op raised inside a backward node
        with _lock:
            _lost.append(err)
            del _lost[:-8]
    return PRIVATE_USE1


def _take_lost() -> BaseException | None:
    with _lock:
        err = _lost[-1] if _lost else None
        _lost.clear()
    return err


class _Engine:
    """Autograd's engine as ``torch.autograd`` reaches it, with the error of a backward op restored
    where the guard had to take it."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        try:
            return self._engine.run_backward(*args, **kwargs)
        except SystemError as err:
            lost = _take_lost() if _LOST_MARK in str(err) else None
            if lost is None:
                raise
        raise lost   # outside the handler: the SystemError is no part of the story

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install() -> None:
    from torch.autograd.variable import Variable
    if not isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = _Engine(Variable._execution_engine)
