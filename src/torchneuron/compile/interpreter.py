"""What ``jax.jit`` traces for a graph: its FX nodes evaluated one by one on jax arrays.

Each node runs its registry lowering through the calling convention eager kernels use
(``ops.signature``: binding, promotion, casts, returns); output dtypes come from the nodes' fake
tensors (``meta['val']``) under the float64 policy. Inputs are read from their storage buffers
exactly as eager kernels read them, and mutated inputs are written back into their storages.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import torch

from ..ops import checks, cpu_dtypes
from ..runtime import inputs, layout
from ..runtime.dtypes import cast, cast_and_broadcast, device_dtype, jax_dtype
from ..runtime.inputs import Inputs, StableStorages
from .custom_kernels import run_auto_functionalized
from .errors import NodeFailure, meta_of
from .outputs import static_value


class Step:
    """One node to evaluate: ``kind`` is op/index_put (``signature`` an OpSignature), foreach
    (``signature`` a ForeachPlan), auto_functionalized (``signature`` the mutating custom kernel's),
    getitem or sym. ``args``: the arguments the signature binds when not the node's own (a fused
    pair's step, ``compile/fusions.py``)."""

    __slots__ = ("node", "kind", "signature", "args")

    def __init__(self, node, kind, signature=None, args=None):
        self.node, self.kind, self.signature, self.args = node, kind, signature, args

    @property
    def random(self) -> bool:
        sig = self.signature.base if self.kind == "foreach" else self.signature
        return sig is not None and sig.lowering.random

    @property
    def precision(self) -> str | None:
        """The float32 precision setting the step's lowering reads (ops/precision.py), if any."""
        sig = self.signature.base if self.kind == "foreach" else self.signature
        return sig.lowering.precision if sig is not None and sig.lowering is not None else None


def call_signature(args, stable: StableStorages):
    """(the collected buffers, runtime values and device, the specs) of one call's inputs
    (``runtime/inputs.py``); ``stable`` keeps the specs of the graph's parameters."""
    ins = Inputs()
    first = stable.collect(ins, args)
    if first is None:
        return ins, [ins.graph_arg(a) for a in args]
    specs = [None] * len(args)
    for i, spec in zip(stable.positions, first):
        specs[i] = spec
    graph_arg = ins.graph_arg
    for i in stable.others:
        specs[i] = graph_arg(args[i])
    return ins, specs


class _Flat:
    """The value of a whole contiguous storage kept in its buffer's flat shape. Elementwise foreach
    steps (an optimizer's update) and ``copy_`` back into the storage work on it as it is, so the
    program has no reshape between a written storage's input and output buffers: with one there,
    XLA:CPU copies each such buffer before updating it and recomputes the update per output (a
    foreach AdamW step ran 3x slower). Other steps see it reshaped (``shaped``)."""

    __slots__ = ("array", "shape", "_shaped")

    def __init__(self, array, shape):
        self.array, self.shape, self._shaped = array, tuple(shape), None

    def shaped(self):
        if self._shaped is None:
            self._shaped = self.array.reshape(self.shape)
        return self._shaped


def _unflat(value):
    return value.shaped() if value.__class__ is _Flat else value


@functools.lru_cache(maxsize=1024)
def _flat_meta(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor standing for a flat value's metadata in its step's dtype rules."""
    return torch.empty((numel,), dtype=dtype, device="meta")


class Interpreter:
    """The graph as a pure function of (storage buffers..., runtime values...). After tracing,
    ``writes`` and ``host_writes`` say which results are new buffers of written storages and new
    values of mutated CPU inputs."""

    def __init__(self, program, specs, nbufs):
        self.p = program
        self.specs = specs
        self.nbufs = nbufs
        self.writes = ()
        self.host_writes = ()
        # After tracing: ((check, op), ...) of the device checks whose outcome is the last result.
        self.checks = ()

    def __call__(self, *flat):
        p = self.p
        bufs = flat[: self.nbufs]
        rt = iter(flat[self.nbufs:])
        env = {}
        # Flat storage buffers of device inputs, for as_strided (which indexes the whole storage),
        # and the storage offsets that are runtime inputs.
        self.storages = {}
        offsets = []
        slots = collections.Counter(spec[inputs.SLOT] for spec in self.specs if inputs.is_view(spec))
        for ph, spec in zip(p.placeholders, self.specs):
            if _whole_storage(spec, bufs, slots):
                env[ph], offset = _Flat(bufs[spec[inputs.SLOT]], spec[inputs.SIZES]), 0
            else:
                env[ph], offset = inputs.read(spec, bufs, rt)
            offsets.append(offset)
            if inputs.is_view(spec):
                self.storages[ph] = (bufs[spec[inputs.SLOT]], spec[inputs.DTYPE],
                                     None if spec[inputs.OFFSET] is not None else offset)
        for node, value in p.constants.items():
            env[node] = jnp.asarray(value)
        base_key = None
        if p.random:
            seed, offset = next(rt), next(rt)
            base_key = jax.random.fold_in(jax.random.key(seed), offset)
        self.mutations = {}
        self.ph_index = {ph: i for i, ph in enumerate(p.placeholders)}
        found = []
        with checks.collecting() if p.device_checks != "off" else checks.suspended() as sink:
            for n, step in enumerate(p.steps):
                before = len(sink) if sink is not None else 0
                try:
                    self._run(step, env, base_key, n)
                except NodeFailure:
                    raise
                except Exception as err:  # noqa: BLE001 - reported with the node that failed
                    raise NodeFailure(step.node, err) from err
                if sink is not None and len(sink) > before:
                    op = step.signature.name if step.kind != "foreach" else str(step.node.target)
                    found.extend((entry, op) for entry in sink[before:])
        self.checks = tuple((entry[-1], op) for entry, op in found)
        outputs = []
        for kind, what, dtype, sizes, strides in p.output_plan.buffers:
            if kind == "node":
                value = cast_and_broadcast(_unflat(env[what]), dtype, what.meta["val"].shape)
                outputs.append(layout.to_layout(value, sizes, strides))
                continue
            storage = jnp.zeros(sizes, jax_dtype(dtype))
            for node, vsizes, vstrides, voffset in what:
                value = cast_and_broadcast(_unflat(env[node]), dtype, vsizes)
                storage = layout.write(storage, value, jax_dtype(dtype), vsizes, vstrides, voffset)
            outputs.append(storage)
        host = [jnp.asarray(_unflat(env[node])) for node in p.output_plan.host_outputs]
        # Input mutations: device storages get their new buffers, CPU inputs their new values.
        new_bufs = {}
        host_writes = []
        for i, value in self.mutations.items():
            spec = self.specs[i]
            if spec is None or spec[0] == inputs.EMPTY:
                continue
            if spec[0] == inputs.HOST:
                host_writes.append((i, cast(_unflat(value), spec[1])))
                continue
            if value.__class__ is _Flat:   # the whole storage, in its buffer's shape and dtype
                new_bufs[spec[inputs.SLOT]] = value.array
                continue
            inputs.write_back(new_bufs, bufs, spec, value, offsets[i])
        self.writes = tuple(new_bufs)
        self.host_writes = tuple(i for i, _ in host_writes)
        return (tuple(outputs) + tuple(host) + tuple(new_bufs[s] for s in self.writes)
                + tuple(v for _, v in host_writes)
                + ((checks.pack([entry for entry, _ in found]),) if found else ()))

    # -- one node ----------------------------------------------------------------------------------
    def _run(self, step, env, base_key, n):
        node = step.node
        kind = step.kind
        if kind == "getitem":
            src, idx = node.args
            env[node] = _unflat(env[src])[idx]
            return
        if kind == "sym":
            env[node] = static_value(node)
            return
        key = jax.random.fold_in(base_key, n) if base_key is not None else None
        if kind == "foreach":
            env[node] = self._foreach(step, env, key)
            return
        if kind == "auto_functionalized":
            env[node] = run_auto_functionalized(step.signature, node, lambda v: _lookup(v, env), meta_of)
            return
        sig = step.signature
        values = (sig.bind(node.args, node.kwargs, missing=None) if step.args is None
                  else sig.bind(step.args, {}, missing=None))
        if sig.name == "aten::copy_" and self._copy_flat(node, values, env):
            return
        metas = [meta_of(v) for v in values]
        cpu_dtypes.graph_check(sig, metas)   # rules such as sub of a bool, _foreach_* element by element
        sig.check_dtypes(metas)
        arrays = [_lookup(v, env) for v in values]
        if sig.name == "aten::as_strided":
            arrays[0], runtime_offset = self._storage_of(values[0], arrays[0])
            if len(arrays) < 4 or arrays[3] is None:   # as_strided keeps its input's storage offset
                # (this call's, where the input's offset is a runtime value; an offset the graph
                # gives is absolute in the storage)
                arrays[3:] = [metas[0].storage_offset() if runtime_offset is None else runtime_offset]
        if kind == "index_put" and any(i is not None and i.dtype == jnp.bool_ for i in arrays[1]):
            env[node] = _bool_mask_index_put(arrays[0], arrays[1], arrays[2], bool(arrays[3]),
                                             node.meta["val"].dtype)
            return
        if sig.returns_list and key is None and not sig.mutated and sig.name.startswith("aten::_foreach_"):
            flat = _flat_lists(values, metas, node.meta.get("val"), env)
            if flat is not None:   # every tensor a whole storage of its result's shape: computed flat
                result, _ = _apply(sig, values, *flat, None)
                env[node] = [_Flat(r, m.shape) for r, m in zip(result, node.meta["val"])]
                return
        result, mutated = _apply(sig, values, arrays, metas, node.meta.get("val"), key)
        # Mutated arguments: later nodes see the new value; graph inputs are written back.
        for arg, value in mutated:
            env[arg] = value
            if arg in self.ph_index:
                self.mutations[self.ph_index[arg]] = value
            elif arg.op != "call_function":
                raise RuntimeError(f"in-place update of {arg.op} {arg.name} is not supported")
        env[node] = result

    def _foreach(self, step, env, key):
        plan = step.signature
        sig = plan.base
        fvalues = plan.signature.bind(step.node.args, step.node.kwargs, missing=None)
        out_meta = step.node.meta.get("val") or []
        lists = [fvalues[i] for i, how in plan.mapping.values() if how == "list"]
        count = len(lists[0]) if lists else len(out_meta)
        results = []
        for e in range(count):
            values = sig.bind((), {}, missing=None)
            metas, arrays = list(values), list(values)
            for j, (i, how) in plan.mapping.items():
                v = fvalues[i]
                if how == "list":
                    v = v[e]
                if how == "index":
                    # _foreach_*.Tensor: element e's scalar is entry e of a 1-D tensor.
                    arrays[j] = _lookup(v, env)[e]
                    metas[j] = 0.0 if meta_of(v).dtype.is_floating_point else 0
                    values[j] = None
                else:
                    values[j], metas[j], arrays[j] = v, meta_of(v), _lookup(v, env)
            ekey = jax.random.fold_in(key, e) if key is not None else None
            value, _ = _apply(sig, values, arrays, metas, out_meta[e] if e < len(out_meta) else None, ekey)
            results.append(value)
        return results

    def _copy_flat(self, node, values, env) -> bool:
        """``copy_(dst, src)`` of a flat value into a flat graph input of its shape and dtype: the
        input's new value, flat (``_Flat``). False when another case (the lowering handles it)."""
        dst, src = values[0], values[1]
        if not (isinstance(dst, torch.fx.Node) and isinstance(src, torch.fx.Node) and dst in self.ph_index):
            return False
        old, new = env[dst], env[src]
        if not (old.__class__ is _Flat and new.__class__ is _Flat and old.shape == new.shape
                and old.array.dtype == new.array.dtype):
            return False
        value = _Flat(new.array, old.shape)
        env[dst] = env[node] = value
        self.mutations[self.ph_index[dst]] = value
        return True

    def _storage_of(self, node, value):
        """(storage, the input's runtime storage offset or None) for as_strided, which indexes the
        storage: a graph input's whole storage buffer when its element type is the input's;
        otherwise the input written into a storage of its storage's size."""
        stored = self.storages.get(node)
        if stored is not None and jax_dtype(stored[1]) == stored[0].dtype:
            return stored[0], stored[2]
        return _rebuilt_storage(node, value), None


def _apply(sig, values, arrays, metas, out_meta, key):
    """One call of ``sig``'s lowering: (the node's value, [(mutated argument node, its new value)])."""
    new_meta = sig.new_output_metas(out_meta)
    promote = sig.promotion_dtype(metas, new_meta) if sig.promote_idx is not None else None
    targets = sig.mutated_tensors(metas)
    mutated_vals, new_vals = sig.call_lowering(arrays, promote, key, len(targets), len(new_meta),
                                               sig.input_contiguous(metas))
    outs = []
    for value, m in zip(new_vals, new_meta):
        if m is None:
            outs.append(None)
            continue
        if value is None:
            raise RuntimeError(f"lowering of {sig.name} returned None for a requested output")
        outs.append(sig.fit_output(value, device_dtype(m.dtype, sig.short_name), m.shape, reshape_same_size=True))
    # What a return aliasing a mutated argument gives back: that argument's new value.
    sources = [None] * len(values)
    mutated = []
    for (i, pos, m), value in zip(targets, mutated_vals):
        if value is None:
            continue
        new = cast_and_broadcast(value, device_dtype(m.dtype, sig.short_name), m.shape)
        if pos == 0:
            sources[i] = new
        arg = values[i][pos] if isinstance(values[i], list | tuple) else values[i]
        if isinstance(arg, torch.fx.Node):
            mutated.append((arg, new))
    if sig.returns_list:
        return outs, mutated
    return sig.returned(outs, sources), mutated


def _rebuilt_storage(node, value):
    m = meta_of(node)
    if not isinstance(m, torch.Tensor):
        return value
    sizes, strides, offset = tuple(m.shape), m.stride(), m.storage_offset()
    if layout.is_contiguous(sizes, strides) and offset == 0:
        return value
    numel = m.untyped_storage().nbytes() // m.element_size()
    storage = jnp.zeros((numel,), value.dtype)
    return layout.write(storage, value, value.dtype, sizes, strides, offset)


def _flat_lists(values, metas, out_meta, env):
    """(arrays, metas, output metas) of a foreach op with every tensor flat (``_Flat`` values of
    their results' shapes), or None where one is not."""
    if not isinstance(out_meta, list | tuple) or not out_meta:
        return None
    shapes = [tuple(m.shape) for m in out_meta]
    arrays, flat_metas = [], []
    for v, m in zip(values, metas):
        if isinstance(v, torch.fx.Node):
            return None   # a single tensor (the scalars of a .Tensor overload): the shaped path
        if isinstance(v, list | tuple) and v and isinstance(v[0], torch.fx.Node):
            found = [env[x] for x in v]
            if len(found) != len(shapes) or any(f.__class__ is not _Flat or f.shape != shape
                                                for f, shape in zip(found, shapes)):
                return None
            arrays.append([f.array for f in found])
            flat_metas.append([_flat_meta(f.array.shape[0], t.dtype) for f, t in zip(found, m)])
        else:
            arrays.append(_lookup(v, env))
            flat_metas.append(m)
    return arrays, flat_metas, [_flat_meta(t.numel(), t.dtype) for t in out_meta]


def _whole_storage(spec, bufs, slots) -> bool:
    """``spec`` reads all of a storage no other input reads, contiguously and in its buffer's
    element type: its value may stay in the buffer's flat shape (``_Flat``)."""
    if not inputs.is_view(spec) or spec[inputs.OFFSET] != 0 or slots[spec[inputs.SLOT]] != 1:
        return False
    buf = bufs[spec[inputs.SLOT]]
    sizes = spec[inputs.SIZES]
    numel = 1
    for n in sizes:
        numel *= n
    return (buf.ndim == 1 and buf.shape[0] == numel and numel > 0
            and buf.dtype == jax_dtype(spec[inputs.DTYPE]) and layout.is_contiguous(sizes, spec[inputs.STRIDES]))


def _lookup(v, env):
    if isinstance(v, torch.fx.Node):
        return _unflat(env[v])
    if isinstance(v, list | tuple):
        return [_lookup(x, env) for x in v]
    return v


def _bool_mask_index_put(self, indices, values, accumulate, dtype):
    """``x[mask] = v`` inside a graph, without the data-dependent nonzero eager mode uses."""
    masks = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or masks[0][1].dtype != jnp.bool_:
        raise RuntimeError("boolean-mask index_put mixed with other indices needs data-dependent shapes")
    p, mask = masks[0]
    lead, trailing = self.shape[:p], self.shape[p + mask.ndim:]
    full = mask.reshape((1,) * p + mask.shape + (1,) * len(trailing))
    # ``self[mask]`` is [*lead, k, *trailing] (k True positions) and values broadcast to it from the
    # right: a values dim at the k position takes its k-th entry at the k-th True position (a running
    # count of the mask); values without one (a row, a scalar) repeat at every True position.
    values = values.astype(self.dtype).reshape((1,) * (len(lead) + 1 + len(trailing) - values.ndim) + values.shape)
    if values.shape[p] == 1:
        values = values.reshape(values.shape[:p] + (1,) * mask.ndim + values.shape[p + 1:])
    else:
        pos = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, values.shape[p] - 1)
        values = jnp.take(values, pos, axis=p).reshape(values.shape[:p] + mask.shape + values.shape[p + 1:])
    values = jnp.broadcast_to(values, self.shape)
    out = self + jnp.where(full, values, 0).astype(self.dtype) if accumulate else jnp.where(full, values, self)
    return out.astype(jax_dtype(dtype))

