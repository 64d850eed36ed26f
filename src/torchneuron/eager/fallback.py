"""What happens to an op with no lowering: its PyTorch decomposition, else the CPU.

Registered as the global PrivateUse1 fallback, so every ATen op without a neuron kernel lands
here. A decomposition (``torch._decomp``) re-dispatches its pieces to neuron kernels. Otherwise the
op runs on CPU: inputs are copied to host, the CPU kernel runs, results and in-place effects are
copied back, and the op is counted and warned about once (``TORCHNEURON_FALLBACK=error`` raises).
"""

from __future__ import annotations

import threading

import torch
from torch._decomp import decomposition_table
from torch.utils._pytree import tree_map

from ..config import config
from ..metrics import metrics, op_key
from ..ops.signature import OpSignature, functional_of, out_names
from ..runtime import memory, sites
from ..runtime.device import current_device
from . import oracle
from .kernel import describe_args
from .out_variants import check_out_devices, write_out

_tls = threading.local()
_warned: set[str] = set()

# Decompositions that make things worse on this backend (they loop back to the same op, or
# replace one executable with many tiny host-driven ones).
SKIP_DECOMPOSITION = {
    "aten::_to_copy", "aten::copy_", "aten::lift_fresh", "aten::item", "aten::_local_scalar_dense",
}
# ATen's kernels for these resize ``out`` only when its element count differs from the result's: an
# ``out`` of another shape (a (2, 2) view for 4 steps) keeps its shape and is filled in its element
# order. PyTorch's Python references resize it to the result's shape, which rewrites a view's layout.
# Factories whose out= keeps the out tensor's shape when the element counts match: the functional
# overload that computes them.
KEEP_OUT_SHAPE = {
    "aten::linspace.out": torch.ops.aten.linspace.default,
    "aten::logspace.out": None,   # no lowering: PyTorch's decomposition, into a fresh out
    "aten::arange.out": torch.ops.aten.arange.default,
    "aten::arange.start_out": torch.ops.aten.arange.start_step,
}


class FallbackError(RuntimeError):
    pass


def _active() -> set:
    active = getattr(_tls, "active", None)
    if active is None:
        active = _tls.active = set()
    return active


def _device_of(args, kwargs):
    found = []

    def visit(v):
        if isinstance(v, torch.Tensor) and v.device.type == "neuron" and not found:
            found.append(v.device)
        return v

    tree_map(visit, (args, kwargs))
    if found:
        return found[0]
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    return torch.device("neuron", current_device())


def neuron_fallback(op, *args, **kwargs):
    tracer = metrics.tracer
    if tracer is not None:   # profiler ranges / readiness report: see torchneuron.profiler
        return tracer.fallback(op, _neuron_fallback, args, kwargs)
    return _neuron_fallback(op, *args, **kwargs)


def _neuron_fallback(op, *args, **kwargs):
    name = op.name()
    if name in KEEP_OUT_SHAPE and op not in _active():
        return _keep_out_shape(op, args, kwargs)
    if name not in SKIP_DECOMPOSITION:
        decomp = decomposition_table.get(op)
        active = _active()
        if decomp is not None and op not in active:
            metrics.decompositions[op_key(name)] += 1
            sig = _signature(op)
            if sig.mutated:   # the decomposed ops write copies: the overlap is CPU's first error
                oracle.check_overlaps(sig, sig.bind(args, kwargs, missing=None), describe_args)
            active.add(op)
            try:
                return decomp(*args, **kwargs)
            finally:
                active.discard(op)
        functional = _functional_of(op)
        if functional is not None and functional in decomposition_table and functional not in active:
            return _out_via_functional(op, functional, args, kwargs)
    return cpu_fallback(op, args, kwargs)


_functional_cache: dict = {}
_signatures: dict = {}   # op -> its OpSignature (which arguments it writes)


def _functional_of(op):
    """For an ``out=`` overload, the functional overload computing the same thing (or None)."""
    if op not in _functional_cache:
        _functional_cache[op] = functional_of(op)
    return _functional_cache[op]


def _out_via_functional(op, functional, args, kwargs):
    # Structured ops reach the backend through their out= form; compute the functional form
    # (decomposed into lowered ops) and write the result into the caller's out tensors.
    kwargs = dict(kwargs)
    outs = [kwargs.pop(n) for n in out_names(op)]
    metrics.decompositions[op_key(functional.name())] += 1
    active = _active()
    active.add(functional)
    try:
        result = decomposition_table[functional](*args, **kwargs)
    finally:
        active.discard(functional)
    results = result if isinstance(result, tuple) else (result,)
    check_out_devices(outs, results[0].device)
    for out, value in zip(outs, results):
        write_out(out, value, op.name())
    return outs[0] if len(outs) == 1 else tuple(outs)


