"""``torch.distributed`` for neuron tensors: the c10d backend ``neuron``.

``torchneuron.register()`` registers it, so standard code works unchanged::

    dist.init_process_group("neuron")   # or init_process_group(): neuron is the accelerator
    model = DistributedDataParallel(model.to("neuron"))

Collectives on neuron tensors are staged through host memory and run by gloo (its TCP transport,
torchrun's rendezvous and the group's timeout), or on CUDA shared with torch through DLPack and run
by NCCL; CPU tensors on the same group go to gloo directly.
See docs/distributed.md.
"""

from __future__ import annotations

import torch.distributed as dist

_registered = False


def register() -> None:
    """Register the ``neuron`` c10d backend (idempotent; cheap: no process group is created)."""
    global _registered
    if _registered or not dist.is_available():
        return
    if "NEURON" not in dist.Backend._plugins:
        # "cpu" too: the group routes CPU tensors to its gloo backend, so init_process_group("neuron")
        # serves object collectives and CPU tensors without a second group.
        dist.Backend.register_backend("neuron", _create, extended_api=True, devices=["neuron", "cpu"])
    _registered = True


def _create(backend_opts, pg_options=None):
    # The process group's code loads with the first group, not with `import torch`.
    from .backend import create
    return create(backend_opts, pg_options)


def __getattr__(name):
    if name in ("ProcessGroupNeuron", "NeuronWork", "CollectiveError"):
        from . import backend  # the process group's code: see _create
        return getattr(backend, name)
    raise AttributeError(f"module 'torchneuron.distributed' has no attribute {name!r}")


__all__ = ["register", "ProcessGroupNeuron", "NeuronWork", "CollectiveError"]
