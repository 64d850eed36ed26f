"""Host <-> device copies and reading device values back to the host (counted in the metrics).

The dispatcher kernels built on these (``copy_``, ``_to_copy``, ``.item()``) live in
``eager.storage_ops``.
"""

from __future__ import annotations

import functools
import sys
import weakref

import jax
import ml_dtypes
import numpy as np
import torch

from ..metrics import metrics
from . import deferred, fork, layout, memory
from .dtypes import jax_dtype


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's contents as a numpy array (bfloat16 through ml_dtypes)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.numpy()
    return t.numpy()


def torch_from_host(a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:
        a = np.array(a)   # arrays read back from PJRT are read-only views
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).reshape(a.shape)).view(torch.bfloat16)
    # ascontiguousarray turns 0-d arrays into 1-d ones: keep the shape.
    return torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape))


@functools.lru_cache(maxsize=4096)
def _reader(buf_shape, buf_dtype, dtype, sizes, strides):
    # The storage offset is a runtime input: copying x[i] (or x[i, j]) to the host in a loop reuses
    # one executable instead of compiling one per element (~50 ms each).
    return jax.jit(lambda buf, offset: layout.read(buf, dtype, sizes, strides, offset))


def device_array(t: torch.Tensor, host: bool = False):
    """The logical contents of a neuron tensor as a jax.Array (no host copy), or with ``host`` as a
    NumPy array (a tensor covering its whole buffer is then reshaped on the host: no device op)."""
    if t.numel() == 0:
        return jax.numpy.zeros(tuple(t.shape), dtype=jax_dtype(t.dtype))
    rec = memory.record_of(t)
    buf = memory.empty_buffer(rec)
    sizes, strides, offset = tuple(t.shape), t.stride(), t.storage_offset()
    dtype = np.dtype(jax_dtype(t.dtype))
    if offset == 0 and buf.dtype == dtype and layout.is_contiguous(sizes, strides) \
            and buf.shape[0] == t.numel():
        return np.asarray(buf).reshape(sizes) if host else buf.reshape(sizes)
    return _reader(buf.shape, buf.dtype, dtype, sizes, tuple(strides))(buf, np.int64(offset))


def _report_checks() -> None:
    """The program waits for the device at a host read: report what the device checks of all work
    issued before it found (an adaptive-eager run in flight included)."""
    memory.wait_in_flight("host read")
    deferred.raise_pending()


def to_host(t: torch.Tensor) -> np.ndarray:
    """A neuron tensor's values on the host (one counted device->host copy, traced by the profiler)."""
    tracer = metrics.tracer
    if tracer is not None:   # profiler ranges / readiness report: see torchneuron.profiler
        return tracer.copy("d2h", copy_to_host, t)
    return copy_to_host(t)


def copy_to_host(t: torch.Tensor) -> np.ndarray:
    """``to_host`` without a profiler range (for callers that record their own)."""
    arr = np.asarray(device_array(t, host=True))
    _report_checks()
    metrics.d2h_copies += 1
    metrics.d2h_bytes += arr.nbytes
    return arr


# ``.item()`` in a loop (``for v in t``, ``x[i].item()``, ``all(mask)``) reads many elements of one
# device buffer. Buffers are immutable (a write gives its storage a new one), so the second read of
# the same buffer copies all of it to the host once and later reads index that copy (~6 us per
# element instead of ~17 us for a device read). The copy owns its memory (it keeps no device buffer
# alive) and only buffers up to this size (bytes) are copied; larger ones are read element by element.
HOST_COPY_LIMIT = 4 << 20


class _LastRead:
    __slots__ = ("buffer", "host")

    def __init__(self):
        self.buffer = None   # weak reference to the buffer read last
        self.host = None     # its host copy, once a second read asked for it


_last_read = _LastRead()


def read_element(t: torch.Tensor):
    """The value of a one-element neuron tensor (``_local_scalar_dense``) as a NumPy scalar."""
    rec = memory.record_of(t)
    buf = memory.empty_buffer(rec)
    last = _last_read
    same = last.buffer is not None and last.buffer() is buf
    if same and last.host is not None:
        _report_checks()
        return last.host[t.storage_offset()]
    if same and buf.ndim == 1 and buf.dtype == np.dtype(jax_dtype(t.dtype)) and buf.nbytes <= HOST_COPY_LIMIT:
        tracer = metrics.tracer
        last.host = tracer.copy("d2h", _copy_buffer, buf) if tracer is not None else _copy_buffer(buf)
        return last.host[t.storage_offset()]
    try:
        last.buffer, last.host = weakref.ref(buf), None
    except TypeError:   # a buffer type without weak references: no reuse
        last.buffer, last.host = None, None
    return to_host(t).reshape(())[()]


def _copy_buffer(buf) -> np.ndarray:
    host = np.array(buf, copy=True)   # owns its memory: the device buffer may be freed
    _report_checks()
    metrics.d2h_copies += 1
    metrics.d2h_bytes += host.nbytes
    return host


def upload(host: np.ndarray, device_index: int):
    tracer = metrics.tracer
    if tracer is not None:
        return tracer.copy("h2d", _upload, host, device_index)
    return _upload(host, device_index)


def _upload(host: np.ndarray, device_index: int):
    metrics.h2d_copies += 1
    metrics.h2d_bytes += host.nbytes
    if host.nbytes <= memory.SMALL_PUT_LIMIT:   # copied during the call: no private copy needed
        return memory.jax_put(host, device_index)
    # The transfer may complete asynchronously: hand PJRT a private copy so that later writes to
    # the caller's CPU tensor cannot race with it.
    return memory.jax_put(np.array(host, copy=True), device_index)


# Every read and upload of device memory goes through these (see runtime/fork.py).
for _name, _what in (("device_array", "reading a neuron tensor"), ("copy_to_host", "reading a neuron tensor"),
                     ("_upload", "copying to a neuron device")):
    fork.forbid(sys.modules[__name__], _name, _what)
