"""Schema-driven eager kernels: one cached PJRT executable per (op, input layout, static args).

Every lowered ATen overload gets a ``Kernel``. A call:

1. binds the arguments to the schema and builds a cache key from each tensor's dtype, sizes,
   strides, offset and storage (``Scalar``s contribute only their Python type: their values are
   runtime inputs, so a new learning rate compiles nothing);
2. on a miss, runs the op on ``meta`` tensors (PyTorch's own shape/dtype rules and error
   messages), applies the float64 policy, traces the lowering between "read each input view from
   its storage buffer" and "write outputs/mutations back", and compiles it with ``jax.jit``;
3. runs the executable on the storages' flat buffers and wraps fresh output buffers as neuron
   tensors, or replaces the buffers of mutated storages.

Type promotion, in-place and ``out=`` variants live here, once, for every op.
"""

from __future__ import annotations

import math
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..metrics import metrics
from ..ops.registry import Lowering
from ..runtime import memory, pjrt, rng
from ..runtime.dtypes import device_dtype, jax_dtype
from . import layout

_records = memory.allocator.records
_REQUIRED = object()

# Argument kinds.
_TENSOR, _OPT_TENSOR, _TENSOR_LIST, _OPT_TENSOR_LIST, _SCALAR, _OPT_SCALAR, _STATIC = range(7)

_tls = threading.local()


def _kind(arg) -> int:
    t = str(arg.type)
    if t == "Tensor":
        return _TENSOR
    if t == "Optional[Tensor]":
        return _OPT_TENSOR
    if t == "List[Tensor]" or t == "List[number]":
        # Scalar[] (the _foreach_*.ScalarList ops): runtime values, like a list's wrapped numbers.
        return _TENSOR_LIST
    if t == "List[Optional[Tensor]]":
        return _OPT_TENSOR_LIST
    if t == "number":
        return _SCALAR
    if t == "Optional[number]":
        return _OPT_SCALAR
    return _STATIC


def _freeze(v):
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise TypeError("torchneuron: symbolic sizes are not supported in eager mode")
    return v


def device_mismatch_error(other: torch.Tensor, device_index: int) -> RuntimeError:
    # Same text as PyTorch's CUDA check, so users recognise it.
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"neuron:{device_index} and {other.device}!"
    )


class Executable:
    __slots__ = ("traced", "call", "out_specs", "writes", "op_name")

    def __init__(self, traced, out_specs, writes, op_name):
        self.traced = traced          # the pure function of (buffers..., runtime scalars...)
        self.call = None              # its jitted form, made on the first plain-eager call
        self.out_specs = out_specs    # per new output: (torch dtype, sizes, strides) or None
        self.writes = writes          # buffer slots written (returned after the new outputs)
        self.op_name = op_name


# The adaptive-eager recorder while that mode is on (see eager/adaptive.py), else None.
recorder = None


_cache: dict = {}


def cache_size() -> int:
    return len(_cache)


def clear_cache() -> None:
    _cache.clear()


