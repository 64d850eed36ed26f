"""Planning an eager kernel's executable for a new key: shapes and dtypes from PyTorch's meta
kernels, the checks CPU makes that meta kernels miss, the traced body, its compile (or load from the
persistent cache), and the errors a user sees when any of it fails.

``Planning`` is a part of ``eager.kernel.Kernel`` (its base class); ``Traced`` is the function
``jax.jit`` compiles: read each input from its storage buffer (``runtime/inputs.py``), call the
lowering through ``ops.signature``, lay out the outputs and write mutated views back.
"""

from __future__ import annotations

import time
import warnings

import jax
import torch
from jax._src import config as jax_config

from ..config import config
from ..metrics import metrics
from ..ops import checks, cpu_dtypes
from ..ops.registry import InvalidArguments, NotImplementedForDtype
from ..ops.signature import OPT_TENSOR_LIST, TENSOR_LIST
from ..runtime import donation, executable_store, inputs, layout, memory, pjrt
from ..runtime.device import current_device, device_mismatch_error
from ..runtime.dtypes import device_dtype, dtype_name, jax_dtype, torch_dtype
from ..runtime.executable import Executable
from ..runtime.inputs import is_view
from . import oracle
from .key import describe, store_name


class Planning:
    """The cold path of an eager kernel: everything a call does only for a new cache key."""

    def _plan(self, values, specs, ctx):
        """Shapes, dtypes and the traced body of this call's executable (not compiled yet)."""
        if self.device_index_arg is not None:
            index = values[self.device_index_arg]
            if isinstance(index, torch.Tensor) and index.device.type == "cpu":   # a 0-dim one
                raise self.device_error(values, index, ctx.device_index)
        meta_out = self._run_meta(values)
        self._check_indices(values)
        # Then what CPU checks as it builds the op (the written tensors: devices, casting, overlaps),
        # then the kernel's dtypes: x[:-1] <<= x[1:] on floats is an overlap error first.
        mutated = self.mutated_tensors(values)
        aliased = bool(mutated) and self._check_writes(values, [t for _, _, t in mutated], ctx)
        cpu_dtypes.check(self, values, describe_args)
        try:
            self.check_dtypes(values)
        except RuntimeError as err:
            raise RuntimeError(f"{err}\n[torchneuron] in {self.name}{describe_args(values)}") from None
        new_meta = self.new_output_metas(meta_out)
        layouts = self.lowering.output_strides and self.lowering.output_strides(new_meta, values)
        out_specs = []
        for i, m in enumerate(new_meta):
            if m is None:      # an output the caller masked off (backward ops' output_mask)
                out_specs.append(None)
                continue
            dtype = device_dtype(m.dtype, self.short_name)
            sizes = tuple(m.shape)
            strides = tuple(layouts[i] if layouts and layouts[i] is not None else m.stride())
            if not layout.is_dense(sizes, strides):
                strides = memory.contiguous_strides(sizes)
            out_specs.append((dtype, sizes, strides))
        # Buffers written by this op: each mutated argument's view, by its position among the
        # inputs (None for a tensor without elements: nothing to write).
        positions = self._input_positions(specs)
        write_targets = [positions.get((i, pos)) for i, pos, _ in mutated]
        writes = tuple(dict.fromkeys(target[1][inputs.SLOT] for target in write_targets if target is not None))
        promote_dtype = None
        if self.promote_idx is not None:
            promote_dtype = self.promotion_dtype(values, new_meta)
        traced = Traced(self, specs, values, out_specs, write_targets, writes, promote_dtype, ctx)
        exe = Executable(None, self.short_name, writes, traced.mode, traced=traced, out_specs=out_specs)
        # The storages it writes donate their buffers: XLA updates them where they are.
        exe.donated = donation.argnums(writes)
        exe.aliased = aliased
        exe.single = (not writes and len(out_specs) == 1 and out_specs[0] is not None
                      and not self.returns_list and self.return_sources == [None])
        return exe

    def _check_indices(self, values):
        """CPU's error for index tensors the meta kernels let through: a floating-point or complex
        index (CPU: "tensors used as indices must be long, int, byte or bool tensors", an IndexError
        for index/index_put, each op's own message for index_fill, put, gather...), and a boolean
        mask whose shape is not the indexed dimensions'. Plain eager met them when the executable
        failed to compile (and replayed the call on CPU then); adaptive eager compiles later,
        without the call's values: it raised a compile error, or ran the mask."""
        for name, v in zip(self.arg_names, values):
            if name not in ("index", "indices"):
                continue
            for t in (v if isinstance(v, list | tuple) else (v,)):
                if not isinstance(t, torch.Tensor):
                    continue
                wrong = t.is_floating_point() or t.is_complex()
                if wrong or (isinstance(v, list | tuple) and t.dtype in (torch.bool, torch.uint8)):
                    err = self._cpu_error(values)
                    if err is not None:
                        raise err
                    if wrong and isinstance(v, list | tuple):   # no CPU verdict (too large): its rule
                        raise IndexError("tensors used as indices must be long, int, byte or bool "
                                         f"tensors\n[torchneuron] in {self.name}{describe_args(values)}")

    def _input_positions(self, specs):
        """(argument index, position in its list) -> (read position, view spec) of each input that
        is a view of a storage buffer; the read position counts every input spec in key order."""
        found = {}
        n = 0
        for (i, kind), spec in zip(self.inputs, specs):
            items = spec if kind in (TENSOR_LIST, OPT_TENSOR_LIST) and spec is not None else (spec,)
            for pos, s in enumerate(items):
                if is_view(s):
                    found[(i, pos)] = (n, s)
                n += 1
        return found

    def _check_writes(self, values, mutated, ctx):
        """PyTorch's rules for the tensors an op writes, which its meta kernel may not apply: they
        live on the op's device (CUDA's rule), an in-place result must be castable to them
        ("result type Float can't be cast to the desired output type Long"), and they may not
        overlap themselves or another argument. Once per cache entry, except the overlap of views of
        one storage, whose offsets are runtime inputs: True when a later call with this key must
        check that again (``Executable.aliased``)."""
        for t in mutated:
            if t.device.type != "neuron" or (ctx.device_index is not None and t.device.index != ctx.device_index):
                raise device_mismatch_error(t, ctx.device_index if ctx.device_index is not None else current_device())
        if self.functional is not None:
            pos, kw = self.split_call([to_meta(v) for v in values])
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = self.functional(*pos, **kw)
            except (RuntimeError, IndexError, ValueError, TypeError):
                # The functional form cannot judge this call (pow_.Scalar's functional twin takes a
                # Scalar self): CPU does, once per cache entry.
                err = self._cpu_error(values)
                if err is not None:
                    raise err from None
                result = None
            result = result[0] if isinstance(result, tuple | list) else result
            target = mutated[0]
            if isinstance(result, torch.Tensor) and not torch.can_cast(result.dtype, target.dtype):
                raise self._cpu_error(values) or RuntimeError(
                    f"result type {dtype_name(result.dtype)} can't be cast to the desired output type "
                    f"{dtype_name(target.dtype)}\n[torchneuron] in {self.name}{describe_args(values)}")
        self.check_overlaps(values)
        return oracle.shares_storage(mutated, self.other_tensors(values))

    def check_overlaps(self, values):
        """CPU's "unsupported operation" error if a written tensor overlaps itself or another
        argument (see oracle.check_overlaps)."""
        oracle.check_overlaps(self, values, describe_args)

    def _cpu_error(self, values):
        """CPU's error for this call (see eager/oracle.py), with the op and inputs, or None."""
        err = oracle.cpu_error(self.overload, values, self.kwarg_only, self.arg_names)
        return None if err is None else oracle.as_cpu_error(err, self.name, describe_args(values))

    def first_call(self, exe, bufs, runtime, values, device_index):
        """Make the executable callable: load it from the persistent cache, or compile it (and
        store it there); then run it once."""
        start = time.perf_counter()
        name = store_name(exe.key) if executable_store.enabled() else None
        loaded = executable_store.load("eager", name, [pjrt.device(device_index)]) if name else None
        if loaded is not None:
            # A loaded executable is never traced: whatever the hot path needs from tracing must
            # be stored in the entry's metadata (``store`` below) and restored here.
            exe.call = loaded[0]
            exe.traced.checks = tuple(loaded[1].get("checks", ()))   # pickled with the entry
            exe.donated = donation.donated_slots(exe.call)
            exe.split_single()
            metrics.eager_cache_loads += 1
            if executable_store.logging_lookups():
                executable_store.log("served", "eager", describe(exe.key))
            donation.make_private(bufs, exe.donated, device_index)
            try:
                results = exe.call(*bufs, *runtime)
            except Exception as err:
                memory.raise_if_out_of_memory(err, device_index)
                raise
            metrics.compile_seconds += time.perf_counter() - start
            return results
        traced = exe.traced

        def run(*flat):  # a plain function: jit's dispatch is slower for callable objects
            return traced(*flat)

        # Results live on the op's device even when no input buffer pins it (factories, ops that
        # overwrite their only input).
        jitted = jax.jit(run, out_shardings=sharding(device_index), donate_argnums=exe.donated)
        donation.make_private(bufs, exe.donated, device_index)
        args = donation.shapes_of([*bufs, *runtime]) if exe.donated and name is not None else None
        # The first call traces and compiles; later calls take jit's C++ dispatch fast path.
        # JAX's own persistent cache stays out of it: what it loads cannot be stored again.
        with jax_config.enable_compilation_cache(False):
            try:
                results = jitted(*bufs, *runtime)
            except Exception as err:
                memory.raise_if_out_of_memory(err, device_index)
                # A check only the CPU kernel makes (max() of nothing); adaptive eager's op-by-op
                # runs pass no values (the user's call was checked when it was recorded).
                cpu = self._cpu_error(values) if values else None
                if cpu is not None:
                    raise cpu from None
                self.raise_call_error(values, err)
            if name is not None:
                # The executable jit just compiled (its lowering and compile are cached in memory).
                # (lowered on the arguments' shapes: the call deleted the buffers it donated)
                executable_store.store("eager", name,
                                       lambda: jitted.lower(*(args or [*bufs, *runtime])).compile(),
                                       {"op": self.short_name, "checks": traced.checks}, describe(exe.key))
        if executable_store.logging_lookups():
            executable_store.log("compiled", "eager", describe(exe.key),
                                 *executable_store.miss_reason("eager", name))
        exe.split_single()
        metrics.compile_seconds += time.perf_counter() - start
        metrics.executables_compiled += 1
        metrics.eager_compiles[exe.reason] += 1
        exe.call = jitted
        return results

    def raise_call_error(self, values, err):
        """Raise what the user sees when tracing or compiling this call's executable failed."""
        if isinstance(err, NotImplementedForDtype):
            # A lowering rejecting a dtype as ATen's kernels do (ops.numerics.require_floating).
            raise NotImplementedForDtype(f"{err}\n[torchneuron] in {self.name}{describe_args(values)}") from None
        if isinstance(err, InvalidArguments):
            # A lowering rejecting an argument as ATen's kernel does: PyTorch's RuntimeError.
            raise RuntimeError(f"{err}\n[torchneuron] in {self.name}{describe_args(values)}") from None
        error = self.compile_error(values, err)
        if error is err:
            raise err
        raise error from err

    def compile_error(self, values, err) -> Exception:
        """The error to raise when tracing or compiling this call's executable fails."""
        return RuntimeError(
            f"torchneuron: compiling {self.name} failed for inputs {describe_args(values)}: {err}. This is "
            "a torchneuron bug: please report it with this message. Workaround: run this op on CPU "
            "(move its inputs with .cpu()).")

    def _run_meta(self, values):
        if self.lowering.shape_from_lowering:
            return self._shape_from_lowering(values)
        meta_values = [to_meta(v) for v in values]
        if self.generator_index is not None:   # some meta kernels (refs) refuse any generator
            meta_values[self.generator_index] = None
        pos, kw = self.split_call(meta_values)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return self.overload(*pos, **kw)
        except NotImplementedError:
            return self._shape_from_lowering(values)
        except (RuntimeError, IndexError, ValueError, TypeError, AssertionError) as err:
            # PyTorch's own shape/dtype check failed. Some meta kernels are Python references that
            # raise another type or text than the CPU kernel: CPU's error wins where it has one.
            cpu = self._cpu_error(values)
            if cpu is not None:
                raise cpu from None
            if oracle.replays(self.overload) and not oracle.too_large(values):
                # CPU ran the call the meta kernel refuses (nll_loss with a uint8 target: the meta
                # kernel's gather wants int32/int64): CPU is the oracle, the lowering gives shapes.
                try:
                    return self._shape_from_lowering(values)
                except Exception:   # noqa: BLE001 - the lowering cannot serve it: the meta error stands
                    pass
            # A meta kernel's AssertionError is a TORCH_CHECK in ATen's kernel: a RuntimeError.
            cls = RuntimeError if isinstance(err, AssertionError) else type(err)
            raise cls(f"{err}\n[torchneuron] in {self.name}{describe_args(values)}") from None

    def _shape_from_lowering(self, values):
        # No meta kernel: ask JAX for the output shapes of the lowering itself.
        spec_args = [_to_shape_struct(v) for v in values]
        # Tensors (and tensor lists) are traced; static arguments stay Python values.
        traced = [i for i, v in enumerate(spec_args) if _is_shape_tree(v)]

        def run(*arrays):
            args = list(spec_args)
            for i, a in zip(traced, arrays):
                args[i] = a
            pos, kw = self.split_call(args)
            if self.lowering.random:
                kw["key"] = jax.random.key(0)
            return self.lowering.fn(*pos, **kw)

        out = jax.eval_shape(run, *[spec_args[i] for i in traced])
        outs = out if isinstance(out, list | tuple) else (out,)
        if self.mutated:   # a lowering returns the mutated arguments first: not the op's outputs
            outs = outs[len(self.mutated_tensors(values)):]
        # None: an output the op leaves undefined (a bias gradient without a bias)
        metas = [None if o is None else torch.empty(o.shape, dtype=torch_dtype(o.dtype), device="meta")
                 for o in outs]
        if self.returns_list:
            return metas
        if not metas:   # only mutated arguments (a fused optimizer step): no new outputs
            return ()
        return tuple(metas) if len(metas) > 1 else metas[0]


