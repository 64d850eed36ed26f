"""Device memory: real PyTorch storages backed by PJRT buffers.

A neuron tensor is a plain ``torch.Tensor`` whose storage comes from a DLPack capsule with
``device_type = kDLExtDev``: PyTorch sees a storage of the right size on ``neuron:<i>`` whose
data pointer is a unique handle we choose (never dereferenced). The handle keys a table of
``StorageRecord``s holding the storage's contents as one flat ``jax.Array``; views share the
storage and therefore the record. A weakref on the storage's Python object (which PyTorch keeps
alive exactly as long as the storage) fires when PyTorch frees the storage, which is what makes
``memory_allocated()`` exact.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import struct
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..metrics import metrics
from . import fork, pjrt
from .dtypes import jax_dtype

_KDL_EXT_DEV = 12
# DLPack type codes: int, uint, float, bfloat, complex, bool.
_DL_CODES = {
    torch.bool: (6, 8), torch.uint8: (1, 8), torch.int8: (0, 8), torch.int16: (0, 16),
    torch.int32: (0, 32), torch.int64: (0, 64), torch.float16: (2, 16), torch.bfloat16: (4, 16),
    torch.float32: (2, 32), torch.float64: (2, 64), torch.complex64: (5, 64),
    torch.complex128: (5, 128), torch.uint16: (1, 16), torch.uint32: (1, 32), torch.uint64: (1, 64),
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.c_void_p)]

# DLManagedTensor as packed bytes: data, device (type, id), ndim, dtype (code, bits, lanes),
# shape*, strides*, byte_offset, manager_ctx, deleter — 64 bytes on 64-bit platforms.
_HEADER_FMT = "=QiiiBBHQQQQQ"
_HEADER = struct.calcsize(_HEADER_FMT)
assert _HEADER == ctypes.sizeof(_DLManagedTensor) == 64

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class StorageRecord:
    """What the allocator knows about one storage: its flat buffer and its size."""

    __slots__ = ("buf", "nbytes", "dtype", "numel", "device_index", "boxed", "__weakref__")

    def __init__(self, nbytes: int, dtype: torch.dtype, device_index: int, buf=None):
        self.nbytes = nbytes
        self.dtype = dtype               # element type of ``buf``
        self.numel = nbytes // dtype.itemsize
        self.device_index = device_index
        self.buf = buf                   # flat jax.Array of ``numel`` elements, or None (never written)
        # The buffer's size is a shape bucket's capacity (config.shapes="bucketed"), not the exact
        # size of the tensors on it: bucketed executables read it without a per-shape copy.
        self.boxed = False


class _StorageWatch(weakref.ref):
    """A weakref on a neuron storage's Python object that carries the storage's address (one object
    per storage: no closure, no tuple)."""

    __slots__ = ("addr",)


# DLPack headers are written into a per-thread scratch buffer that is never freed. PyTorch copies
# the sizes and strides when it imports a capsule, and afterwards reads only the header's deleter
# field, when the storage dies: that field is always 0 (no deleter) in every header written here, so
# reusing the scratch for the next tensor is safe. Thread-local, because importing a capsule can run
# Python code (the device guard) where another thread may take over; never freed, because a storage
# may outlive the thread that made it.
_HDR = struct.Struct(_HEADER_FMT)
_scratch_tls = threading.local()
_scratches: list = []
_MAX_DIMS = 64


def _scratch():
    """(ctypes buffer, its address) of this thread's header scratch: a header, then room for
    ``_MAX_DIMS`` sizes and strides."""
    scratch = getattr(_scratch_tls, "buf", None)
    if scratch is None:
        raw = ctypes.create_string_buffer(_HEADER + 16 * _MAX_DIMS)
        _scratches.append(raw)
        scratch = _scratch_tls.buf = (raw, ctypes.addressof(raw))
    return scratch


_dims_structs: dict = {}


def _dims_struct(nd: int) -> struct.Struct:
    st = _dims_structs.get(nd)
    if st is None:
        st = _dims_structs[nd] = struct.Struct(f"={2 * nd}q")
    return st


class OutputLayout:
    """A dense layout whose tensors an executable makes again and again: its DLPack fields are
    worked out once (sizes and strides live in an array of their own, which the header points at)."""

    __slots__ = ("dtype", "sizes", "strides", "nbytes", "nd", "code", "bits", "dims", "dims_ptr")

    def __init__(self, dtype: torch.dtype, sizes, strides):
        self.dtype = dtype
        self.sizes, self.strides = tuple(sizes), tuple(strides)
        extent = 0 if any(s == 0 for s in sizes) else 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
        self.nbytes = extent * dtype.itemsize
        self.nd = len(self.sizes)
        self.code, self.bits = _DL_CODES[dtype]
        self.dims = (ctypes.c_int64 * max(2 * self.nd, 1))(*self.sizes, *self.strides)
        self.dims_ptr = ctypes.addressof(self.dims)


_layouts: dict = {}


def output_layout(dtype: torch.dtype, sizes, strides) -> OutputLayout:
    """The shared ``OutputLayout`` of a dense layout."""
    key = (dtype, tuple(sizes), tuple(strides))
    found = _layouts.get(key)
    if found is None:
        if len(_layouts) > 4096:
            _layouts.clear()
        found = _layouts[key] = OutputLayout(dtype, sizes, strides)
    return found


INT64_MAX = (1 << 63) - 1


def layout_nbytes(sizes, strides, itemsize: int) -> int:
    """Bytes a storage needs for this layout, with PyTorch's checks and messages
    (``computeStorageNbytes``): a size beyond int64, or a negative stride reaching before the
    storage's start, is a RuntimeError here instead of an abort inside DLPack's import."""
    extent, empty, negative = 1, False, False
    for s, st in zip(sizes, strides):
        if st > INT64_MAX:
            raise RuntimeError("Stride calculation overflowed")
        if s > 1:
            if st < 0:   # c10 computes in uint64: a negative stride wraps around and overflows
                negative = True
            else:
                extent += (s - 1) * st
        elif s < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {s}: {list(sizes)}")
        elif s == 0:
            empty = True
    if empty:
        return 0
    nbytes = extent * itemsize
    if negative or nbytes > INT64_MAX:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(sizes)} and "
                           f"strides={list(strides)}")
    return nbytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _span(nbytes: int) -> int:
    """The handle range a storage of ``nbytes`` takes: at least one byte more, 64-byte aligned."""
    return (nbytes + 64) & ~63


LARGE_POOL = 1 << 20   # storages over this many bytes count in torch.cuda's large pool, others in its small


class _Allocator:
    # Handles live far above any user-space address so they never collide with CPU pointers. Each
    # storage's range is at least one byte longer than the storage, so a view's data_ptr() (at most
    # one past its storage's last byte) never equals another storage's handle: a data_ptr() found
    # in ``records`` is the start of the tensor's own storage (storage offset 0). All handles stay
    # below 2**63 (PyTorch keeps pointers signed in places).
    _BASE = 1 << 60
    _LIMIT = 1 << 63

    def __init__(self):
        self.records: dict[int, StorageRecord] = {}
        self._watches: dict[int, _StorageWatch] = {}   # storage address -> its watch
        self._next = self._BASE
        self._end = self._LIMIT   # the next live handle above _next (the space's end at first)
        # Watches of storages PyTorch freed, not accounted for yet (see collect()).
        self._freed = collections.deque()
        # Re-entrant: collect() runs inside allocations that hold it.
        self._lock = threading.RLock()
        self.allocated = {}   # device index -> bytes
        self.peak = {}
        self.num_allocs = 0
        self.num_frees = 0
        self.freed_bytes = {}   # device index -> bytes freed since start
        self.freed_count = {}   # device index -> storages freed since start
        # The same per (device index, pool): pool True for torch.cuda's large pool (storages over
        # 1 MiB), False for its small one (memory_api's *.small_pool.* / *.large_pool.* keys).
        self.pool_bytes = {}
        self.pool_peak = {}
        self.pool_freed_bytes = {}
        self.pool_freed_count = {}

    def collect(self) -> None:
        """Account for the storages PyTorch freed since the last call: drop their buffers and their
        bytes from the statistics. Runs before every allocation and statistics read.

        A storage's watch only queues itself when it fires (a C-level append): a Python callback
        would be where a pending Ctrl-C gets raised and, as callbacks cannot raise, lost -- with
        the free left half done (clearing a list of tensors used to drop the interrupt and leak a
        storage's bytes in the counters)."""
        freed = self._freed
        with self._lock:   # frees race with allocations in other threads
            while freed:
                watch = freed[0]
                record = self.records.get(watch.addr)
                if record is not None:
                    # No calls up to the popleft: an interrupt (raised at calls and loops only)
                    # cannot leave a half-done free; one raised after the popleft finds it done.
                    del self.records[watch.addr]
                    del self._watches[watch.addr]
                    index = record.device_index
                    self.allocated[index] -= record.nbytes
                    self.freed_bytes[index] = self.freed_bytes.get(index, 0) + record.nbytes
                    self.freed_count[index] = self.freed_count.get(index, 0) + 1
                    pool = (index, record.nbytes > LARGE_POOL)
                    self.pool_bytes[pool] -= record.nbytes
                    self.pool_freed_bytes[pool] = self.pool_freed_bytes.get(pool, 0) + record.nbytes
                    self.pool_freed_count[pool] = self.pool_freed_count.get(pool, 0) + 1
                    self.num_frees += 1
                    record.buf = None
                    if history is not None:
                        history.free(watch.addr, record.nbytes, index)
                freed.popleft()

    def _register(self, nbytes: int, dtype: torch.dtype, device_index: int, buf) -> int:
        """A fresh handle for a storage of ``nbytes``, counted in the statistics."""
        record = StorageRecord(nbytes, dtype, device_index, buf)
        span = (nbytes + 64) & ~63   # _span, inline: the per-op hot path
        with self._lock:
            if self._freed:
                self.collect()
            addr = self._next
            if addr + span > self._end:
                addr, self._end = self._find_gap(span)
            self._next = addr + span
            self.num_allocs += 1
            used = self.allocated.get(device_index, 0) + nbytes
            self.allocated[device_index] = used
            if used > self.peak.get(device_index, 0):
                self.peak[device_index] = used
            pool = (device_index, nbytes > LARGE_POOL)
            used = self.pool_bytes.get(pool, 0) + nbytes
            self.pool_bytes[pool] = used
            if used > self.pool_peak.get(pool, 0):
                self.pool_peak[pool] = used
            self.records[addr] = record
        if history is not None:
            history.alloc(addr, nbytes, device_index)
        return addr

    def _watch(self, tensor: torch.Tensor, addr: int) -> torch.Tensor:
        # No DLPack deleter (PyTorch accepts none): a ctypes callback into Python that runs while an
        # exception propagates (a temporary freed during unwinding) turns that exception into a
        # SystemError. PyTorch keeps a storage's Python object alive exactly as long as the storage,
        # and weakref callbacks leave a pending exception intact, so a weakref watches it instead;
        # it only queues itself (see collect()).
        watch = _StorageWatch(tensor.untyped_storage(), self._freed.append)
        watch.addr = addr
        self._watches[addr] = watch
        return tensor

    def new_output(self, out: OutputLayout, buf, device_index: int, capacity: int = 0) -> torch.Tensor:
        """A neuron tensor with a precomputed dense layout on a fresh storage holding ``buf``
        (the per-op hot path: an executable's new outputs). ``capacity``: the bytes of a bucketed
        result's buffer (its bucket's, more than the layout's), counted and keyed by the storage's
        record; PyTorch's own storage size stays the layout's, as on CPU."""
        addr = self._register(capacity or out.nbytes, out.dtype, device_index, buf)
        if capacity:
            self.records[addr].boxed = True
        raw, base = _scratch()
        _HDR.pack_into(raw, 0, addr, _KDL_EXT_DEV, device_index, out.nd, out.code, out.bits, 1,
                       out.dims_ptr, out.dims_ptr + 8 * out.nd, 0, 0, 0)
        return self._watch(_from_dlpack(_capsule_new(base, b"dltensor", None)), addr)

    def _find_gap(self, span: int):
        """A free handle range of ``span`` bytes and the next live handle above it (the caller holds
        the lock). Handles are handed out in increasing order up to the next live storage (the end
        of the space at first); once the space is used up, the gaps freed storages left are reused."""
        self.collect()
        live = sorted((a, _span(r.nbytes)) for a, r in list(self.records.items()))
        for addr in (self._next, self._BASE):
            for start, used in live:
                if start + used <= addr:
                    continue
                if start - addr >= span:
                    return addr, start
                addr = max(addr, start + used)
            if self._LIMIT - addr >= span:
                return addr, self._LIMIT
        raise RuntimeError(
            f"torchneuron: no free storage handle range for {span} bytes: the live neuron storages "
            "cover the handle space. Free tensors you no longer need.")

    def new_tensor(self, sizes, strides, dtype: torch.dtype, device_index: int, buf=None,
                   storage_nbytes: int | None = None) -> torch.Tensor:
        """A neuron tensor with the given layout on a fresh storage holding ``buf``."""
        extent_bytes = layout_nbytes(sizes, strides, dtype.itemsize)
        if storage_nbytes is None:
            storage_nbytes = extent_bytes
        if storage_nbytes > pjrt.total_memory(device_index):
            _out_of_memory(device_index, storage_nbytes)
            raise torch.OutOfMemoryError(
                f"torchneuron: out of memory: tried to allocate {_gib(storage_nbytes)} "
                f"({storage_nbytes} bytes) on neuron:{device_index}, whose total capacity is "
                f"{_gib(pjrt.total_memory(device_index))}; {_gib(self.allocated.get(device_index, 0))} "
                "are allocated by live tensors.")
        code, bits = _DL_CODES[dtype]
        # DLPack sizes the storage from the layout; a storage larger than the layout needs is
        # made flat and then viewed with the requested layout.
        flat = storage_nbytes != extent_bytes
        dl_sizes = (storage_nbytes // dtype.itemsize,) if flat else tuple(sizes)
        dl_strides = (1,) if flat else tuple(strides)
        nd = len(dl_sizes)
        if nd > _MAX_DIMS:
            raise RuntimeError(f"torchneuron: tensors have at most {_MAX_DIMS} dimensions, got {nd}")
        addr = self._register(storage_nbytes, dtype, device_index, buf)
        raw, base = _scratch()
        _HDR.pack_into(raw, 0, addr, _KDL_EXT_DEV, device_index, nd, code, bits, 1, base + _HEADER,
                       base + _HEADER + 8 * nd, 0, 0, 0)
        _dims_struct(nd).pack_into(raw, _HEADER, *dl_sizes, *dl_strides)
        tensor = self._watch(_from_dlpack(_capsule_new(base, b"dltensor", None)), addr)
        if flat:
            tensor = _AS_STRIDED(_CPU_KEYS, tensor, list(sizes), list(strides), 0)
        return tensor


# The memory-history recorder of torch.neuron.memory._record_memory_history() (memory_api._History),
# or None: the allocator reports each allocation and free to it only while it is set.
history = None
num_ooms: dict = {}   # device index -> out-of-memory errors raised


def _out_of_memory(device_index: int, nbytes: int) -> None:
    num_ooms[device_index] = num_ooms.get(device_index, 0) + 1
    # Imported here: memory_api imports this module.
    from .memory_api import _on_oom
    _on_oom(device_index, nbytes)


def raise_if_out_of_memory(err: Exception, device_index) -> None:
    """Raise ``torch.OutOfMemoryError`` (counted, snapshot written, as for the allocator's own) for
    an error of a call on the device that is PJRT's allocator running out (``RESOURCE_EXHAUSTED``):
    code that catches a CUDA OOM to retry with a smaller batch catches this one too. Any other
    error: return, for the caller to re-raise it."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text:
        return
    index = device_index or 0
    stats = pjrt.memory_stats(index)
    _out_of_memory(index, 0)
    in_use = (f"; the platform's allocator has {_gib(int(stats['bytes_in_use']))} in use of "
              f"{_gib(int(stats['bytes_limit']))}" if "bytes_in_use" in stats and "bytes_limit" in stats else "")
    raise torch.OutOfMemoryError(
        f"torchneuron: out of memory on neuron:{index}: {text.splitlines()[0]}. "
        f"{_gib(allocator.allocated.get(index, 0))} are allocated by live tensors{in_use}. Free tensors "
        "you no longer need, use a smaller batch, or on a GPU give the allocator a larger share of the "
        "device (TORCHNEURON_GPU_MEMORY_FRACTION; TORCHNEURON_GPU_PREALLOCATE=0 grows it on demand).") from err


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_from_dlpack = torch._C._from_dlpack
_AS_STRIDED = torch.ops.aten.as_strided.default.redispatch


allocator = _Allocator()
fork.forbid(allocator, "new_tensor", "allocating a neuron tensor")
fork.forbid(allocator, "new_output", "allocating a neuron tensor")


def storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def record_of(t: torch.Tensor) -> StorageRecord:
    """The allocator record behind a neuron tensor, or a clear error if there is none."""
    ptr = t.untyped_storage().data_ptr()
    rec = allocator.records.get(ptr)
    if rec is None:
        if t.device.type != "neuron":
            raise RuntimeError(f"torchneuron: expected a neuron tensor, got one on {t.device}")
        inside = next((a for a, r in list(allocator.records.items()) if a < ptr < a + max(r.nbytes, 1)), None)
        if inside is not None:
            # UntypedStorage.__getitem__ with a slice makes a storage that starts inside another.
            raise RuntimeError(
                f"torchneuron: this neuron tensor (shape {tuple(t.shape)}, {t.dtype}) lives on a slice of "
                f"another storage (UntypedStorage[start:stop], starting at byte {ptr - inside}), which "
                "neuron does not support. Index the tensor instead, or copy the storage to CPU "
                "(storage.cpu()) before slicing it.")
        raise RuntimeError(
            f"torchneuron: the storage of this neuron tensor (shape {tuple(t.shape)}, {t.dtype}) has "
            "been freed or resized to zero bytes; it can no longer be read. Keep a reference to the "
            "tensor that owns the data, or re-create it."
        )
    return rec


class _Pending:
    """Marks a storage whose buffer a pending adaptive-eager region will produce."""

    def __repr__(self):
        return "<pending adaptive-eager buffer>"


PENDING = _Pending()


def _nothing_pending(reason: str) -> None:
    pass


# Runs pending deferred work (adaptive eager's recorded region) so that PENDING buffers become real
# and later reads/writes see it; ``reason`` is counted. Replaced by eager/adaptive.py on import.
flush_pending = _nothing_pending
# Waits for adaptive eager's fused run in flight, if any (a host read reports the device checks of
# all the work issued before it). Replaced by eager/adaptive.py on import.
wait_in_flight = _nothing_pending


class Unavailable:
    """Marks a storage whose buffer was never computed: the adaptive-eager region producing it
    raised (the error reached the user where the region ran)."""

    def __init__(self, error: str):
        self.error = error

    def __repr__(self):
        return f"<buffer never computed: {self.error}>"


def empty_buffer(rec: StorageRecord):
    """The storage's buffer for a host-side reader: zeros if nobody wrote it yet, and the result of
    the pending adaptive-eager region if one is producing it."""
    if rec.buf is PENDING:
        flush_pending("host read")
    if rec.buf.__class__ is Unavailable:
        raise RuntimeError(f"torchneuron: this tensor's values were never computed, because the ops "
                           f"producing them failed earlier ({rec.buf.error}). Recompute it.")
    if rec.buf is None:
        rec.buf = _zeros(rec.numel, rec.dtype, rec.device_index)
    return rec.buf


_shared_zeros: dict = {}
_SHARED_ZEROS_BYTES = 1 << 20


def _zeros(numel: int, dtype: torch.dtype, device_index: int):
    """A zero buffer. Small ones are shared by every storage of that size that nobody wrote yet
    (``torch.empty`` then ``fill_``/``copy_``/``uniform_``): device buffers are immutable, an op
    makes a new buffer for what it writes, so sharing is safe and saves a host->device copy each."""
    nbytes = numel * dtype.itemsize
    if nbytes > DEVICE_ZEROS_BYTES:
        metrics.extra["device_zero_fills"] += 1
        return _device_zeros(numel, dtype, device_index)()
    if nbytes > _SHARED_ZEROS_BYTES:
        return jax_put(np.zeros(numel, dtype=jax_dtype(dtype)), device_index)
    key = (numel, dtype, device_index)
    buf = _shared_zeros.get(key)
    if buf is None:
        if len(_shared_zeros) >= 256:
            _shared_zeros.clear()
            _shared_zero_ids.clear()
        buf = _shared_zeros[key] = jax_put(np.zeros(numel, dtype=jax_dtype(dtype)), device_index)
        _shared_zero_ids.add(id(buf))
    return buf


_shared_zero_ids: set = set()

# Above this size (bytes) a never-written storage's zeros are made on its device by a small program
# compiled per size (~0.1 s), not uploaded: torch.empty(...).normal_() and FSDP2's to_empty() on
# large parameters would otherwise push every byte over PCIe, and host memory would hold a copy.
DEVICE_ZEROS_BYTES = 16 << 20


@functools.lru_cache(maxsize=256)
def _device_zeros(numel: int, dtype: torch.dtype, device_index: int):
    sharding = jax.sharding.SingleDeviceSharding(pjrt.device(device_index))
    return jax.jit(lambda: jnp.zeros((numel,), dtype=jax_dtype(dtype)), out_shardings=sharding)


def private_zeros(buf, device_index: int):
    """A zero buffer of its own for a storage about to be written whose buffer is a shared zero
    one (a small upload: cheaper than a copy on the device), else None."""
    if id(buf) not in _shared_zero_ids:
        return None
    return jax_put(np.zeros(buf.shape, dtype=buf.dtype), device_index)


def pjrt_device(device_index: int):
    return pjrt.device(device_index)


def jax_put(array, device_index: int):
    # Never alias host memory: on the CPU platform PJRT could otherwise share the numpy buffer,
    # and a later in-place write to the source CPU tensor would show up on the device.
    if array.nbytes <= SMALL_PUT_LIMIT and _small_put is not None:
        try:
            return _small_put(array, device_index)
        except (TypeError, AttributeError):   # another jaxlib's signature: the public path from now on
            _disable_small_put()
    return jax.device_put(array, pjrt.device(device_index), may_alias=False)


# Host arrays up to this size (bytes) are copied to the device by PJRT during the call, through
# jaxlib's batched put: jax.device_put's Python layers cost ~130 us an array, this ~40 us (a
# prompt's token ids, a bucketed graph's true sizes). Larger ones go through device_put, whose copy
# may complete after the call (callers hand it a private array).
SMALL_PUT_LIMIT = 1 << 20


def _make_small_put():
    try:
        from jax._src import core as jax_core
        from jax._src.lib import xla_client
        batched_put = xla_client.batched_device_put
        during_call = xla_client.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
    except (ImportError, AttributeError):
        return None
    shardings = {}

    def put(array, device_index):
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous):
            array = np.ascontiguousarray(array)
        sharding = shardings.get(device_index)
        if sharding is None:
            sharding = shardings[device_index] = jax.sharding.SingleDeviceSharding(pjrt.device(device_index))
        dev = sharding._device
        return batched_put(jax_core.ShapedArray(array.shape, array.dtype), sharding, [array], [dev],
                           True, False, during_call)

    return put


_small_put = _make_small_put()


def _disable_small_put():
    global _small_put
    _small_put = None


def new_buffer_tensor(buf, dtype: torch.dtype, device_index: int, sizes=None, strides=None) -> torch.Tensor:
    """Wrap a flat jax buffer as a contiguous neuron tensor (or with the given layout)."""
    if sizes is None:
        sizes = (int(buf.shape[0]),)
    if strides is None:
        strides = contiguous_strides(sizes)
    nbytes = int(buf.shape[0]) * dtype.itemsize
    out = output_layout(dtype, sizes, strides)
    if out.nbytes == nbytes:
        return allocator.new_output(out, buf, device_index)
    return allocator.new_tensor(tuple(sizes), tuple(strides), dtype, device_index, buf=buf, storage_nbytes=nbytes)


def new_boxed_tensor(buf, dtype: torch.dtype, device_index: int, sizes, strides) -> torch.Tensor:
    """A neuron tensor with the given layout at the start of ``buf``, a bucketed executable's result
    whose size is its shape bucket's capacity (``StorageRecord.boxed``)."""
    return allocator.new_output(output_layout(dtype, sizes, strides), buf, device_index,
                                capacity=int(buf.shape[0]) * dtype.itemsize)


def box_capacity(numel: int) -> int:
    """The capacity a storage of ``numel`` elements is given when a bucketed executable needs it
    with a bucket's capacity: the next power of two (at least 16)."""
    cap = 16
    while cap < numel:
        cap *= 2
    return cap


# Up to this size (bytes) a storage a bucketed executable reads is given its capacity through the
# host (no program to compile); a larger one through a small program compiled per size.
RECAPACITY_HOST_LIMIT = 16 << 20


def recapacity(rec: StorageRecord, box: int) -> str:
    """Give the storage of ``rec`` the capacity of a padded box of ``box`` elements (a power of two
    if it holds more; its data unchanged, zeros after it), so executables keyed by buffer sizes
    see a bounded set of sizes. Returns how: "unwritten", "host" or "device"."""
    cap = box if box >= rec.numel else box_capacity(rec.numel)
    if rec.buf is None or rec.buf is _shared_zeros.get((rec.numel, rec.dtype, rec.device_index)):
        # Never written (torch.empty): its zeros are made at the new size.
        rec.buf, rec.numel, rec.boxed = None, cap, True
        return "unwritten"
    buf = rec.buf
    extra = cap - int(buf.shape[0])
    if rec.nbytes <= RECAPACITY_HOST_LIMIT:
        host = np.asarray(buf)
        rec.buf = jax_put(np.concatenate([host, np.zeros(extra, dtype=host.dtype)]), rec.device_index)
        how = "host"
    else:
        rec.buf = _grow(int(buf.shape[0]), cap, buf.dtype)(buf)
        how = "device"
    rec.numel = cap
    rec.boxed = True
    return how


@functools.lru_cache(maxsize=256)
def _grow(numel, cap, dtype):
    return jax.jit(lambda b: jnp.pad(b, (0, cap - numel)))


def contiguous_strides(sizes) -> tuple:
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def zeros_like_buffer(numel: int, dtype: torch.dtype):
    return jnp.zeros((numel,), dtype=jax_dtype(dtype))


fork.forbid(sys.modules[__name__], "jax_put", "copying to a neuron device")