class Kernel:
    """The PrivateUse1 kernel of one ATen overload, driven by its schema and a lowering."""

    def __init__(self, overload, lowering: Lowering, functional=None):
        self.overload = overload
        self.lowering = lowering
        self.name = overload.name()            # "aten::add.Tensor"
        self.short_name = self.name.split("::", 1)[1]
        schema = overload._schema
        args = schema.arguments
        self.arg_names = [a.name for a in args]
        self.kwarg_only = [a.kwarg_only for a in args]
        self.defaults = [a.default_value if a.has_default_value() else _REQUIRED for a in args]
        self.index_of = {a.name: i for i, a in enumerate(args)}
        self.kinds = [_kind(a) for a in args]
        self.dynamic = [i for i, k in enumerate(self.kinds) if k != _STATIC]
        self.static = [i for i, k in enumerate(self.kinds) if k == _STATIC]
        if lowering.static_scalars:
            self.dynamic = [i for i in self.dynamic if self.kinds[i] not in (_SCALAR, _OPT_SCALAR)]
            self.static = sorted(set(range(len(args))) - set(self.dynamic))
        # Mutated arguments (in-place self, out=, running stats...) in schema order.
        self.mutated = [i for i, a in enumerate(args) if (a.alias_info is not None and a.alias_info.is_write)
                        or a.name in lowering.mutates]
        self.functional = functional       # for derived in-place variants: the functional overload
        # Returns that alias a mutated input give back that input; the rest are new tensors.
        alias_sets = {}
        for i in self.mutated:
            for s in (args[i].alias_info.after_set if args[i].alias_info is not None else ()):
                alias_sets[s] = i
        self.return_sources = []
        for r in schema.returns:
            if r.alias_info is not None and r.alias_info.after_set:
                self.return_sources.append(alias_sets.get(next(iter(r.alias_info.after_set))))
            else:
                self.return_sources.append(None)
        self.new_outputs = sum(1 for s in self.return_sources if s is None)
        self.returns_list = len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]"
        self.promote_idx = None
        if lowering.promote:
            names = lowering.promote_args or tuple(
                a.name for a, k in zip(args, self.kinds) if k in (_TENSOR, _SCALAR, _OPT_SCALAR, _OPT_TENSOR)
                and not a.kwarg_only)
            self.promote_idx = [self.index_of[n] for n in names if n in self.index_of]

    # -- the hot path ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        metrics.op_calls[self.short_name] += 1
        values = list(args)
        n = len(values)
        if n < len(self.defaults):
            values.extend(self.defaults[n:])
        if kwargs:
            index_of = self.index_of
            for k, v in kwargs.items():
                values[index_of[k]] = v
        bufs, addrs, slots, runtime, specs = [], [], {}, [], []
        ctx = _KeyContext(bufs, addrs, slots, runtime)
        kinds = self.kinds
        for i in self.dynamic:
            v = values[i]
            kind = kinds[i]
            if kind == _TENSOR:
                specs.append(ctx.tensor(v))
            elif kind == _SCALAR:
                specs.append(ctx.scalar(v))
            elif kind == _OPT_TENSOR or kind == _OPT_SCALAR:
                specs.append(None if v is None else ctx.tensor(v) if kind == _OPT_TENSOR else ctx.scalar(v))
            else:
                specs.append(tuple(None if t is None else ctx.tensor(t) for t in v))
        statics = tuple(_freeze(values[i]) for i in self.static)
        random = self.lowering.random
        if random:
            gen = rng.generator(ctx.device_index if ctx.device_index is not None else _current_device())
            runtime.extend(gen.next_key_inputs())
        if ctx.device_index is None:   # no tensor inputs (factories): the device argument decides
            ctx.device_index = _output_device(values, self)
        key = (self, tuple(specs), statics, tuple(ctx.storages), ctx.device_index)
        exe = _cache.get(key)
        if exe is None:
            exe = _cache[key] = self._plan(values, specs, ctx)
        if recorder is not None:   # adaptive eager: record now, run fused at the next sync point
            return recorder.record(self, exe, values, ctx)
        if exe.call is None:
            results = self._first_call(exe, bufs, runtime, values, ctx.device_index)
        else:
            metrics.cache_hits += 1
            results = exe.call(*bufs, *runtime)
        return self._finish(exe, results, values, addrs, ctx)

    def _finish(self, exe, results, values, addrs, ctx):
        device_index = ctx.device_index if ctx.device_index is not None else _output_device(values, self)
        outs = []
        k = 0
        for spec in exe.out_specs:
            if spec is None:
                outs.append(None)
                continue
            dtype, sizes, strides = spec
            outs.append(memory.new_buffer_tensor(results[k], dtype, device_index, sizes, strides))
            k += 1
        for slot in exe.writes:
            _records[addrs[slot]].buf = results[k]
            k += 1
        return self.returned(outs, values)

    def input_contiguous(self, values):
        """Whether the lowering's ``contiguity_of`` argument (a tensor or its meta) is C-contiguous."""
        name = self.lowering.contiguity_of
        return None if name is None else bool(values[self.index_of[name]].is_contiguous())

    def returned(self, outs, values):
        """What the op returns: its new outputs, and the mutated inputs its schema aliases."""
        if self.returns_list:
            return outs
        returned = []
        j = 0
        for src in self.return_sources:
            if src is None:
                returned.append(outs[j])
                j += 1
            else:
                returned.append(values[src])
        if not returned:
            return None
        return returned[0] if len(returned) == 1 else tuple(returned)

    # -- compile on a miss ----------------------------------------------------------------------
    def _plan(self, values, specs, ctx):
        """Shapes, dtypes and the traced body of this call's executable (not compiled yet)."""
        meta_out = self._run_meta(values)
        new_meta = _new_outputs(self, meta_out)
        out_specs = []
        for m in new_meta:
            if m is None:      # an output the caller masked off (backward ops' output_mask)
                out_specs.append(None)
                continue
            dtype = device_dtype(m.dtype, self.short_name)
            sizes, strides = tuple(m.shape), tuple(m.stride())
            if not layout.is_dense(sizes, strides):
                strides = memory.contiguous_strides(sizes)
            out_specs.append((dtype, sizes, strides))
        # Buffers written by this op, and the view of each mutated argument.
        write_targets = []
        for i in self.mutated:
            v = values[i]
            if v is None:
                continue
            for t in (v if isinstance(v, list | tuple) else (v,)):
                write_targets.append(_view_spec(t, ctx))
        writes = tuple(dict.fromkeys(slot for slot, _ in write_targets if slot is not None))
        promote_dtype = None
        if self.promote_idx is not None:
            promote_dtype = self._promotion_dtype(values, new_meta, meta_out)
        traced = _Traced(self, specs, values, out_specs, write_targets, writes, promote_dtype, ctx)
        return Executable(traced, out_specs, writes, self.short_name)

    def _first_call(self, exe, bufs, runtime, values, device_index):
        traced = exe.traced

        def run(*flat):  # a plain function: jit's dispatch is slower for callable objects
            return traced(*flat)

        # Results live on the op's device even when no input buffer pins it (factories, ops that
        # overwrite their only input).
        jitted = jax.jit(run, out_shardings=_sharding(device_index))
        # The first call traces and compiles; later calls take jit's C++ dispatch fast path
        # (a Compiled object's own __call__ is a much slower Python path).
        start = time.perf_counter()
        try:
            results = jitted(*bufs, *runtime)
        except Exception as err:
            raise RuntimeError(
                f"torchneuron: compiling aten::{self.short_name} failed for inputs "
                f"{_describe(values)}: {err}. This is a torchneuron bug: please report it with this "
                "message. Workaround: run this op on CPU (move its inputs with .cpu())."
            ) from err
        metrics.compile_seconds += time.perf_counter() - start
        metrics.executables_compiled += 1
        exe.call = jitted
        return results

    def _run_meta(self, values):
        if self.lowering.shape_from_lowering:
            return self._shape_from_lowering(values)
        meta_values = [_to_meta(v) for v in values]
        pos = [v for v, kw in zip(meta_values, self.kwarg_only) if not kw]
        kw = {n: v for n, v, k in zip(self.arg_names, meta_values, self.kwarg_only) if k}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return self.overload(*pos, **kw)
        except NotImplementedError:
            return self._shape_from_lowering(values)
        except (RuntimeError, IndexError, ValueError, TypeError) as err:
            # PyTorch's own shape/dtype check failed: keep its message, add the op and inputs.
            raise type(err)(f"{err}\n[torchneuron] in aten::{self.short_name}{_describe(values)}") from None

    def _shape_from_lowering(self, values):
        # No meta kernel: ask JAX for the output shapes of the lowering itself.
        spec_args = [_to_shape_struct(v) for v in values]
        # Tensors (and tensor lists) are traced; static arguments stay Python values.
        traced = [i for i, v in enumerate(spec_args) if _is_shape_tree(v)]

        def run(*arrays):
            args = list(spec_args)
            for i, a in zip(traced, arrays):
                args[i] = a
            pos = [v for v, kw in zip(args, self.kwarg_only) if not kw]
            kw = {n: v for n, v, k in zip(self.arg_names, args, self.kwarg_only) if k}
            if self.lowering.random:
                kw["key"] = jax.random.key(0)
            return self.lowering.fn(*pos, **kw)

        out = jax.eval_shape(run, *[spec_args[i] for i in traced])
        outs = out if isinstance(out, list | tuple) else (out,)
        from ..runtime.dtypes import torch_dtype
        metas = [torch.empty(o.shape, dtype=torch_dtype(o.dtype), device="meta") for o in outs]
        if self.returns_list:
            return metas
        return tuple(metas) if len(metas) > 1 else metas[0]

    def _promotion_dtype(self, values, new_meta, meta_out):
        if self.lowering.promote == "result":
            if new_meta:
                return device_dtype(new_meta[0].dtype, self.short_name)
            target = values[self.mutated[0]]
            return target.dtype
        operands = []
        for i in self.promote_idx:
            v = values[i]
            if isinstance(v, torch.Tensor):
                operands.append(v if v.device.type == "cpu" and v.dim() == 0 else
                                torch.empty(v.shape, dtype=v.dtype, device="meta"))
            elif v is not None:
                operands.append(v)
        if not operands:
            return None
        _, dtype = elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        return device_dtype(dtype, self.short_name)


