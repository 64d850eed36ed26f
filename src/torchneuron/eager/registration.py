"""Registers neuron (PrivateUse1) kernels with the PyTorch dispatcher: one per op record.

``ops.oprecord.records`` says, per ATen overload, which kernel it gets and which eager special
cases wrap it; this module supplies their implementations and registers them in one loop. Kernels:
``Kernel`` over a lowering, or over its functional op's lowering for a derived in-place variant
(``add_.Tensor``), ``OutKernel`` for a derived ``out=`` variant (``add.out``), PyTorch's CPU kernel
for the metadata-only view ops (they only build sizes/strides over the same storage), and kernels
written by hand: allocation, copies, ``.item()`` and resizes (``storage_ops``), data-dependent
shapes (``host_ops``, ``data_dependent``). Besides: the fused RNN autograd kernels (``rnn``) and
the global fallback.
"""

from __future__ import annotations

import warnings

import torch

from .. import (
    ops,  # noqa: F401  (imports every lowering module, filling the registry)
    seams,
)
from ..config import config
from ..ops import oprecord, registry
from ..ops.signature import aten_overload
from ..runtime import pjrt
from . import data_dependent, host_ops, rnn, storage_ops
from .fallback import neuron_fallback
from .kernel import Kernel
from .out_variants import OutKernel

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_libs: list = []
_kernels: dict[str, object] = {}   # the kernels lowerings give, before any special case wraps them
# Every registered kernel: ATen overload name -> PrivateUse1 kernel (torchneuron.where reads it).
KERNELS: dict[str, object] = {}
# The modules of the kernels written by hand that ``oprecord.EAGER`` names ("host_ops.nonzero").
HAND_WRITTEN = {"storage_ops": storage_ops, "host_ops": host_ops, "data_dependent": data_dependent}
_table_platform = None   # the platform KERNELS was built for: config.platform when torch was imported


def _runtime_lr(tensor_lr_kernel):
    """``_fused_adam(w)_`` with a float ``lr`` through its ``tensor_lr`` form: a float would be
    compiled into the executable, so every step of an LR schedule (Trainer's default) would compile
    anew; as a 0-dim CPU tensor it is a runtime input."""
    def fused(*args, lr, **kwargs):
        if not isinstance(lr, torch.Tensor):
            lr = torch.tensor(lr, dtype=torch.float32)
        return tensor_lr_kernel(*args, lr=lr, **kwargs)
    return fused


def _redispatch_cpu(overload):
    # The handle's boxed redispatch directly: OpOverload.redispatch is one more Python frame on
    # every view (x.t() in each Linear, x[i], reshape...).
    redispatch = overload._handle.redispatch_boxed

    def kernel(*args, **kwargs):
        return redispatch(_CPU, *args, **kwargs)
    return kernel


def hand_written(kernel: str):
    """The function a record's ``"<module>.<function>"`` kernel names."""
    module, _, function = kernel.partition(".")
    return getattr(HAND_WRITTEN[module], function)


def _lowered_kernel(rec):
    overload = aten_overload(rec.name)
    if rec.lowered == oprecord.LOWERED:
        return Kernel(overload, rec.lowering)
    if rec.lowered == oprecord.INPLACE:
        return Kernel(overload, registry.get(rec.functional), functional=aten_overload(rec.functional))
    return OutKernel(overload, _kernels[rec.functional])


def _host_indices(kernel, policy):
    if policy.masked_fill is None:
        return host_ops.make_index(kernel)
    return host_ops.make_index_put(kernel, _kernels[policy.masked_fill])


def _checked_errors(kernel, policy):
    return host_ops.make_check_errors(kernel, *policy.checked_errors)


def _math_bits(kernel, policy):
    return _resolving_math_bits(kernel, policy.math_bits)


def _copy_math_bits(kernel, policy):
    return _copy_with_math_bits(kernel)


# ``EagerPolicy.wrappers()`` name -> fn(kernel, policy): the kernel with that special case around it.
WRAPPERS = {"host_indices": _host_indices, "checked_errors": _checked_errors, "math_bits": _math_bits,
            "copy_math_bits": _copy_math_bits}


def _eager_kernel(rec):
    """The record's kernel, with its special cases wrapped around it (in EagerPolicy's order)."""
    if rec.kernel == oprecord.METADATA:
        kernel = _redispatch_cpu(aten_overload(rec.name))
    elif rec.kernel == oprecord.RUNTIME_LR:
        kernel = _runtime_lr(_kernels[rec.policy.via])
    elif rec.kernel in (oprecord.LOWERED, oprecord.INPLACE, oprecord.OUT):
        kernel = _kernels[rec.name]
    else:
        kernel = hand_written(rec.kernel)
    for wrapper in rec.wrappers:
        kernel = WRAPPERS[wrapper](kernel, rec.policy)
    return kernel


def implementation(rec):
    """What builds a record's kernel (a class or function), for ``torchneuron.where``."""
    return {oprecord.LOWERED: Kernel, oprecord.INPLACE: Kernel, oprecord.OUT: OutKernel,
            oprecord.METADATA: _redispatch_cpu, oprecord.RUNTIME_LR: _runtime_lr,
            None: neuron_fallback}.get(rec.kernel) or hand_written(rec.kernel)


