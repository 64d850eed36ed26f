"""Per-device random number generators.

Each neuron device has a (seed, offset) pair. A random op receives both as runtime inputs and
derives its JAX key from them inside the executable, so reseeding never recompiles; the offset
advances on every random op, so successive calls differ and ``manual_seed`` replays a stream.
"""

from __future__ import annotations

import random
import threading

import torch

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