class _KeyContext:
    """Collects the buffers, runtime scalars and device of one call while its key is built."""

    __slots__ = ("bufs", "addrs", "slots", "runtime", "device_index", "storages")

    def __init__(self, bufs, addrs, slots, runtime):
        self.bufs, self.addrs, self.slots, self.runtime = bufs, addrs, slots, runtime
        self.device_index = None
        # (numel, dtype) of each storage buffer: executables are compiled for exact buffer avals,
        # and two views with equal layouts can sit on storages of different sizes.
        self.storages = []

    def tensor(self, t):
        try:
            addr = t.untyped_storage().data_ptr()
        except AttributeError:
            # The dispatcher hands "wrapped numbers" (x * 2) to Python kernels as plain scalars.
            self.runtime.append(scalar_array(t))
            return type(t)
        rec = _records.get(addr)
        if rec is None:
            return self._unusual_tensor(t)
        if self.device_index is None:
            self.device_index = rec.device_index
        elif rec.device_index != self.device_index:
            raise device_mismatch_error(t, self.device_index)
        slot = self.slots.get(addr)
        if slot is None:
            slot = self.slots[addr] = len(self.bufs)
            self.bufs.append(rec.buf if rec.buf is not None else memory.empty_buffer(rec))
            self.addrs.append(addr)
            self.storages.append((rec.numel, rec.dtype))
        return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), slot)

    def _unusual_tensor(self, t):
        if t.device.type == "neuron":
            if t.numel() == 0:
                return ("empty", t.dtype, tuple(t.shape))
            memory.record_of(t)  # raises the freed-storage error
        if t.device.type == "cpu" and t.dim() == 0:
            # A 0-dim CPU tensor is a scalar operand, as on CUDA.
            self.runtime.append(np.asarray(t.item(), dtype=jax_dtype(t.dtype)))
            return ("cpu-scalar", t.dtype)
        raise device_mismatch_error(t, self.device_index if self.device_index is not None else _current_device())

    def scalar(self, v):
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        self.runtime.append(scalar_array(v))
        return type(v)