def _kernel_table() -> dict:
    """ATen overload name -> PrivateUse1 kernel, for every op record that has a kernel."""
    global _table_platform
    _table_platform = config.platform
    records = oprecord.records(_table_platform).values()
    # Kernels over lowerings first: special cases and hand-written kernels use them.
    for rec in records:
        if rec.lowered is not None:
            _kernels[rec.name] = _lowered_kernel(rec)
    seams.seam("device_copy_kernel").install(_kernels["copy_.default"])   # copies between neuron tensors
    return {rec.name: _eager_kernel(rec) for rec in records if rec.kernel is not None}


def _resolve_bits(v):
    if isinstance(v, torch.Tensor):
        # Not resolve_conj(): it copies through copy_, which is one of these kernels.
        conj, neg = v.is_conj(), v.is_neg()
        # Clear both bits first (conj() of a conj view and _neg_view() of a neg view toggle them
        # off): a kernel reads the stored values, whatever bit is still set on its input.
        if conj:
            v = v.conj()
        if neg:
            v = v._neg_view()
        if conj:
            v = _kernels["_conj_physical.default"](v)
        if neg:
            v = _kernels["neg.default"](v)
    return v


def _resolving_math_bits(kernel, read):
    def resolved(*args, **kwargs):
        for i in read:   # a loop, not any(<generator>): this runs on every matmul
            if i < len(args) and _has_bits(args[i]):
                args = [_resolve_bits(a) if i in read else a for i, a in enumerate(args)]
                break
        return kernel(*args, **kwargs)
    return resolved


def _copy_with_math_bits(copy_kernel):
    """``copy_`` reads a source's lazy conj/neg bits (as the ops with ``math_bits`` in
    ``oprecord.EAGER``), and into a destination with such a bit stores conj(src)/-src, so that it
    reads back src: PyTorch's math-bit fallbacks run an in-place op on such a tensor
    (``x.conj().triu_()``) on a resolved copy and write the result back with this ``copy_``."""
    def copy_(self, src, non_blocking=False):
        if not (self.is_conj() or self.is_neg()):
            if src.is_conj() or src.is_neg():
                src = _resolve_bits(src)
            return copy_kernel(self, src, non_blocking)
        conj, neg = self.is_conj(), self.is_neg()
        plain = self.conj() if conj else self          # the same storage, bits cleared
        plain = plain._neg_view() if neg else plain
        src = _resolve_bits(src.to(self.device, self.dtype))
        if conj:
            src = _kernels["_conj_physical.default"](src)
        if neg:
            src = _kernels["neg.default"](src)
        copy_kernel(plain, src, non_blocking)
        return self
    return copy_


def _has_bits(v):
    return isinstance(v, torch.Tensor) and (v.is_conj() or v.is_neg())


# Ops whose kernel depends on the platform (lowerings limited to some platforms, their derived
# variants) -> their kernel on the platform the device started on. They are registered once, as a
# call through this table: a program may pick its platform after torch imported torchneuron, and
# torch before 2.13 refuses a second Python kernel for an op and dispatch key.
_switched: dict[str, object] = {}


def _switch(name: str):
    def kernel(*args, **kwargs):
        return _switched[name](*args, **kwargs)
    return kernel


def _platform_dependent() -> set[str]:
    names = {n for n, low in registry.LOWERINGS.items() if low.platforms}
    for platform in {p for n in names for p in registry.LOWERINGS[n].platforms} | {config.platform}:
        recs = oprecord.records(platform)
        names |= {v for n in list(names) if n in recs for v in recs[n].variants}
    return names


def register_all() -> None:
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    KERNELS.update(_kernel_table())
    for name in _platform_dependent():
        _switched[name] = KERNELS.get(name) or _fallback_kernel(aten_overload(name))
        lib.impl(name.removesuffix(".default"), _switch(name), "PrivateUse1")
    for name, fn in KERNELS.items():
        if name not in _switched:
            lib.impl(name.removesuffix(".default"), fn, "PrivateUse1")
    rnn.install(lib)   # fused LSTM/GRU/RNN: an autograd kernel, as these ATen ops are composite
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(neuron_fallback, "PrivateUse1")
    _libs.append(fallback_lib)
    pjrt.on_start(follow_started_platform)


def _fallback_kernel(overload):
    def kernel(*args, **kwargs):
        return neuron_fallback(overload, *args, **kwargs)
    return kernel


def follow_started_platform(platform: str) -> None:
    """Give the ops whose lowering exists only on some platforms (LAPACK-only linalg) the kernels of
    the platform the device started on. The table is built while torch imports torchneuron, and a
    program may choose another platform after that (config.platform, or its variable)."""
    global _table_platform
    if platform == _table_platform:
        return
    before, now = oprecord.records(_table_platform), oprecord.records(platform)
    changed = [name for name in {**before, **now}
               if (before.get(name) and before[name].kernel) != (now.get(name) and now[name].kernel)]
    _table_platform = platform
    replaced = []
    for name in changed:
        rec = now.get(name)
        if rec is not None and rec.lowered is not None:
            _kernels[name] = _lowered_kernel(rec)
        if rec is not None and rec.kernel is not None:
            KERNELS[name] = kernel = _eager_kernel(rec)
        else:
            KERNELS.pop(name, None)
            kernel = _fallback_kernel(aten_overload(name))
        if name in _switched:
            _switched[name] = kernel
        else:
            replaced.append((name, kernel))
    if not replaced:
        return
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    for name, kernel in replaced:
        with warnings.catch_warnings():   # replacing our own kernel is the point
            warnings.simplefilter("ignore")
            lib.impl(name.removesuffix(".default"), kernel, "PrivateUse1")
