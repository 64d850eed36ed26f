"""Storages moving to neuron (``torch.load(map_location="neuron")``, ``storage.neuron()``).

PyTorch's generic path allocates ``torch.UntypedStorage(n, device="neuron")``, which needs a C++
allocator we do not have; storages are made here through the DLPack allocator instead.
"""

from __future__ import annotations

import torch
import torch.storage

from . import memory

_original_to = torch.storage._to


def storage_to_neuron(storage, device_index: int, non_blocking: bool = False):
    nbytes = storage.nbytes()
    target = memory.allocator.new_tensor((nbytes,), (1,), torch.uint8, device_index)
    if nbytes:
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        if source.device.type == "neuron":
            source = source.cpu()
        target.copy_(source, non_blocking=non_blocking)
    return target.untyped_storage()


def _to(self, device, non_blocking=False):
    if device.type == "neuron":
        index = device.index if device.index is not None else torch.neuron.current_device()
        if self.device == torch.device("neuron", index):
            return self
        return storage_to_neuron(self, index, non_blocking)
    return _original_to(self, device, non_blocking)


def _storage_neuron(self, device=None, non_blocking=False, **kwargs):
    index = device if isinstance(device, int) else torch.device(device or "neuron").index
    return _to(self, torch.device("neuron", index if index is not None else torch.neuron.current_device()),
               non_blocking)


def install() -> None:
    torch.storage._to = _to
    torch.storage._StorageBase.neuron = _storage_neuron
    torch.storage.UntypedStorage.neuron = _storage_neuron