class Traced:
    """The function jax.jit traces for one cache entry: read views, run the lowering, write back."""

    def __init__(self, kernel, specs, values, out_specs, write_targets, writes, promote_dtype, ctx):
        self.kernel = kernel
        self.specs = specs
        # (argument index, is a list) of each input, in key order.
        self.reads = [(i, kind in (TENSOR_LIST, OPT_TENSOR_LIST)) for i, kind in kernel.inputs]
        # Only static arguments are kept: the cache entry must not keep the first call's tensors
        # (and their device memory) alive.
        dynamic = set(kernel.dynamic)
        dynamic.add(kernel.generator_index)
        self.values = [None if i in dynamic else v for i, v in enumerate(values)]
        self.out_specs = out_specs
        self.write_targets = write_targets   # (read position, view spec) or None per mutated input
        self.writes = writes
        self.promote_dtype = promote_dtype
        self.nbufs = len(ctx.bufs)
        # Part of the cache key already: the key holds every input's strides.
        self.contiguous = kernel.input_contiguous(values)
        # Device checks (ops/checks.py): compiled in unless turned off (changing the setting clears
        # the cache); ``checks`` is known once traced: ((check, op), ...) of the extra last output.
        self.mode = config.device_checks
        self.checks = None

    def __call__(self, *flat):
        k = self.kernel
        bufs = flat[: self.nbufs]
        runtime = list(flat[self.nbufs:])
        rt = iter(runtime)
        values = list(self.values)
        offsets = []     # each input's storage offset (static or traced), in reading order
        for (i, is_list), spec in zip(self.reads, self.specs):
            if is_list and spec is not None:
                items = []
                for s in spec:
                    value, offset = inputs.read(s, bufs, rt)
                    items.append(value)
                    offsets.append(offset)
                values[i] = items
            else:
                values[i], offset = inputs.read(spec, bufs, rt)
                offsets.append(offset)
        key = None
        if k.lowering.random:
            seed, offset = runtime[-2], runtime[-1]
            key = jax.random.fold_in(jax.random.key(seed), offset)
        with checks.collecting() if self.mode != "off" else checks.suspended() as found:
            mutated_vals, new_vals = k.call_lowering(values, self.promote_dtype, key, len(self.write_targets),
                                                     len(self.out_specs), self.contiguous)
        found = found or ()
        self.checks = tuple((entry[-1], k.name) for entry in found)
        outputs = []
        for value, spec in zip(new_vals, self.out_specs):
            if spec is None:
                continue
            dtype, sizes, strides = spec
            outputs.append(layout.to_layout(k.fit_output(value, dtype, sizes), sizes, strides))
        new_bufs = {}
        for target, value in zip(self.write_targets, mutated_vals):
            if value is not None and target is not None:
                n, spec = target
                inputs.write_back(new_bufs, bufs, spec, value, offsets[n])
        written = [new_bufs.get(slot, bufs[slot]) for slot in self.writes]
        return tuple(outputs) + tuple(written) + ((checks.pack(found),) if found else ())


def to_meta(v):
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu" and v.dim() == 0:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, list | tuple):
        return type(v)(to_meta(x) for x in v)
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


def describe_args(values) -> str:
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(f"Tensor{list(v.shape)}:{str(v.dtype).replace('torch.', '')}@{v.device}")
        elif isinstance(v, list | tuple) and v and isinstance(v[0], torch.Tensor):
            parts.append("[" + ", ".join(describe_args([x]) for x in v) + "]")
        else:
            parts.append(repr(v))
    return "(" + ", ".join(parts) + ")"




def sharding(device_index: int):
    return jax.sharding.SingleDeviceSharding(pjrt.device(device_index))