_scalar_arrays: dict = {}


def scalar_array(v):
    """A Python scalar as a (weakly typed) device array, cached by value: jit dispatch converts a
    Python number on every call, while an existing array goes straight through."""
    key = (v.__class__, v, v.__class__ is float and math.copysign(1.0, v) < 0)
    arr = _scalar_arrays.get(key)
    if arr is None:
        if v != v or len(_scalar_arrays) > 4096:  # NaN never hits a dict; keep the cache bounded
            return v
        arr = _scalar_arrays[key] = _weak_scalar(v)
    return arr


# What jnp.asarray makes of each Python scalar type (x64 mode): (numpy dtype, weakly typed).
_SCALAR_TYPES = {bool: (np.bool_, False), int: (np.int64, True), float: (np.float64, True),
                 complex: (np.complex128, True)}


def _weak_scalar(v):
    """``jnp.asarray(v)`` in a quarter of the time: a new runtime scalar per step (an optimizer's
    bias corrections) would otherwise cost ~60 us each."""
    kind = _SCALAR_TYPES.get(v.__class__)
    if kind is None:
        return jnp.asarray(v)
    try:
        host = np.asarray(v, dtype=kind[0])
    except OverflowError:
        return jnp.asarray(v)   # raises JAX's own error for an int beyond int64
    return pjrt.put(host, 0, weak=kind[1], committed=False)


