"""Schema-driven eager kernels: one cached PJRT executable per (op, input layout, static args).

Every lowered ATen overload gets a ``Kernel``. A call:

1. binds the arguments to the schema and builds a cache key from each tensor's dtype, sizes,
   strides, offset and storage (``Scalar``s contribute only their Python type: their values are
   runtime inputs, so a new learning rate compiles nothing);
2. on a miss, runs the op on ``meta`` tensors (PyTorch's own shape/dtype rules and error
   messages), applies the rules for written tensors meta kernels miss (device, in-place casting,
   overlap; CPU's own error where meta and CPU disagree: ``eager/oracle.py``), applies the
   float64 policy, traces the lowering between "read each input view from its storage buffer" and
   "write outputs/mutations back" (plus the outcome of its device checks, ``ops/checks.py``), and
   compiles it with ``jax.jit``;
3. runs the executable on the storages' flat buffers and wraps fresh output buffers as neuron
   tensors, or replaces the buffers of mutated storages; a device-check outcome goes to
   ``runtime/deferred.py``, read at the next synchronisation point.

What the schema says (argument kinds, binding, mutated arguments, returns), promotion and how the
lowering is called come from ``ops.signature``, shared with torch.compile graphs. This module is the
hot path (step 1 and 3, and the cache); ``eager/key.py`` says what a key holds and why a new one
compiled; ``eager/plan.py`` is step 2 (``Planning``, a base class of ``Kernel``).
"""

from __future__ import annotations

import sys

import torch

from .. import seams
from ..config import observe
from ..metrics import metrics
from ..ops import devices, precision
from ..ops.signature import (
    OPT_SCALAR,
    OPT_TENSOR,
    SCALAR,
    TENSOR,
    OpSignature,
)
from ..runtime import memory, rng, sites
from ..runtime.device import DeviceMismatch, current_device
from ..runtime.donation import make_private
from ..runtime.inputs import Inputs
from . import argument_checks
from .key import PLAIN_STATIC, compile_reason, freeze
from .plan import Planning, describe_args

_records = memory.allocator.records


# The adaptive-eager recorder while that mode is on (see eager/adaptive.py), else None.
recorder = None
# config.shapes="bucketed": what serves a call that missed the exact cache with an executable of its
# shape bucket (compile/eager_buckets.py), else None.
bucketer = None
# What the recorder's replay returns for a call it leaves to the full path.
NOT_REPLAYED = object()


_cache: dict = {}


def cache_size() -> int:
    return len(_cache)


def clear_cache(_setting=None) -> None:
    """Forget every eager executable of this process (the persistent cache on disk stays)."""
    _cache.clear()
    for k in Kernel.instances:
        k.keys.clear()


