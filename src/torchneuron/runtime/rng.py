"""Per-device random number generators, and ``torch.Generator(device="neuron")``.

Each neuron device has a (seed, offset) pair. A random op receives both as runtime inputs and
derives its JAX key from them inside the executable, so reseeding never recompiles; the offset
advances on every random op, so successive calls differ and ``manual_seed`` replays a stream.

``torch.Generator(device="neuron")`` gives a ``NeuronGenerator``: its own (seed, offset) pair, used
by random ops that receive it as ``generator=`` (the Diffusers idiom
``pipe(..., generator=torch.Generator(device).manual_seed(0))``). PyTorch creates device generators
only through a C++ hook that a Python backend cannot register, so ``torch.Generator`` becomes a
thin class that builds a ``NeuronGenerator`` for neuron devices and the usual C generator otherwise
(``isinstance(g, torch.Generator)`` holds for both). A ``NeuronGenerator`` is a C generator object
too (the dispatcher accepts it as a ``Generator`` argument); kernels recognise it by its C handle.
"""

from __future__ import annotations

import random
import threading
import weakref

import torch

from . import pjrt

_DEFAULT_SEED = 67280421310721


class DeviceGenerator:
    def __init__(self, device_index: int):
        self.device_index = device_index
        self.seed = _DEFAULT_SEED
        self.initial = _DEFAULT_SEED
        self.offset = 0
        self._lock = threading.Lock()

    def manual_seed(self, seed: int) -> None:
        self.seed = self.initial = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.offset = 0

    def next_key_inputs(self) -> tuple[int, int]:
        with self._lock:
            offset = self.offset
            self.offset += 1
        # JAX takes the seed as int64: fold the 64-bit seed into that range.
        seed = self.seed - (1 << 64) if self.seed >= (1 << 63) else self.seed
        return seed, offset

    def get_state(self) -> torch.Tensor:
        """A CPU ByteTensor (like CUDA's): 8 bytes of seed, then 8 bytes of offset, little-endian."""
        raw = self.seed.to_bytes(8, "little") + self.offset.to_bytes(8, "little")
        return torch.tensor(list(raw), dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> None:
        raw = bytes(state.to(torch.uint8).tolist())
        if len(raw) != 16:
            raise ValueError("torchneuron: expected a 16-byte RNG state from torch.neuron.get_rng_state()")
        self.seed = int.from_bytes(raw[:8], "little")
        self.offset = int.from_bytes(raw[8:], "little")


_generators: dict[int, DeviceGenerator] = {}


def generator(device_index: int) -> DeviceGenerator:
    gen = _generators.get(device_index)
    if gen is None:
        gen = _generators[device_index] = DeviceGenerator(device_index)
    return gen


def fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 63)


# C generator handle (``Generator._cdata``) -> the DeviceGenerator of a live NeuronGenerator.
_by_handle: dict[int, DeviceGenerator] = {}
_CGenerator = torch._C.Generator


class NeuronGenerator(_CGenerator):
    """A random generator for the neuron device, as ``torch.Generator(device="neuron")`` returns.

    Its state is a (seed, offset) pair like the device's default generator; ``get_state`` gives the
    16-byte state ``torch.neuron.get_rng_state`` uses. The C object underneath is a CPU generator
    (a Python backend cannot create a generator of its own device type) that ``manual_seed`` seeds
    too: host-side draws with it -- Diffusers' ``randn_tensor`` draws on the host for neuron devices
    -- give the numbers ``torch.Generator().manual_seed(seed)`` would, where CUDA would refuse a
    device generator on a CPU op.
    """

    def __new__(cls, device="neuron", _state: DeviceGenerator | None = None):
        device = torch.device(device)
        if device.type != "neuron":
            raise ValueError(f"torchneuron: NeuronGenerator needs a neuron device, got {device}")
        self = super().__new__(cls, "cpu")
        index = device.index if device.index is not None else torch.neuron.current_device()
        self._device = torch.device("neuron", index)
        self._state = _state if _state is not None else DeviceGenerator(index)
        handle = self._cdata
        _by_handle[handle] = self._state
        weakref.finalize(self, _by_handle.pop, handle, None)
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def manual_seed(self, seed) -> NeuronGenerator:
        seed = int(seed)
        self._state.manual_seed(seed)
        super().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        return self

    def seed(self) -> int:
        seed = fresh_seed()
        self.manual_seed(seed)
        return seed

    def initial_seed(self) -> int:
        return self._state.initial

    def get_state(self) -> torch.Tensor:
        return self._state.get_state()

    def set_state(self, new_state: torch.Tensor) -> NeuronGenerator:
        self._state.set_state(new_state)
        return self

    def get_offset(self) -> int:
        return self._state.offset

    def set_offset(self, offset: int) -> NeuronGenerator:
        self._state.offset = int(offset)
        return self

    def clone_state(self) -> NeuronGenerator:
        twin = NeuronGenerator(self._device)
        twin._state.set_state(self.get_state())
        twin._state.initial = self._state.initial
        return twin

    def graphsafe_get_state(self) -> NeuronGenerator:
        return self.clone_state()

    def graphsafe_set_state(self, state: NeuronGenerator) -> NeuronGenerator:
        return self.set_state(state.get_state())

    def __reduce__(self):
        return (_rebuild, (str(self._device), self.get_state(), self._state.initial))

    def __deepcopy__(self, memo):
        return self.clone_state()

    def __repr__(self) -> str:
        return f"<torch.Generator object on {self._device} (torchneuron)>"


def _rebuild(device, state, initial):
    gen = NeuronGenerator(device)
    gen.set_state(state)
    gen._state.initial = initial
    return gen


def state_of(gen, device_index: int) -> DeviceGenerator:
    """The (seed, offset) state a random op on neuron:``device_index`` draws from."""
    if gen is None:
        return generator(device_index)
    state = _by_handle.get(gen._cdata)
    if state is None:
        # PyTorch's own check for a generator of another device (at::check_generator).
        raise RuntimeError(f"Expected a 'neuron' device type for generator but found '{gen.device.type}'")
    return state


class _GeneratorType(type(_CGenerator)):
    # isinstance(g, torch.Generator) keeps holding for every C generator (CPU ones, torch's defaults).
    def __instancecheck__(cls, obj):
        return isinstance(obj, _CGenerator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _CGenerator)


class Generator(_CGenerator, metaclass=_GeneratorType):
    """``torch.Generator``: a ``NeuronGenerator`` for neuron devices, PyTorch's generator otherwise."""

    def __new__(cls, device="cpu"):
        if torch.device(device).type == "neuron":
            return NeuronGenerator(device)
        return _CGenerator(device)


Generator.__module__ = "torch"
Generator.__qualname__ = Generator.__name__ = "Generator"


def default_generators() -> tuple:
    """``torch.neuron.default_generators``: one per device, sharing the device generators' state."""
    return tuple(NeuronGenerator(f"neuron:{i}", generator(i)) for i in range(max(pjrt.device_count(), 1)))


def install() -> None:
    if torch.Generator is _CGenerator:
        torch.Generator = Generator
