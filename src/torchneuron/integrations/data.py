"""``DataLoader(pin_memory=True)`` with neuron as the current accelerator.

The DataLoader pins every batch for ``torch.accelerator.current_accelerator()``; ``Trainer`` turns
this on by default (``dataloader_pin_memory=True``). Pinning asks the PrivateUse1 hooks for a
pinned-memory allocator, which a Python backend cannot provide (the Python hooks interface exposes
only ``is_available``/``has_primary_context``/``is_built``), so the first batch would raise.
Pinning buys nothing here either: host->neuron copies go through PJRT, which stages host buffers
itself. So for neuron the loader hands batches over unpinned, for every other device unchanged.
"""

from __future__ import annotations

import torch
from torch.utils.data._utils import pin_memory as module

_original = None


def _is_neuron(device) -> bool:
    if device is None:
        acc = torch.accelerator.current_accelerator()
        return acc is not None and acc.type == "neuron"
    return str(device).split(":", 1)[0] == "neuron"


def pin_memory(data, device=None):
    if _is_neuron(device):
        return data
    return _original(data, device)


def install() -> None:
    global _original
    if _original is not None or getattr(module.pin_memory, "__module__", "") == __name__:
        return
    _original = module.pin_memory
    # The loader calls it through the module, and the pinning thread by its global name: one patch.
    module.pin_memory = pin_memory
