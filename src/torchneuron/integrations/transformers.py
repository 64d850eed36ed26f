"""transformers and accelerate on the ``neuron`` device.

Both libraries carry a TorchNeuron code path (``TrainingArguments.device`` -> ``neuron:0``,
``PartialState`` device and RNG checkpointing, ``torch_compile_backend="neuron"`` with
``dynamic=False``, ``generate()`` compiling static-cache decoding with the ``neuron`` backend), but
they enable it only when AWS's ``torch_neuronx`` package is importable. torchneuron is the same
kind of backend under another name, so those two probes are answered from the registered device:
``neuron`` is the PrivateUse1 backend and ``torch.neuron.is_available()``. Nothing else in either
library is changed; everything else they ask of a device goes through the standard PyTorch APIs
(``torch.accelerator``, the ``torch.neuron`` device module, ``torch.autocast``).
"""

from __future__ import annotations

import functools
import sys

import torch

from ._imports import when_imported

# module defining the probe -> the probe's name
_PROBES = {
    "transformers.utils.import_utils": "is_torch_neuron_available",
    "accelerate.utils.imports": "is_neuron_available",
}


def neuron_device_available() -> bool:
    return torch._C._get_privateuse1_backend_name() == "neuron" and torch.neuron.is_available()


def _probe(original):
    def probe(check_device: bool = False) -> bool:
        return neuron_device_available() or original(check_device=check_device)

    # transformers marks its hardware probes as torch.compile constants (read once per process).
    probe._dynamo_marked_constant = True
    wrapped = functools.lru_cache(probe)
    wrapped.__wrapped_probe__ = original
    wrapped.__doc__ = f"{getattr(original, '__doc__', '') or ''}\n(torchneuron: true when the neuron device is registered)"
    return wrapped


def _patch(module, name: str) -> None:
    original = getattr(module, name, None)
    if original is None or hasattr(original, "__wrapped_probe__"):
        return
    replacement = _probe(original)
    setattr(module, name, replacement)
    # Modules that imported the probe by name before this patch (transformers may be imported
    # before torch) get the new one too.
    package = module.__name__.split(".", 1)[0]
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.split(".", 1)[0] == package and getattr(mod, "__dict__", {}).get(name) is original:
            setattr(mod, name, replacement)


def install() -> None:
    for module_name, probe in _PROBES.items():
        when_imported(module_name, functools.partial(_patch, name=probe))