class Kernel(Planning, OpSignature):
    """The PrivateUse1 kernel of one ATen overload: its signature plus a cache of executables."""

    instances: list = []
    # Whether executables go to the persistent cache: its entries are keyed by torchneuron's own
    # sources, so a kernel whose body is user code (torchneuron.kernel ops) must not be stored.
    persistent = True

    def __init__(self, overload, lowering, functional=None):
        super().__init__(overload, lowering, functional)
        self.nargs = len(self.defaults)
        # (argument index, kind) of each executable input, in key order.
        self.inputs = tuple((i, self.kinds[i]) for i in self.dynamic)
        args = overload._schema.arguments
        # (argument index, needs freeze) of each compiled-in argument.
        self.statics = tuple((i, str(args[i].type) not in PLAIN_STATIC) for i in self.static)
        self.keys = []     # this kernel's cache keys, for the reason of the next compile
        self.argument_check = argument_checks.CHECKS.get(self.short_name)   # random ops only
        # Matmul and convolution lowerings read PyTorch's float32 precision setting (ops/precision.py).
        self.read_precision = precision.READERS.get(lowering.precision) if lowering is not None else None
        Kernel.instances.append(self)

    # -- the hot path ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        metrics.op_calls[self.short_name] += 1
        if self.argument_check is not None:   # a few random ops (eager/argument_checks.py)
            self.argument_check(self, self.bind(args, kwargs))
        rec = recorder
        if rec is not None:   # adaptive eager replaying a known op sequence: no key to build
            out = rec.replay(self, args, kwargs)
            if out is not NOT_REPLAYED:
                return out
        # OpSignature.bind, inlined: a method call here would cost every op.
        values = list(args)
        if len(values) < self.nargs:
            values.extend(self.defaults[len(values):])
        if kwargs:
            index_of = self.index_of
            for name, v in kwargs.items():
                values[index_of[name]] = v
        ctx = Inputs()
        specs = []
        try:   # costs nothing unless raised (Python 3.11)
            for i, kind in self.inputs:
                v = values[i]
                if kind == TENSOR:
                    specs.append(ctx.tensor(v))
                elif kind == SCALAR:
                    specs.append(ctx.scalar(v))
                elif v is None:
                    specs.append(None)
                elif kind == OPT_TENSOR:
                    specs.append(ctx.tensor(v))
                elif kind == OPT_SCALAR:
                    specs.append(ctx.scalar(v))
                else:
                    specs.append(tuple([None if t is None else ctx.tensor(t) for t in v]))
        except DeviceMismatch as err:
            raise self.device_error(values, err.tensor, err.device_index) from None
        statics = tuple([freeze(values[i]) if frozen else values[i] for i, frozen in self.statics])
        if ctx.device_index is None:   # no tensor inputs (factories): the device argument decides
            ctx.device_index = self.output_device(values)
        if self.lowering.random:   # the generator argument, else the device's default generator
            gen = None if self.generator_index is None else values[self.generator_index]
            ctx.runtime.extend(rng.state_of(gen, ctx.device_index).next_key_inputs())
        # Everything that decides the program (see docs/performance.md): inputs' dtypes, sizes,
        # strides and storages, scalar types, compiled-in arguments, the device, and the default
        # dtype (the result dtype of integer inputs with float scalars, of factories...), and for
        # matmuls and convolutions the float32 precision setting.
        read_precision = self.read_precision
        key = (self, tuple(specs), statics, tuple(ctx.storages), ctx.device_index, torch.get_default_dtype(),
               None if read_precision is None else read_precision())
        exe = _cache.get(key)
        if exe is None:
            exe = self._miss(key, values, specs, ctx)
        elif exe.aliased:
            self.check_overlaps(values)
        if recorder is not None:   # adaptive eager: record now, run fused at the next sync point
            return recorder.record(self, exe, values, ctx)
        if exe.call is None:
            results = self.first_call(exe, ctx.bufs, ctx.runtime, values, ctx.device_index)
        else:
            metrics.cache_hits += 1
            if exe.donated:   # an in-place op updates its storages' buffers where they are
                make_private(ctx.bufs, exe.donated, ctx.device_index)
            try:   # costs nothing unless raised
                results = exe.call(*ctx.bufs, *ctx.runtime)
            except Exception as err:
                memory.raise_if_out_of_memory(err, ctx.device_index)   # torch.OutOfMemoryError
                raise
        return self._finish(exe, results, values, ctx)

    def _finish(self, exe, results, values, ctx):
        device_index = ctx.device_index
        if exe.single:   # one new output, nothing written: most ops
            return memory.allocator.new_output(exe.outputs[0], results[0], device_index)
        if exe.single_checked:   # the same with device checks (x[idx], gather...): their outcome last
            exe.report(results[1], sites.place(sys._getframe()))
            return memory.allocator.new_output(exe.outputs[0], results[0], device_index)
        if exe.boxed:
            return self._finish_boxed(exe, results, values, ctx)
        new_output = memory.allocator.new_output
        outs = []
        k = 0
        for out in exe.outputs:
            if out is None:
                outs.append(None)
                continue
            outs.append(new_output(out, results[k], device_index))
            k += 1
        if exe.writes:
            k = exe.take_writes(results, k, ctx.addrs)
        if exe.checks:   # value-dependent checks (index bounds...): the last result
            exe.report(results[k], sites.place(sys._getframe()))
        return self.returned(outs, values)

    def _finish_boxed(self, exe, results, values, ctx):
        """A bucketed executable's results: buffers of their bucket's capacity with the true layouts."""
        device_index = ctx.device_index
        outs = []
        k = 0
        for spec in exe.out_specs:
            if spec is None:
                outs.append(None)
                continue
            outs.append(memory.new_boxed_tensor(results[k], spec[0], device_index, spec[1], spec[2]))
            k += 1
        if exe.writes:
            k = exe.take_writes(results, k, ctx.addrs)
        if exe.checks:
            exe.report(results[k], sites.place(sys._getframe()))
        return self.returned(outs, values)

    def device_error(self, values, t, device_index) -> RuntimeError:
        """The error for argument ``t`` of this call, on another device than the op's."""
        i = next(i for i, v in enumerate(values)
                 if v is t or (isinstance(v, list | tuple) and any(x is t for x in v)))
        return devices.mismatch_error(self.name, self.arg_names[i], t, device_index, i == self.device_index_arg,
                                      describe_args(values))

    def output_device(self, values) -> int:
        """The device of an op without tensor inputs (factories): its ``device`` argument, else the
        current device."""
        i = self.index_of.get("device")
        if i is not None and values[i] is not None:
            dev = torch.device(values[i])
            if dev.index is not None:
                return dev.index
        return current_device()

    # -- a new key ------------------------------------------------------------------------------
    def _miss(self, key, values, specs, ctx):
        if bucketer is not None and recorder is None:
            exe = bucketer(self, key, values, specs, ctx, lambda: self._plan(values, specs, ctx))
            storages = tuple(ctx.storages)
            if storages != key[3]:   # the storages it reads were given a bucket's capacity: its key
                key = (*key[:3], storages, *key[4:])   # (also an exact executable of a refused op)
                if _cache.get(key) is exe:   # a length seen before, from a fresh storage
                    return exe
        else:
            if bucketer is not None:   # adaptive eager records exact executables: say so, once
                _adaptive_not_bucketed(self.short_name)
            exe = self._plan(values, specs, ctx)
        exe.key, exe.reason = key, compile_reason(key, self.keys)
        _cache[key] = exe
        self.keys.append(key)
        return exe


