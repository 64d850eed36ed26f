"""The ``torch.neuron`` device module: devices, streams of work, RNG and memory statistics."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..config import config
from . import deferred, fork, memory_api, pjrt, rng
from . import memory as _storage

_state = threading.local()

# Read by torch.utils.checkpoint (and so by every HF gradient_checkpointing_enable()): it saves and
# restores the RNG state only of device modules that say they are initialised, and a recompute
# without it draws different dropout masks. Like is_initialized(): the device needs no lazy init.
_initialized = True


def is_available() -> bool:
    try:
        return len(pjrt.devices()) > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return not fork.in_bad_fork()


def _lazy_init() -> None:
    if fork.in_bad_fork():
        raise fork.fork_error("initializing the device")
    pjrt.devices()


def _is_in_bad_fork() -> bool:
    # torch.manual_seed skips the device's generators in such a child (DataLoader workers).
    return fork.in_bad_fork()


def device_count() -> int:
    return pjrt.device_count()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "neuron":
            raise ValueError(f"torchneuron: expected a neuron device, got {device}")
        index = current_device() if device.index is None else device.index
    pjrt.device(index)
    return index


def current_device() -> int:
    return getattr(_state, "index", 0)


class DeviceMismatch(RuntimeError):
    """A tensor argument on another device than the op's; ``tensor`` is that argument (an op's
    kernel adds its name and the argument's, ``ops.devices.mismatch_error``)."""

    def __init__(self, message: str, tensor: torch.Tensor, device_index: int):
        super().__init__(message)
        self.tensor = tensor
        self.device_index = device_index


def device_mismatch_error(other: torch.Tensor, device_index: int) -> RuntimeError:
    # Same text as PyTorch's CUDA check, so users recognise it.
    return DeviceMismatch(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"neuron:{device_index} and {other.device}!", other, device_index)


def set_device(device) -> None:
    _state.index = _index(device)


class device:  # noqa: N801 - mirrors torch.cuda.device
    """Context manager that makes ``device`` the current neuron device."""

    def __init__(self, device):
        self.index = _index(device) if device is not None else None
        self.prev = None

    def __enter__(self):
        self.prev = current_device()
        if self.index is not None:
            _state.index = self.index

    def __exit__(self, *exc):
        _state.index = self.prev
        return False


def synchronize(device=None) -> None:
    """Wait until every pending computation on neuron buffers has finished."""
    _storage.flush_pending("synchronize")
    _storage.allocator.collect()
    for rec in list(_storage.allocator.records.values()):
        buf = rec.buf
        if buf is not None:
            buf.block_until_ready()
    deferred.raise_pending()


fork.forbid(sys.modules[__name__], "synchronize", "synchronize")


def get_device_name(device=None) -> str:
    dev = pjrt.device(_index(device))
    return f"neuron ({dev.platform}: {dev.device_kind})"


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    device_kind: str
    index: int
    total_memory: int
    platform_version: str


def get_device_properties(device=None) -> DeviceProperties:
    index = _index(device)
    dev = pjrt.device(index)
    return DeviceProperties(get_device_name(index), dev.platform, dev.device_kind, index,
                            pjrt.total_memory(index), pjrt.platform_version())


# -- RNG ------------------------------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    rng.generator(current_device()).manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    for i in range(max(device_count(), 1)):
        rng.generator(i).manual_seed(seed)


def seed() -> None:
    rng.generator(current_device()).manual_seed(rng.fresh_seed())


def seed_all() -> None:
    manual_seed_all(rng.fresh_seed())


def initial_seed() -> int:
    return rng.generator(current_device()).initial


