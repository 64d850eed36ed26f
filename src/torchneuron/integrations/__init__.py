"""Glue for libraries that need something from a device beyond the PyTorch device interface.

Installed by ``torchneuron.register()`` (so by ``import torch``); each part says why it exists:

* ``transformers`` -- transformers and accelerate already have a ``neuron`` code path (device
  selection in ``TrainingArguments``/``PartialState``, RNG checkpointing, ``torch.compile``
  backend choice, static-shape compile defaults), but they switch it on by probing for AWS's
  ``torch_neuronx`` package. The probes are answered from the registered ``neuron`` device instead.
* ``data`` -- ``DataLoader(pin_memory=True)`` (the ``Trainer`` default) pins for the current
  accelerator, which needs a pinned-memory allocator a Python backend cannot register.

``torch.autocast("neuron")`` (used by ``Trainer(bf16=True)`` through accelerate) is not glue: it is
part of the device (``runtime/autocast.py``).
"""

from __future__ import annotations

from . import data, transformers

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    transformers.install()
    data.install()
    _installed = True
