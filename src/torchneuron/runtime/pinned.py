"""Pinned host memory when neuron is the current accelerator.

``Tensor.pin_memory()`` (device None = the current accelerator) asks the PrivateUse1 hooks for a
pinned-memory allocator, which a Python backend cannot provide (PyTorch's Python hooks expose only
``is_available``/``has_primary_context``/``is_built``), so it raised NotImplementedError. Host ->
neuron copies go through PJRT, which stages host buffers itself, so page-locking buys nothing:
``aten::_pin_memory`` for neuron returns a copy in ordinary host memory (same sizes and strides,
like CUDA's pinned copy) and ``is_pinned()`` reports True for it and its views, so code that pins
and checks behaves as on CUDA.

Factories asked for pinned memory directly (``torch.empty(..., pin_memory=True)``, ``zeros``,
``full``, ``tensor``, the ``*_like`` and ``Tensor.new_*`` families...) allocate through a C++
allocator lookup with no dispatcher step in between, which no Python backend can answer. Taking the
CPU ``empty`` kernels over in Python would cost every CPU allocation ~8 us, so instead the Python
entry points of those factories are wrapped: a call without ``pin_memory=True`` only pays one
keyword lookup (~0.2 us); one with it allocates ordinary host memory and marks it pinned, as
``pin_memory()`` does. ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (transformers'
activation offloading) calls ``torch.empty(..., pin_memory=True)`` and is covered by the same.
"""

from __future__ import annotations

import functools
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
    return _mark_pinned(out)


def _mark_pinned(tensor):
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    if ptr not in _pinned:
        _pinned.add(ptr)
        weakref.finalize(storage, _pinned.discard, ptr)
    return tensor


def _is_pinned(self, device=None):
    if _for_neuron(device):
        return self.untyped_storage().data_ptr() in _pinned
    return torch.ops.aten.is_pinned.default.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd), self, device)


# The Python entry points that take ``pin_memory=`` (namespace, names).
_FACTORIES = (
    (torch, ("empty", "empty_strided", "empty_permuted", "zeros", "ones", "full", "rand", "randn",
             "randint", "randperm", "arange", "range", "linspace", "logspace", "eye", "tensor",
             "scalar_tensor", "tril_indices", "triu_indices", "empty_like", "zeros_like",
             "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "hann_window",
             "hamming_window", "bartlett_window", "blackman_window", "kaiser_window")),
    (torch.fft, ("fftfreq", "rfftfreq")),
    (torch.Tensor, ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full")),
)


def _allocates_on_host(kwargs) -> bool:
    device = kwargs.get("device")
    if device is None:
        device = torch.get_default_device()
    return torch.device(device).type == "cpu" and _for_neuron(None)


def _pinning_factory(factory, jit_name: str):
    """``factory`` with ``pin_memory=True`` on the host answered as ``pin_memory()`` answers it."""

    @functools.wraps(factory)
    def with_pin_memory(*args, **kwargs):
        if kwargs.get("pin_memory") and _allocates_on_host(kwargs):
            kwargs["pin_memory"] = False
            return _mark_pinned(factory(*args, **kwargs))
        return factory(*args, **kwargs)

    with_pin_memory.__torchneuron_factory__ = factory
    # TorchScript resolves torch.* builtins by identity: the wrapper stands for the same op. Its
    # table is built on first use from _builtin_ops (building it here would slow the import).
    builtins = torch.jit._builtins
    if builtins._builtin_table is None:
        builtins._builtin_ops.append((with_pin_memory, jit_name))
    else:
        builtins._builtin_table[id(with_pin_memory)] = jit_name
    return with_pin_memory


def _install_factories() -> None:
    # PyTorch keeps tables of factories keyed by identity, built on first use; built now, they hold
    # the originals, which the wrappers call (``with torch.device(...)`` must still see them).
    import torch.overrides  # not yet imported: torchneuron loads while torch is importing
    import torch.utils._device
    torch.utils._device._device_constructors()
    torch.overrides.get_ignored_functions()
    for namespace, names in _FACTORIES:
        for name in names:
            factory = getattr(namespace, name, None)
            if factory is None or hasattr(factory, "__torchneuron_factory__"):
                continue
            jit_name = f"aten::fft_{name}" if namespace is torch.fft else f"aten::{name}"
            setattr(namespace, name, _pinning_factory(factory, jit_name))


def install() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_pin_memory", _pin_memory, "CPU")
    _lib.impl("is_pinned", _is_pinned, "CPU")
    _install_factories()
