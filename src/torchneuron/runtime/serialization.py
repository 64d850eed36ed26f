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


_base_new = torch._C.StorageBase.__new__


def _untyped_storage_new(cls, *args, device=None, **kwargs):
    # torch.UntypedStorage(n, device="neuron") would reach a C++ allocator that does not exist
    # (and crash the process): build the storage through the DLPack allocator instead.
    if device is not None and torch.device(device).type == "neuron":
        if len(args) != 1 or not isinstance(args[0], int) or kwargs:
            raise RuntimeError("torchneuron: UntypedStorage(...) on neuron supports only a size in bytes; "
                               "create a tensor with torch.empty(..., device='neuron') instead")
        index = torch.device(device).index
        index = torch.neuron.current_device() if index is None else index
        return memory.allocator.new_tensor((args[0],), (1,), torch.uint8, index).untyped_storage()
    if device is not None:
        kwargs["device"] = device
    return _base_new(cls, *args, **kwargs)


def install() -> None:
    torch.UntypedStorage.__new__ = _untyped_storage_new
    torch.storage._to = _to
    torch.storage._StorageBase.neuron = _storage_neuron
    torch.storage.UntypedStorage.neuron = _storage_neuron