def _adaptive_not_bucketed(op: str) -> None:
    """config.shapes='bucketed' with adaptive eager: its regions are recorded from exact per-shape
    executables, so every new shape compiles as in static mode; counted, and warned about once."""
    metrics.extra["bucketed_eager_fallbacks"] += 1
    metrics.extra["bucketed_eager_fallback: adaptive eager (recorded regions compile per shape)"] += 1
    if not _warned_adaptive:
        _warned_adaptive.append(op)
        import warnings
        warnings.warn("torchneuron: config.shapes='bucketed' does not apply to adaptive eager yet: the "
                      "ops it records compile once per shape. For variable lengths use "
                      "config.eager_mode='plain' or torch.compile(backend='neuron', dynamic=True).",
                      stacklevel=4)


_warned_adaptive: list = []


# -- tracing (torch.profiler ranges, readiness-report call sites) ---------------------------------
# Swapped in only while metrics.tracer is installed (torchneuron.profiler.update), so the plain hot
# path pays nothing, not even a None check. The compile hook wraps the cache-miss path that jits,
# compiles and first runs an executable.
_plain_call = Kernel.__call__
_plain_compile = Kernel.first_call


_traced_call = seams.traced(__name__, "_plain_call", "kernel", with_kwargs=True)
_traced_compile = seams.traced(__name__, "_plain_compile", "compile")


def set_tracing(on: bool) -> None:
    Kernel.__call__ = _traced_call if on else _plain_call
    Kernel.first_call = _traced_compile if on else _plain_compile


# The float64 policy decides result dtypes (and whether an op may run at all) when a program is
# planned: a change must not be served the programs planned under the old one.
observe("float64", clear_cache)