def get_rng_state(device="neuron") -> torch.Tensor:
    return rng.generator(_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
    rng.generator(_index(device)).set_state(new_state)


def __getattr__(name):
    # torch.neuron.default_generators, like torch.cuda.default_generators (made on first use).
    if name == "default_generators":
        value = globals()[name] = rng.default_generators()
        return value
    raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, s in enumerate(states):
        set_rng_state(s, i)


# -- memory ---------------------------------------------------------------------------------------
# torch.neuron.memory is the public memory module (torch.cuda.memory's functions); its statistics
# functions are also torch.neuron's, as torch.cuda's are.
memory = memory_api
from .memory_api import (  # noqa: E402, F401 - re-exported as torch.neuron.<name>
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)


@contextlib.contextmanager
def _noop():
    yield


# -- streams and events ---------------------------------------------------------------------------
# Each device runs its work as one ordered queue (JAX dispatch keeps data dependencies), so every
# stream is that queue and cross-stream waits are already satisfied. These exist so stream-aware
# code written for CUDA (FSDP2, DDP, torch.accelerator users) runs unchanged.
class Stream(torch.Stream):
    """A neuron stream: ``torch.neuron.Stream(priority=-1)`` like ``torch.cuda.Stream``."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=torch.device("neuron", _index(device)), priority=priority)

    def synchronize(self) -> None:
        synchronize(self.device_index)


class Event(torch.Event):
    """A neuron event; ``synchronize`` waits for the device and timing events measure wall time."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                device=None):
        return super().__new__(cls, device=torch.device("neuron", _index(device)),
                               enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 device=None):
        self._timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        super().record(stream)
        if self._timing:
            synchronize()
            self._time = time.perf_counter()

    def synchronize(self) -> None:
        synchronize()

    def elapsed_time(self, end_event: Event) -> float:
        if not (self._timing and end_event._timing) or self._time is None or end_event._time is None:
            raise RuntimeError("torchneuron: elapsed_time needs two recorded events created with "
                               "torch.neuron.Event(enable_timing=True)")
        return (end_event._time - self._time) * 1000.0


def current_stream(device=None) -> Stream:
    return Stream(device)


def default_stream(device=None) -> Stream:
    return Stream(device)


def set_stream(stream) -> None:
    """Streams are one queue per device, so there is nothing to switch."""


def stream(stream):
    """``with torch.neuron.stream(s):`` — a no-op context, as every stream is the device's queue."""
    return _noop()


# -- torch.accelerator ------------------------------------------------------------------------------
# torch.accelerator's synchronize and memory functions end in C++ hooks a Python backend cannot
# provide: the device guard's synchronizeDevice (only the guard's type is overridable; PyTorch's
# default raises "Backend doesn't support synchronizing all streams on device" once the accelerator
# is initialised) and a CachingDeviceAllocator (an INTERNAL ASSERT). With neuron the current
# accelerator they are this module's functions; other accelerators keep PyTorch's.
def _get_memory_info(device=None):
    return mem_get_info(device)


# torch.accelerator's name -> the neuron function it runs.
_ACCELERATOR_FUNCTIONS = {name: name for name in (
    "synchronize", "empty_cache", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats")} | {"get_memory_info": "_get_memory_info"}


def _accelerator_function(theirs, ours):
    @functools.wraps(theirs)
    def routed(*args):
        acc = torch.accelerator.current_accelerator()
        if acc is None or acc.type != "neuron":
            return theirs(*args)
        for device in args:   # a device index / device / string, as torch.accelerator takes it
            if isinstance(device, (str, torch.device)) and torch.device(device).type != "neuron":
                raise ValueError(f"{torch.device(device).type} doesn't match the current accelerator {acc}.")
        return ours(*(_index(device) for device in args))

    return routed


def install_accelerator_functions() -> None:
    import torch.accelerator.memory as accelerator_memory
    for name, ours in _ACCELERATOR_FUNCTIONS.items():
        routed = _accelerator_function(getattr(torch.accelerator, name), globals()[ours])
        setattr(torch.accelerator, name, routed)
        if hasattr(accelerator_memory, name):
            setattr(accelerator_memory, name, routed)


# -- autocast and dtype capabilities -------------------------------------------------------------
def get_amp_supported_dtype() -> list:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts (the lowerings run both natively)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    # Asked by transformers/accelerate (bf16 mixed precision) as torch.cuda.is_bf16_supported is.
    return True


# -- storage resizing (FSDP2 frees and re-allocates unsharded parameters this way) ----------------
# PyTorch routes UntypedStorage.resize_ on PrivateUse1 to a C++ hook that a Python backend cannot
# implement, so neuron storages are handled here and every other storage keeps PyTorch's method.
_storage_resize = torch.UntypedStorage.resize_


def _resize_storage(storage, size):
    if storage.device.type != "neuron":
        return _storage_resize(storage, size)
    rec = _storage.allocator.records.get(storage.data_ptr())
    nbytes = storage.nbytes()
    if rec is None or size not in (0, nbytes):
        raise RuntimeError(
            f"torchneuron: UntypedStorage.resize_({size}) on a neuron storage of {nbytes} bytes: only "
            "freeing (resize_(0)) and re-allocating to the original size are supported. Use "
            "Tensor.resize_() or allocate a new tensor to change a tensor's size.")
    if size == 0:
        # The device buffer goes now; the storage keeps its nominal size, and its next use starts
        # from a fresh buffer (as after resize_ on CUDA, the old contents are gone).
        rec.buf = None
    return storage


def install_storage_resize() -> None:
    torch.UntypedStorage.resize_ = _resize_storage


def platform() -> str:
    return config.platform
