"""``Module.to("neuron")`` keeps tied parameters tied.

PyTorch moves a parameter in place (``param.data = ...``) only when the two tensor types allow a
shallow copy; CPU and PrivateUse1 tensors do not, so each module gets a *new* Parameter and weights
shared between modules (tied embeddings and LM heads) silently come apart. After a top-level
``_apply`` we re-point every module that shared a parameter at one converted parameter.
"""

from __future__ import annotations

import threading

import torch

_original_apply = torch.nn.Module._apply
_depth = threading.local()


def _shared_parameter_slots(module):
    slots = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((owner, name))
    return [group for group in slots.values() if len(group) > 1]


def _apply(self, fn, recurse=True):
    level = getattr(_depth, "level", 0)
    if level or not recurse:
        return _original_apply(self, fn, recurse)
    groups = _shared_parameter_slots(self)
    _depth.level = 1
    try:
        result = _original_apply(self, fn, recurse)
    finally:
        _depth.level = 0
    for group in groups:
        owner, name = group[0]
        keep = owner._parameters[name]
        for other, other_name in group[1:]:
            other._parameters[other_name] = keep
    return result


def install() -> None:
    torch.nn.Module._apply = _apply
