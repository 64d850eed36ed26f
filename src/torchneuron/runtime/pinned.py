"""Pinned host memory when neuron is the current accelerator.

``Tensor.pin_memory()`` (device None = the current accelerator) asks the PrivateUse1 hooks for a
pinned-memory allocator, which a Python backend cannot provide (PyTorch's Python hooks expose only
``is_available``/``has_primary_context``/``is_built``), so it raised NotImplementedError. Host ->
neuron copies go through PJRT, which stages host buffers itself, so page-locking buys nothing:
``aten::_pin_memory`` for neuron returns a copy in ordinary host memory (same sizes and strides,
like CUDA's pinned copy) and ``is_pinned()`` reports True for it and its views, so code that pins
and checks behaves as on CUDA.

Not covered: factories asked for pinned memory directly (``torch.empty(..., pin_memory=True)``)
allocate through a C++ allocator lookup with no dispatcher step in between, which no Python backend
can answer; ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (transformers' activation
offloading) is the common caller, and its neuron case is handled in ``install``.
"""

from __future__ import annotations

import weakref

import torch

_pinned: set[int] = set()     # data pointers of host storages made by pin_memory() for neuron
_lib = None


def _for_neuron(device) -> bool:
    if device is None:
        acc = torch.accelerator.current_accelerator()
        return acc is not None and acc.type == "neuron"
    return torch.device(device).type == "neuron"


def _pin_memory(self, device=None):
    if not _for_neuron(device):
        # Another accelerator's pinning: PyTorch's own kernel (and its error, on a CPU-only build).
        return torch.ops.aten._pin_memory.default.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd), self, device)
    out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype)
    out.copy_(self)
    storage = out.untyped_storage()
    ptr = storage.data_ptr()
    _pinned.add(ptr)
    weakref.finalize(storage, _pinned.discard, ptr)
    return out


def _is_pinned(self, device=None):
    if _for_neuron(device):
        return self.untyped_storage().data_ptr() in _pinned
    return torch.ops.aten.is_pinned.default.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd), self, device)


def _save_on_cpu_init(original):
    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        # Its pack hook allocates with torch.empty(..., pin_memory=True); for neuron a plain host
        # copy is what pinning amounts to (see the module docstring).
        original(self, pin_memory=pin_memory and device_type != "neuron", device_type=device_type)
    __init__.__wrapped__ = original
    return __init__


def install() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_pin_memory", _pin_memory, "CPU")
    _lib.impl("is_pinned", _is_pinned, "CPU")
    from torch.autograd.graph import save_on_cpu
    if not hasattr(save_on_cpu.__init__, "__wrapped__"):
        save_on_cpu.__init__ = _save_on_cpu_init(save_on_cpu.__init__)