def _view_spec(t, ctx):
    """(buffer slot, view layout) of a mutated tensor; slot None for tensors with no elements."""
    slot = ctx.slots.get(t.untyped_storage().data_ptr()) if t.numel() else None
    return slot, (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _new_outputs(kernel, meta_out):
    if kernel.returns_list:
        return list(meta_out) if kernel.new_outputs else []
    outs = meta_out if isinstance(meta_out, tuple) else (meta_out,)
    return [o for o, src in zip(outs, kernel.return_sources) if src is None]


class _Traced:
    """The function jax.jit traces for one cache entry: read views, run the lowering, write back."""

    def __init__(self, kernel, specs, values, out_specs, write_targets, writes, promote_dtype, ctx):
        self.kernel = kernel
        self.specs = specs
        # Only static arguments are kept: the cache entry must not keep the first call's tensors
        # (and their device memory) alive.
        dynamic = set(kernel.dynamic)
        self.values = [None if i in dynamic else v for i, v in enumerate(values)]
        self.out_specs = out_specs
        self.write_targets = write_targets
        self.writes = writes
        self.promote_dtype = promote_dtype
        self.nbufs = len(ctx.bufs)
        # Part of the cache key already: the key holds every input's strides.
        self.contiguous = kernel.input_contiguous(values)

    def __call__(self, *flat):
        k = self.kernel
        bufs = flat[: self.nbufs]
        runtime = list(flat[self.nbufs:])
        rt = iter(runtime)
        values = list(self.values)
        for i, spec in zip(k.dynamic, self.specs):
            kind = k.kinds[i]
            if kind in (_TENSOR_LIST, _OPT_TENSOR_LIST):
                values[i] = [None if s is None else _materialise(s, bufs, rt) for s in spec]
            elif spec is None:
                values[i] = None
            else:
                values[i] = _materialise(spec, bufs, rt)
        key = None
        if k.lowering.random:
            seed, offset = runtime[-2], runtime[-1]
            key = jax.random.fold_in(jax.random.key(seed), offset)
        mutated_vals, new_vals = call_lowering(k, values, self.promote_dtype, key, len(self.write_targets),
                                               len(self.out_specs), self.contiguous)
        outputs = []
        for value, spec in zip(new_vals, self.out_specs):
            if spec is None:
                continue
            dtype, sizes, strides = spec
            value = _cast(jnp.asarray(value), dtype)
            if tuple(value.shape) != tuple(sizes):
                if value.size == int(np.prod(sizes)) and value.ndim == 0:
                    value = value.reshape(sizes)
                else:
                    raise RuntimeError(
                        f"torchneuron: lowering of aten::{k.short_name} produced shape {tuple(value.shape)}, "
                        f"PyTorch expects {tuple(sizes)} (a bug in the lowering)"
                    )
            outputs.append(layout.to_layout(value, sizes, strides))
        new_bufs = {}
        for (slot, (dtype, sizes, strides, offset)), value in zip(self.write_targets, mutated_vals):
            if value is None or slot is None:
                continue
            base = new_bufs.get(slot, bufs[slot])
            value = jnp.broadcast_to(_cast(jnp.asarray(value), dtype), sizes)
            new_bufs[slot] = layout.write(base, value, jax_dtype(dtype), sizes, strides, offset)
        written = [new_bufs.get(slot, bufs[slot]) for slot in self.writes]
        return tuple(outputs) + tuple(written)


def call_lowering(k, values, promote, key, n_mut, n_new, contiguous=None):
    """Run ``k``'s lowering on materialised arguments: the convention eager kernels and
    torch.compile graphs share.

    ``values`` holds the arguments in schema order (tensors as jax arrays) and is updated in place.
    Arguments named by the lowering's promotion are cast to ``promote`` (a torch dtype or None);
    ``key`` is the PRNG key of a random lowering; ``contiguous`` whether the lowering's
    ``contiguity_of`` argument is C-contiguous. Returns (new values of the ``n_mut`` mutated
    tensors, the ``n_new`` new outputs) -- a lowering returns the mutated arguments first.
    """
    if promote is not None:
        for i in k.promote_idx:
            v = values[i]
            if v is None:
                continue
            if i in k.static:
                # Static Scalars (static_scalars lowerings) are compiled-in Python numbers.
                if k.kinds[i] in (_SCALAR, _OPT_SCALAR):
                    values[i] = jnp.asarray(v, dtype=jax_dtype(promote))
            else:
                values[i] = _cast(v, promote)
    kw = {}
    if k.lowering.random:
        kw["key"] = key
    if k.lowering.contiguity_of is not None:
        kw["contiguous"] = contiguous
    if k.lowering.overwrites:
        for i in k.mutated:
            if isinstance(values[i], jax.Array):
                values[i] = jnp.zeros(values[i].shape, values[i].dtype)
    pos = [v for v, kwo in zip(values, k.kwarg_only) if not kwo]
    kw.update({n: v for n, v, kwo in zip(k.arg_names, values, k.kwarg_only) if kwo})
    result = k.lowering.fn(*pos, **kw)
    if k.functional is not None and not isinstance(result, tuple):
        # In-place forms of list ops (_foreach_add_) mutate every tensor of the list.
        result = tuple(result) if isinstance(result, list) else (result,)
    results = list(result) if isinstance(result, list | tuple) else [result]
    # Mutated arguments come first in what a lowering returns, then new outputs.
    mutated_vals = results[:n_mut] if k.mutated else []
    new_vals = results[n_mut:] if k.mutated else results
    if k.returns_list and len(new_vals) == 1 and isinstance(new_vals[0], list | tuple):
        new_vals = list(new_vals[0])
    if len(new_vals) != n_new or len(mutated_vals) != n_mut:
        raise RuntimeError(
            f"torchneuron: lowering of aten::{k.short_name} returned {len(results)} values; the "
            f"schema needs {n_mut} mutated + {n_new} new outputs (a bug in the lowering)"
        )
    return mutated_vals, new_vals


def _materialise(spec, bufs, rt):
    if isinstance(spec, type):          # a runtime Python scalar
        return next(rt)
    tag = spec[0]
    if tag == "empty":
        return jnp.zeros(spec[2], dtype=jax_dtype(spec[1]))
    if tag == "cpu-scalar":
        return next(rt)
    dtype, sizes, strides, offset, slot = spec
    return layout.read(bufs[slot], jax_dtype(dtype), sizes, strides, offset)


def _cast(value, dtype):
    target = jax_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype
    if isinstance(value, jax.Array) or hasattr(value, "dtype"):
        if jnp.iscomplexobj(value) and not jnp.issubdtype(target, jnp.complexfloating):
            # A real result of a complex input (abs, angle) is computed from the complex value:
            # casting the input to the real result type would drop its imaginary part.
            target = jnp.result_type(target, jnp.complex64)
        return value if value.dtype == target else value.astype(target)
    return jnp.asarray(value, dtype=target)


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu" and v.dim() == 0:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, list | tuple):
        return type(v)(_to_meta(x) for x in v)
    if isinstance(v, torch.device) and v.type == "neuron":
        return torch.device("meta")
    return v


def _to_shape_struct(v):
    if isinstance(v, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(v.shape), jax_dtype(v.dtype))
    if isinstance(v, list | tuple):
        return type(v)(_to_shape_struct(x) for x in v)
    return v


def _is_shape_tree(v) -> bool:
    if isinstance(v, list | tuple):
        return bool(v) and all(x is None or isinstance(x, jax.ShapeDtypeStruct) for x in v) \
            and any(x is not None for x in v)
    return isinstance(v, jax.ShapeDtypeStruct)


def _describe(values) -> str:
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(f"Tensor{list(v.shape)}:{str(v.dtype).replace('torch.', '')}@{v.device}")
        elif isinstance(v, list | tuple) and v and isinstance(v[0], torch.Tensor):
            parts.append("[" + ", ".join(_describe([x]) for x in v) + "]")
        else:
            parts.append(repr(v))
    return "(" + ", ".join(parts) + ")"


describe_args = _describe


def _sharding(device_index: int):
    from ..runtime import pjrt
    return jax.sharding.SingleDeviceSharding(pjrt.device(device_index))


def _current_device() -> int:
    from ..runtime import device as device_mod
    return device_mod.current_device()


def _output_device(values, kernel) -> int:
    for name in ("device",):
        i = kernel.index_of.get(name)
        if i is not None and values[i] is not None:
            dev = torch.device(values[i])
            if dev.index is not None:
                return dev.index
    return _current_device()


# -- tracing (torch.profiler ranges, readiness-report call sites) ---------------------------------
# Swapped in only while metrics.tracer is installed (torchneuron.profiler.update), so the plain hot
# path pays nothing, not even a None check. The compile hook wraps the cache-miss path that jits,
# compiles and first runs an executable.
_plain_call = Kernel.__call__
_plain_compile = Kernel._first_call


def _traced_call(self, *args, **kwargs):
    tracer = metrics.tracer
    if tracer is None:
        return _plain_call(self, *args, **kwargs)
    return tracer.kernel(self, _plain_call, args, kwargs)


def _traced_compile(self, *args):
    tracer = metrics.tracer
    if tracer is None:
        return _plain_compile(self, *args)
    return tracer.compile(self, _plain_compile, args)


def set_tracing(on: bool) -> None:
    Kernel.__call__ = _traced_call if on else _plain_call
    Kernel._first_call = _traced_compile if on else _plain_compile