def _signature(op) -> OpSignature:
    sig = _signatures.get(op)
    if sig is None:
        sig = _signatures[op] = OpSignature(op, None)
    return sig


def _check_written_tensors(op, args, kwargs, device) -> None:
    """Tensors the op writes (out=, in-place) live on its device, as on CUDA: the CPU run would
    otherwise write a CPU out= tensor directly and hide the transfer. And they overlap no other
    argument where CPU refuses it: the CPU run gets each argument as a copy of its own, where
    aliasing can no longer be seen."""
    sig = _signature(op)
    values = sig.bind(args, kwargs, missing=None)
    check_out_devices([t for _, _, t in sig.mutated_tensors(values)], device)
    oracle.check_overlaps(sig, values, describe_args)


def _keep_out_shape(op, args, kwargs):
    """The op's functional form (lowered) computed in out's dtype (ATen's: linspace(0.3, 1.9, out=int16) spaces the integer ends 0 and 1), then
    written into the caller's in its own shape when the element counts match (ATen's rule for these
    ops); otherwise ``out`` is resized, with arange's own warning where ATen gives one."""
    (name,) = out_names(op)
    kwargs = dict(kwargs)
    out = kwargs.pop(name)
    metrics.decompositions[op_key(op.name())] += 1
    active = _active()
    active.add(op)
    try:
        functional = KEEP_OUT_SHAPE[op.name()]
        if functional is None:
            value = decomposition_table[op](*args, **kwargs, dtype=out.dtype, **{name: out.new_empty(0)})
        else:
            value = functional(*args, **dict(kwargs, dtype=out.dtype, device=out.device))
    finally:
        active.discard(op)
    if out.numel() == value.numel():
        value = value.reshape(out.shape)
    elif out.shape != value.shape:
        if out.numel() and op.name().startswith("aten::arange"):
            sites.warn(
                f"The number of elements in the out tensor of shape {list(out.shape)} is {out.numel()} "
                f"which does not match the computed number of elements {value.numel()}. Note that this "
                "may occur as a result of rounding error. The out tensor will be resized to a tensor of "
                f"shape ({value.numel()},).")
        out.resize_(value.shape)
    write_out(out, value, op.name())
    return out


def cpu_fallback(op, args, kwargs):
    name = op.name()
    short = op_key(name)
    if config.fallback == "error":
        raise FallbackError(
            f"torchneuron: {name} has no neuron lowering and no decomposition, and "
            f"TORCHNEURON_FALLBACK=error forbids running it on CPU. Inputs: {describe_args(list(args))}. "
            "Set TORCHNEURON_FALLBACK=warn (or torchneuron.config.fallback = 'warn') to run it on "
            "CPU, or avoid the op."
        )
    metrics.fallbacks[short] += 1
    memory.flush_pending("fallback")  # the CPU kernel needs the values of everything recorded so far
    if config.fallback == "warn" and short not in _warned:
        _warned.add(short)
        sites.warn(
            f"torchneuron: {name} is not lowered for neuron; it runs on CPU (inputs copied to host "
            "and results back). Set TORCHNEURON_FALLBACK=error to make this an error, or =silent.")
    device = _device_of(args, kwargs)
    _check_written_tensors(op, args, kwargs, device)
    originals = {}

    def to_cpu(v):
        if isinstance(v, torch.Tensor) and v.device.type == "neuron":
            c = v.cpu()
            originals[id(c)] = v
            return c
        if isinstance(v, torch.device) and v.type == "neuron":
            return torch.device("cpu")
        return v

    cpu_args = tree_map(to_cpu, list(args))
    cpu_kwargs = tree_map(to_cpu, dict(kwargs))
    if isinstance(kwargs.get("device"), str) and kwargs["device"].startswith("neuron"):
        cpu_kwargs["device"] = "cpu"
    result = op(*cpu_args, **cpu_kwargs)

    # In-place and out= effects travel back into the caller's neuron tensors.
    sig = _signature(op)
    for _, _, cpu_t in sig.mutated_tensors(sig.bind(cpu_args, cpu_kwargs, missing=None)):
        target = originals.get(id(cpu_t))
        if target is not None:
            if target.shape != cpu_t.shape:
                target.resize_(cpu_t.shape)
            target.copy_(cpu_t)

    def to_device(v):
        if isinstance(v, torch.Tensor):
            original = originals.get(id(v))
            if original is not None:
                return original
            return v.to(device)
        return v

    return tree_map(to_device, result)
