"""transformers and accelerate on the ``neuron`` device.

Both libraries carry a TorchNeuron code path (``TrainingArguments.device`` -> ``neuron:0``,
``PartialState`` device and RNG checkpointing, ``torch_compile_backend="neuron"`` with
``dynamic=False``, ``generate()`` compiling static-cache decoding with the ``neuron`` backend), but
they enable it only when AWS's ``torch_neuronx`` package is importable. torchneuron is the same
kind of backend under another name, so those two probes are answered from the registered device:
``neuron`` is the PrivateUse1 backend and ``torch.neuron.is_available()``. Nothing else in either
library is changed; everything else they ask of a device goes through the standard PyTorch APIs
(``torch.accelerator``, the ``torch.neuron`` device module, ``torch.autocast``).

One exception: ``Trainer`` checkpoints the RNG of each device type it knows by name (CUDA, XLA,
NPU, ...), not through a generic API, so a run resumed from a checkpoint drew fresh dropout masks
on neuron. Its ``_save_rng_state`` / ``_load_rng_state`` also write and restore the neuron
generators, under the key ``"neuron"`` of the same ``rng_state*.pth`` file.
"""

from __future__ import annotations

import functools
import os
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


def _rng_file(trainer, directory: str) -> str:
    # The file name Trainer itself uses.
    name = "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{trainer.args.process_index}.pth"
    return os.path.join(directory, name)


def _neuron_rng_state(trainer):
    distributed = trainer.args.parallel_mode.name == "DISTRIBUTED"
    return torch.neuron.get_rng_state_all() if distributed else torch.neuron.get_rng_state()


def _set_neuron_rng_state(trainer, state) -> None:
    if isinstance(state, list | tuple):
        torch.neuron.set_rng_state_all(state)
    else:
        torch.neuron.set_rng_state(state)


def _with_neuron_rng(trainer_module) -> None:
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if trainer_cls is None or hasattr(trainer_cls._save_rng_state, "__torchneuron_rng__"):
        return
    save, load = trainer_cls._save_rng_state, trainer_cls._load_rng_state

    @functools.wraps(save)
    def save_rng_state(self, output_dir):
        save(self, output_dir)
        path = _rng_file(self, output_dir)
        if neuron_device_available() and os.path.isfile(path):
            states = torch.load(path, weights_only=False)   # the file this process just wrote
            states["neuron"] = _neuron_rng_state(self)
            torch.save(states, path)

    @functools.wraps(load)
    def load_rng_state(self, checkpoint):
        load(self, checkpoint)
        if checkpoint is None or not neuron_device_available():
            return
        path = _rng_file(self, checkpoint)
        if os.path.isfile(path):
            # Trainer has just read the same file with its own safety checks.
            state = torch.load(path, weights_only=False).get("neuron")
            if state is not None:
                _set_neuron_rng_state(self, state)

    save_rng_state.__torchneuron_rng__ = load_rng_state.__torchneuron_rng__ = True
    trainer_cls._save_rng_state, trainer_cls._load_rng_state = save_rng_state, load_rng_state


def install() -> None:
    for module_name, probe in _PROBES.items():
        when_imported(module_name, functools.partial(_patch, name=probe))
    when_imported("transformers.trainer", _with_neuron_rng)
