"""One ATen FX graph (what AOTAutograd hands a compiler) as one PJRT executable.

``GraphProgram`` checks at compile time that every node has a lowering in the one registry that
eager mode uses (``ops.registry``), then compiles lazily, per input signature:

* the signature of a call is each input's dtype, sizes, strides, storage offset and which inputs
  share a storage (views and non-contiguous inputs are read from their storage buffers inside the
  executable, exactly as eager kernels read them), so a new layout is a new executable;
* ``jax.jit`` traces an interpreter over the graph: each node runs its registry lowering with the
  promotion and output casts eager kernels use (``eager.kernel.call_lowering``), output dtypes come
  from the nodes' fake tensors (``meta['val']``) under the float64 policy;
* input mutations (BatchNorm running stats, optimizer steps) are written back into the inputs'
  storages, outputs that are graph inputs or views of them are returned as real aliases, random
  nodes draw keys from the device generator (reproducible under ``torch.manual_seed``).
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..config import config
from ..eager import layout
from ..eager.kernel import _REQUIRED, Kernel, _cast, _new_outputs, call_lowering, device_mismatch_error
from ..metrics import metrics
from ..ops import registry
from ..runtime import memory, rng, transfers
from ..runtime.dtypes import device_dtype, jax_dtype
from . import cache

_records = memory.allocator.records
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_AS_STRIDED = torch.ops.aten.as_strided.default.redispatch

# Nodes that only check metadata at trace time.
_NOOPS = frozenset({
    "_assert_tensor_metadata.default", "_assert_scalar.default", "_functional_assert_async.msg",
    "_assert_async.default", "_assert_async.msg", "sym_constrain_range_for_size.default",
    "sym_constrain_range.default", "_print.default",
})
# Ops whose value is a Python int known from the fake tensors (shapes are static).
_SYM = frozenset({"sym_size.int", "sym_numel.default", "sym_stride.int", "sym_storage_offset.default"})
_INDEX_PUT = frozenset({"index_put.default", "_unsafe_index_put.default", "_index_put_impl_.default"})


class NeuronCompileError(RuntimeError):
    """A graph torch.compile(backend="neuron") cannot turn into an executable."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


def op_name(op) -> str:
    """Registry spelling of an overload: "add.Tensor", "view.default"."""
    schema = op._schema
    return f"{schema.name.split('::', 1)[1]}.{schema.overload_name or 'default'}"


_kernel_cache: dict = {}


def kernel_for(op):
    """The schema-driven ``Kernel`` (schema facts + registry lowering) of an overload, or None."""
    if op in _kernel_cache:
        return _kernel_cache[op]
    k = None
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
        name = op_name(op)
        low = registry.get(name)
        if low is not None:
            k = Kernel(op, low)
        else:
            # In-place variants eager derives from a functional lowering (add_.Tensor).
            from ..eager import registration
            candidate = registration._kernels.get(name)
            if isinstance(candidate, Kernel):
                k = candidate
    _kernel_cache[op] = k
    return k


# -- foreach ops: lowered element by element through their base op's lowering ------------------
_FOREACH_BASE_CANDIDATES = {
    "List": ("Tensor", "default", "Tensor_Tensor"),
    "Scalar": ("Tensor_Scalar", "Scalar", "default", "Tensor"),
    "ScalarList": ("Tensor_Scalar", "Scalar", "default", "Tensor"),
    "Tensor": ("Tensor", "default", "Tensor_Tensor"),
    "ScalarAndTensor": ("Scalar",),
    "default": ("default",),
}
# foreach spellings whose base op has another name.
_FOREACH_RENAMES = {
    ("maximum", "Scalar"): "clamp_min.default", ("maximum", "ScalarList"): "clamp_min.default",
    ("minimum", "Scalar"): "clamp_max.default", ("minimum", "ScalarList"): "clamp_max.default",
    ("clamp_min", "List"): "maximum.default", ("clamp_max", "List"): "minimum.default",
    ("norm", "Scalar"): "linalg_vector_norm.default", ("copy", "default"): "copy.default",
}


def _elem_type(t: str) -> str:
    return {"List[Tensor]": "Tensor", "List[number]": "number", "List[Optional[Tensor]]": "Tensor"}.get(t, t)


class ForeachPlan:
    """``_foreach_<op>.<ov>(lists...)``: the base op's kernel and how each argument maps onto it."""

    def __init__(self, op, base_kernel, mapping):
        self.op = op
        self.kernel = base_kernel
        self.mapping = mapping        # base arg index -> (foreach arg index, how) ; how: list/same/index


def foreach_plan(op):
    schema = op._schema
    name = schema.name.split("::", 1)[1]
    if not name.startswith("_foreach_") or any(a.alias_info is not None and a.alias_info.is_write
                                               for a in schema.arguments):
        return None
    base = name[len("_foreach_"):]
    ov = schema.overload_name or "default"
    packet = getattr(torch.ops.aten, base, None)
    if (base, ov) in _FOREACH_RENAMES:
        pname, _, bov = _FOREACH_RENAMES[(base, ov)].partition(".")
        cands = [getattr(getattr(torch.ops.aten, pname), bov)]
    elif packet is None:
        return None
    else:
        cands = [getattr(packet, c) for c in _FOREACH_BASE_CANDIDATES.get(ov, ("default",))
                 if c in packet.overloads()]
    fargs = schema.arguments
    for cand in cands:
        k = kernel_for(cand)
        if k is None:
            continue
        bargs = cand._schema.arguments
        by_name = {a.name: i for i, a in enumerate(fargs)}
        mapping, used, ok = {}, set(), True
        positional = [i for i, a in enumerate(fargs) if a.name not in {b.name for b in bargs}]
        for j, b in enumerate(bargs):
            i = by_name.get(b.name)
            if i is None:
                # Unnamed counterparts line up by position (self/other/scalar, tensor1/2/value).
                i = j if j < len(fargs) and j in positional and j not in used else None
            if i is None:
                continue
            used.add(i)
            ft, bt = str(fargs[i].type), str(b.type)
            et = _elem_type(ft)
            if ft.startswith("List[") and et in (bt, bt.replace("Optional[", "").rstrip("]")):
                mapping[j] = (i, "list")
            elif ft == "Tensor" and bt == "number":
                mapping[j] = (i, "index")      # _foreach_addcdiv.Tensor: one scalar per element
            elif ft == bt or (ft.startswith("Optional[") and ft[9:-1] == bt) or bt == f"Optional[{ft}]":
                mapping[j] = (i, "same")
            else:
                ok = False
                break
        if ok and used == set(range(len(fargs))):
            return ForeachPlan(op, k, mapping)
    return None


# -- errors that name the op and the user's line -------------------------------------------------
def _describe_meta(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor{list(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_describe_meta(x) for x in v) + "]"
    return repr(v)


def describe_node(node) -> str:
    args = [_describe_meta(_meta_of(a)) for a in node.args]
    args += [f"{k}={_describe_meta(_meta_of(v))}" for k, v in node.kwargs.items()]
    return "(" + ", ".join(args) + ")"


def _meta_of(v):
    if isinstance(v, torch.fx.Node):
        return v.meta.get("val", v.name)
    if isinstance(v, list | tuple):
        return type(v)(_meta_of(x) for x in v)
    return v


_TORCH_DIR = os.path.dirname(torch.__file__)


def user_source(node) -> str:
    """The user's source line that produced ``node`` (from the trace's stack), or ''."""
    stack = node.meta.get("stack_trace") or ""
    lines = stack.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if not frames:
        return ""
    # The innermost frame outside torch itself is the user's line.
    pick = next((i for i in reversed(frames) if _TORCH_DIR not in lines[i]), frames[-1])
    return "\n".join(x.rstrip() for x in lines[pick:pick + 2])


def _target_name(node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.name()
    return getattr(t, "__name__", str(t))


def _metric_name(node) -> str:
    """Op names as the other metrics spell them ("add.Tensor", "special_bessel_j0")."""
    return _target_name(node).removeprefix("aten::")


def lowering_error(node, kind, reason) -> NeuronCompileError:
    where = user_source(node)
    where = f"\n  from your code:\n    {where.strip()}" if where else ""
    name = _target_name(node)
    return NeuronCompileError(
        f"torchneuron: torch.compile(backend=\"neuron\") cannot lower {name} {describe_node(node)} in "
        f"this {kind} graph: {reason}.{where}\n  Run such graphs eagerly on neuron instead with "
        "torch.compile(..., options={\"fallback\": \"eager\"}) or TORCHNEURON_COMPILE_FALLBACK=eager "
        "(torchneuron.config.compile_fallback = \"eager\"), or avoid the op.",
        op=name)


# -- the program ----------------------------------------------------------------------------------
class _Step:
    """One node to evaluate: ``kind`` is op/index_put (``kernel`` a Kernel), foreach (``kernel`` a
    ForeachPlan), getitem or sym."""

    __slots__ = ("node", "kind", "kernel")

    def __init__(self, node, kind, kernel=None):
        self.node, self.kind, self.kernel = node, kind, kernel

    @property
    def random(self) -> bool:
        k = self.kernel.kernel if self.kind == "foreach" else self.kernel
        return k is not None and k.lowering.random


class _Executable:
    __slots__ = ("call", "n_new", "n_host", "writes", "host_writes", "name")

    def __init__(self, call, n_new, n_host, writes, host_writes, name):
        self.call = call
        self.n_new = n_new              # new device outputs, first in the results
        self.n_host = n_host            # then outputs that live on the CPU
        self.writes = writes            # then new buffers of written storages (slot indices)
        self.host_writes = host_writes  # then new values of mutated CPU inputs (input indices)
        self.name = name


class GraphProgram:
    """A compiled ATen graph: call it with the boxed list of real inputs."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, fallback: str = "error", name: str = "graph",
                 dump_dir: str | None = None):
        self.gm = gm
        self.kind = kind
        self.fallback = fallback
        self.name = name
        self.dump_dir = dump_dir
        # AOTAutograd's boxed-call marker; an instance attribute so the wrappers it puts around
        # backward compilers (functools.wraps copies __dict__) keep it.
        self._boxed_call = True
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.executables: dict = {}
        self.eager = False
        self._lock = threading.Lock()
        self.steps, self.constants, missing = self._plan()
        if missing:
            node, reason = missing[0]
            err = lowering_error(node, kind, reason)
            if fallback != "eager":
                raise err
            self._use_eager([_metric_name(n) for n, _ in missing], err)
        self.random = any(s.random for s in self.steps)
        self.outputs = self._plan_outputs()
        self.graph_hash = self._hash()

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self):
        steps, constants, missing = [], {}, []
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                value = getattr(self.gm, node.target)
                if not isinstance(value, torch.Tensor):
                    missing.append((node, "graph attributes other than tensors are not supported"))
                    continue
                constants[node] = _host_value(value)
                continue
            if node.op != "call_function":
                missing.append((node, f"FX node kind {node.op!r} is not supported"))
                continue
            target = node.target
            if target is operator.getitem:
                steps.append(_Step(node, "getitem"))
                continue
            if not isinstance(target, torch._ops.OpOverload):
                missing.append((node, "only ATen operators can be lowered"))
                continue
            name = op_name(target) if target.namespace == "aten" else None
            if name in _NOOPS:
                continue
            if name in _SYM:
                steps.append(_Step(node, "sym"))
                continue
            k = kernel_for(target)
            if k is not None:
                steps.append(_Step(node, "index_put" if name in _INDEX_PUT else "op", k))
                continue
            if name is not None and name.startswith("_foreach_"):
                # No lowering of the foreach op itself: lower it element by element.
                plan = foreach_plan(target)
                if plan is not None:
                    steps.append(_Step(node, "foreach", plan))
                    continue
                missing.append((node, "neither it nor its element-wise base op has a neuron lowering"))
                continue
            missing.append((node, "the op has no neuron lowering"))
        return steps, constants, missing

    def _plan_outputs(self):
        """How each graph output is produced: an input, a view of one, or computed.

        Computed outputs are grouped by the (fake) storage they share, so outputs that alias each
        other (``y`` and ``y.view(-1)``) come back as views of one buffer, as in eager mode.
        """
        ph_storage = {}
        for i, ph in enumerate(self.placeholders):
            v = ph.meta.get("val")
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                ph_storage.setdefault(StorageWeakRef(v.untyped_storage()), i)
        ph_index = {ph: i for i, ph in enumerate(self.placeholders)}
        plans, groups, host = [], {}, {}
        for out in _flat_outputs(self.output_node):
            if not isinstance(out, torch.fx.Node):
                plans.append(("const", out))
                continue
            if out in ph_index:
                plans.append(("input", ph_index[out]))
                continue
            val = out.meta.get("val")
            if not isinstance(val, torch.Tensor):
                plans.append(("value", out))
                continue
            if val.device.type == "cpu":
                plans.append(("host", host.setdefault(out, len(host))))
                continue
            storage = StorageWeakRef(val.untyped_storage())
            src = ph_storage.get(storage)
            if src is not None and self.placeholders[src].meta["val"].dtype == val.dtype:
                plans.append(("view", src, tuple(val.shape), tuple(val.stride()), val.storage_offset()))
                continue
            members = groups.setdefault((storage, val.dtype), {})
            members.setdefault(out, None)
            plans.append(("group", (storage, val.dtype), out))
        # One buffer per group: a lone output gets its own dense layout; aliasing outputs share the
        # storage, built from the member that covers it (or written member by member).
        self.buffers = []
        where = {}
        for (_storage, torch_dtype), members in groups.items():
            nodes = list(members)
            dtype = device_dtype(torch_dtype, _metric_name(nodes[0]))
            j = len(self.buffers)
            if len(nodes) == 1:
                val = nodes[0].meta["val"]
                sizes, strides = tuple(val.shape), tuple(val.stride())
                if not layout.is_dense(sizes, strides):
                    strides = memory.contiguous_strides(sizes)
                self.buffers.append(("node", nodes[0], dtype, sizes, strides))
                where[nodes[0]] = ("buf", j)
                continue
            numel = nodes[0].meta["val"].untyped_storage().nbytes() // nodes[0].meta["val"].element_size()
            cover = next((n for n in nodes if _covers(n.meta["val"], numel)), None)
            if cover is not None:
                val = cover.meta["val"]
                self.buffers.append(("node", cover, dtype, tuple(val.shape), tuple(val.stride())))
            else:
                members_layout = [(n, tuple(n.meta["val"].shape), tuple(n.meta["val"].stride()),
                                   n.meta["val"].storage_offset()) for n in nodes]
                self.buffers.append(("storage", members_layout, dtype, (numel,), (1,)))
            for n in nodes:
                val = n.meta["val"]
                where[n] = ("buf", j) if n is cover else \
                    ("alias", j, tuple(val.shape), tuple(val.stride()), val.storage_offset())
        self.host_outputs = list(host)
        return [where[p[2]] if p[0] == "group" else p for p in plans]

    def _hash(self) -> str:
        h = hashlib.sha256()
        h.update(self.gm.code.encode())
        for node, value in self.constants.items():
            h.update(node.name.encode())
            h.update(str((value.dtype, value.shape)).encode())
            h.update(np.ascontiguousarray(value).tobytes())
        h.update(f"{self.kind}|{config.float64}".encode())
        return h.hexdigest()

    def _use_eager(self, ops, err):
        for op in dict.fromkeys(ops):
            metrics.graph_fallbacks[op] += 1
        if not self.eager:
            warnings.warn(
                f"torchneuron: running a {self.kind} graph eagerly (compile fallback is 'eager'): "
                f"{str(err).splitlines()[0]}", stacklevel=2)
        self.eager = True

    # -- calling -----------------------------------------------------------------------------------
    def __call__(self, *args):
        if len(args) == 1 and isinstance(args[0], list):
            # Boxed call (AOTAutograd's convention): take the list and free the caller's references.
            boxed = args[0]
            args = list(boxed)
            boxed.clear()
        else:
            args = list(args)
        if self.eager:
            return self._run_eager(args)
        bufs, addrs, runtime, specs, device_index = _signature(args)
        if self.random:
            gen = rng.generator(device_index if device_index is not None else _current_device())
            runtime.extend(gen.next_key_inputs())
        key = tuple(specs)
        exe = self.executables.get(key)
        if exe is None:
            with self._lock:
                exe = self.executables.get(key)
                if exe is None:
                    exe = self._compile(key, specs, bufs, runtime, device_index)
                    if exe is None:            # fell back to eager
                        return self._run_eager(args)
                    self.executables[key] = exe
        results = exe.call(*bufs, *runtime)
        return self._finish(exe, results, args, addrs, device_index)

    def _run_eager(self, args):
        out = self.gm(*args)
        return list(out) if isinstance(out, tuple | list) else [out]

    def _finish(self, exe, results, args, addrs, device_index):
        dev = device_index if device_index is not None else _current_device()
        new = [memory.new_buffer_tensor(buf, dtype, dev, sizes, strides)
               for buf, (_, _, dtype, sizes, strides) in zip(results, self.buffers)]
        k = exe.n_new
        host_vals = list(results[k:k + exe.n_host])
        k += exe.n_host
        for slot in exe.writes:
            _records[addrs[slot]].buf = results[k]
            k += 1
        host_writes = list(results[k:k + len(exe.host_writes)])
        if host_vals or host_writes:
            fetched = jax.device_get(host_vals + host_writes)
            for a in fetched:
                metrics.d2h_copies += 1
                metrics.d2h_bytes += np.asarray(a).nbytes
            host_vals = [transfers.torch_from_host(np.asarray(a)) for a in fetched[:len(host_vals)]]
            for i, a in zip(exe.host_writes, fetched[len(host_vals):]):
                with torch.no_grad():
                    args[i].copy_(transfers.torch_from_host(np.asarray(a)).reshape(args[i].shape))
        outs = []
        for p in self.outputs:
            kind = p[0]
            if kind == "buf":
                outs.append(new[p[1]])
            elif kind == "alias":
                # A real (autograd-visible) view, so in-place updates through it behave as in eager.
                _, j, sizes, strides, offset = p
                outs.append(torch.as_strided(new[j], sizes, strides, offset))
            elif kind == "input":
                outs.append(args[p[1]])
            elif kind == "view":
                _, i, sizes, strides, offset = p
                outs.append(_AS_STRIDED(_CPU_KEYS, args[i], list(sizes), list(strides), offset))
            elif kind == "host":
                outs.append(host_vals[p[1]])
            elif kind == "value":
                outs.append(_static_value(p[1]))
            else:
                outs.append(p[1])
        return outs

    # -- compiling ---------------------------------------------------------------------------------
    def _compile(self, key, specs, bufs, runtime, device_index):
        if self.executables:
            metrics.recompiles[f"{self.kind} graph called with a new input layout "
                               "(dtype/shape/strides/storage offset/aliasing)"] += 1
        # The same graph on the same input signature (a re-created torch.compile, a Dynamo
        # recompile that traced an identical graph) reuses the executable: no trace, no compile.
        shared_key = (self.graph_hash, key, device_index)
        exe = _shared_executables.get(shared_key)
        if exe is not None:
            metrics.extra["graph_memory_cache_hits"] += 1
            return exe
        disk_key = cache.graph_key(self.graph_hash, key, device_index or 0)
        start = time.perf_counter()
        from ..runtime import pjrt
        # Dumps need the StableHLO, so with a dump directory the graph is always traced.
        loaded = None if (self.dump_dir or config.dump_dir) else cache.load_graph(disk_key, pjrt.devices())
        if loaded is not None:
            compiled, meta = loaded
            seconds = time.perf_counter() - start
            metrics.compile_seconds += seconds
            metrics.extra["graph_compile_seconds"] += seconds
            metrics.extra["graph_persistent_cache_hits"] += 1
            metrics.extra["graph_index_hits"] += 1
            exe = _Executable(compiled, meta["n_new"], meta["n_host"], tuple(meta["writes"]),
                              tuple(meta["host_writes"]), meta["name"])
            _shared_executables[shared_key] = exe
            return exe
        fn = _Interpreter(self, specs, len(bufs))
        # The jitted function's name is part of the HLO module, hence of JAX's cache key: keep it
        # deterministic across processes.
        fn.__name__ = f"neuron_{self.kind}"
        try:
            with cache.graph_compile_context() as hits:
                lowered = jax.jit(fn).lower(*bufs, *runtime)
                compiled = lowered.compile()
        except _NodeFailure as failure:
            err = lowering_error(failure.node, self.kind, f"{type(failure.error).__name__}: {failure.error}")
            if self.fallback == "eager":
                self._use_eager([_metric_name(failure.node)], err)
                return None
            raise err from failure.error
        seconds = time.perf_counter() - start
        metrics.compile_seconds += seconds
        metrics.extra["graph_compile_seconds"] += seconds
        name = f"{self.name}_{self.graph_hash[:12]}_{_digest(key)[:8]}"
        if hits.count:
            metrics.extra["graph_persistent_cache_hits"] += 1
        else:
            metrics.graphs_compiled += 1
            metrics.executables_compiled += 1
        cache.dump(name, self.gm, lowered, specs, self.dump_dir)
        exe = _Executable(compiled, len(self.buffers), len(self.host_outputs), fn.writes, fn.host_writes, name)
        if not hits.count:
            # Only a freshly compiled executable goes into the index: one that XLA deserialized
            # from JAX's cache serializes again without its fused CPU kernels, and loading that
            # entry later fails at run time ("Function ... not found").
            cache.store_graph(disk_key, compiled, {"n_new": exe.n_new, "n_host": exe.n_host,
                                                   "writes": exe.writes, "host_writes": exe.host_writes,
                                                   "name": name})
        _shared_executables[shared_key] = exe
        return exe


# (graph hash, input signature, device) -> executable, shared by every GraphProgram in the process.
_shared_executables: dict = {}


def clear_cache() -> None:
    """Forget in-memory graph executables (the persistent cache on disk stays)."""
    _shared_executables.clear()


def _digest(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()


class _NodeFailure(Exception):
    def __init__(self, node, error):
        super().__init__(str(error))
        self.node = node
        self.error = error


def _covers(val, numel) -> bool:
    """The fake tensor spans its whole storage densely from offset 0."""
    sizes, strides = tuple(val.shape), tuple(val.stride())
    return val.storage_offset() == 0 and val.numel() == numel and layout.is_dense(sizes, strides)


def _flat_outputs(output_node):
    out = output_node.args[0]
    return list(out) if isinstance(out, list | tuple) else [out]


def _static_value(node):
    v = node.meta.get("val")
    return int(v) if isinstance(v, torch.SymInt | int) else v


def _host_value(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type == "neuron":
        return transfers.to_host(t)
    return transfers.host_array(t)


def _current_device() -> int:
    from ..runtime import device as device_mod
    return device_mod.current_device()


def _signature(args):
    """Buffers, runtime values and the cache-key specs of one call's inputs."""
    bufs, addrs, runtime, specs = [], [], [], []
    slots = {}
    device_index = None
    for a in args:
        if isinstance(a, torch.Tensor):
            dev = a.device.type
            if dev == "neuron":
                if a.numel() == 0:
                    specs.append(("empty", a.dtype, tuple(a.shape)))
                    continue
                addr = a.untyped_storage().data_ptr()
                rec = _records.get(addr)
                if rec is None:
                    memory.record_of(a)       # raises the freed-storage error
                if device_index is None:
                    device_index = rec.device_index
                elif rec.device_index != device_index:
                    raise device_mismatch_error(a, device_index)
                slot = slots.get(addr)
                if slot is None:
                    slot = slots[addr] = len(bufs)
                    bufs.append(memory.empty_buffer(rec))  # also runs a pending adaptive region
                    addrs.append(addr)
                specs.append((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), slot, rec.numel))
            elif dev == "cpu":
                host = transfers.host_array(a)      # uploaded by the call: counted as a copy
                metrics.h2d_copies += 1
                metrics.h2d_bytes += host.nbytes
                runtime.append(host)
                specs.append(("host", a.dtype, tuple(a.shape)))
            else:
                raise RuntimeError(
                    f"torchneuron: a torch.compile(backend=\"neuron\") graph got an input on {a.device}; "
                    "move it to the neuron device (or to the CPU) first.")
        elif a is None:
            specs.append(None)
        elif isinstance(a, bool | int | torch.SymInt):
            # Integers shape things: compiled in.
            specs.append(("int", int(a)))
        elif isinstance(a, float | torch.SymFloat):
            runtime.append(float(a))
            specs.append(float)
        else:
            specs.append(("const", a))
    return bufs, addrs, runtime, specs, device_index


class _Interpreter:
    """What ``jax.jit`` traces: the FX graph evaluated node by node on jax arrays."""

    def __init__(self, program: GraphProgram, specs, nbufs):
        self.p = program
        self.specs = specs
        self.nbufs = nbufs
        self.writes = ()
        self.host_writes = ()

    def __call__(self, *flat):
        p = self.p
        bufs = flat[: self.nbufs]
        rt = iter(flat[self.nbufs:])
        env = {}
        for ph, spec in zip(p.placeholders, self.specs):
            env[ph] = _materialise(spec, bufs, rt)
        for node, value in p.constants.items():
            env[node] = jnp.asarray(value)
        base_key = None
        if p.random:
            seed, offset = next(rt), next(rt)
            base_key = jax.random.fold_in(jax.random.key(seed), offset)
        self.mutations = {}
        self.ph_index = {ph: i for i, ph in enumerate(p.placeholders)}
        for n, step in enumerate(p.steps):
            try:
                self._run(step, env, base_key, n)
            except _NodeFailure:
                raise
            except Exception as err:  # noqa: BLE001 - reported with the node that failed
                raise _NodeFailure(step.node, err) from err
        outputs = []
        for kind, what, dtype, sizes, strides in p.buffers:
            if kind == "node":
                value = jnp.broadcast_to(_cast(jnp.asarray(env[what]), dtype), what.meta["val"].shape)
                outputs.append(layout.to_layout(value, sizes, strides))
                continue
            storage = jnp.zeros(sizes, jax_dtype(dtype))
            for node, vsizes, vstrides, voffset in what:
                value = jnp.broadcast_to(_cast(jnp.asarray(env[node]), dtype), vsizes)
                storage = layout.write(storage, value, jax_dtype(dtype), vsizes, vstrides, voffset)
            outputs.append(storage)
        host = [jnp.asarray(env[node]) for node in p.host_outputs]
        # Input mutations: device storages get their new buffers, CPU inputs their new values.
        new_bufs = {}
        host_writes = []
        for i, value in self.mutations.items():
            spec = self.specs[i]
            if spec is None or spec[0] == "empty":
                continue
            if spec[0] == "host":
                host_writes.append((i, _cast(value, spec[1])))
                continue
            dtype, sizes, strides, offset, slot, _ = spec
            base = new_bufs.get(slot, bufs[slot])
            value = jnp.broadcast_to(_cast(value, dtype), sizes)
            new_bufs[slot] = layout.write(base, value, jax_dtype(dtype), sizes, strides, offset)
        self.writes = tuple(new_bufs)
        self.host_writes = tuple(i for i, _ in host_writes)
        return (tuple(outputs) + tuple(host) + tuple(new_bufs[s] for s in self.writes)
                + tuple(v for _, v in host_writes))

    # -- one node ----------------------------------------------------------------------------------
    def _run(self, step, env, base_key, n):
        node = step.node
        kind = step.kind
        if kind == "getitem":
            src, idx = node.args
            env[node] = env[src][idx]
            return
        if kind == "sym":
            env[node] = _static_value(node)
            return
        key = jax.random.fold_in(base_key, n) if base_key is not None else None
        if kind == "foreach":
            env[node] = self._foreach(step, env, key)
            return
        k = step.kernel
        values = _bind(k, node.args, node.kwargs)
        metas = [_meta_of(v) for v in values]
        arrays = [_lookup(v, env) for v in values]
        if k.short_name == "as_strided.default":
            arrays[0] = _storage_of(values[0], arrays[0])
        if kind == "index_put" and any(i is not None and i.dtype == jnp.bool_ for i in arrays[1]):
            env[node] = _bool_mask_index_put(arrays[0], arrays[1], arrays[2], bool(arrays[3]),
                                             node.meta["val"].dtype)
            return
        result, mutated = _apply(k, values, arrays, metas, node.meta.get("val"), key)
        # Mutated arguments: later nodes see the new value; graph inputs are written back.
        for arg, value in mutated:
            env[arg] = value
            if arg in self.ph_index:
                self.mutations[self.ph_index[arg]] = value
            elif arg.op != "call_function":
                raise RuntimeError(f"in-place update of {arg.op} {arg.name} is not supported")
        env[node] = result

    def _foreach(self, step, env, key):
        plan = step.kernel
        k = plan.kernel
        fvalues = _bind_schema(plan.op._schema, step.node.args, step.node.kwargs)
        out_meta = step.node.meta.get("val") or []
        lists = [fvalues[i] for i, how in plan.mapping.values() if how == "list"]
        count = len(lists[0]) if lists else len(out_meta)
        results = []
        for e in range(count):
            values = [None if d is _REQUIRED else d for d in k.defaults]
            metas, arrays = list(values), list(values)
            for j, (i, how) in plan.mapping.items():
                v = fvalues[i]
                if how == "list":
                    v = v[e]
                if how == "index":
                    # _foreach_*.Tensor: element e's scalar is entry e of a 1-D tensor.
                    arrays[j] = _lookup(v, env)[e]
                    metas[j] = 0.0 if _meta_of(v).dtype.is_floating_point else 0
                    values[j] = None
                else:
                    values[j], metas[j], arrays[j] = v, _meta_of(v), _lookup(v, env)
            ekey = jax.random.fold_in(key, e) if key is not None else None
            value, _ = _apply(k, values, arrays, metas, out_meta[e] if e < len(out_meta) else None, ekey)
            results.append(value)
        return results


def _apply(k, values, arrays, metas, out_meta, key):
    """One call of ``k``'s lowering: (the node's value, [(mutated argument node, its new value)])."""
    new_meta = _new_outputs(k, out_meta)
    promote = None
    if k.promote_idx is not None:
        promote = k._promotion_dtype(metas, new_meta, out_meta)
    targets = []
    for i in k.mutated:
        m = metas[i]
        if m is None:
            continue
        for pos, t in enumerate(m if isinstance(m, list | tuple) else (m,)):
            targets.append((i, pos, t))
    mutated_vals, new_vals = call_lowering(k, arrays, promote, key, len(targets), len(new_meta),
                                           k.input_contiguous(metas))
    outs = []
    for value, m in zip(new_vals, new_meta):
        if m is None:
            outs.append(None)
            continue
        if value is None:
            raise RuntimeError(f"lowering of aten::{k.short_name} returned None for a requested output")
        outs.append(_shaped(_cast(jnp.asarray(value), device_dtype(m.dtype, k.short_name)), m, k))
    by_arg, mutated = {}, []
    for (i, pos, m), value in zip(targets, mutated_vals):
        if value is None:
            continue
        new = jnp.broadcast_to(_cast(jnp.asarray(value), device_dtype(m.dtype, k.short_name)), m.shape)
        by_arg[(i, pos)] = new
        arg = values[i][pos] if isinstance(values[i], list | tuple) else values[i]
        if isinstance(arg, torch.fx.Node):
            mutated.append((arg, new))
    if k.returns_list:
        return outs, mutated
    returned, j = [], 0
    for src in k.return_sources:
        if src is None:
            returned.append(outs[j])
            j += 1
        else:
            returned.append(by_arg.get((src, 0)))
    return (returned[0] if len(returned) == 1 else tuple(returned)), mutated


def _storage_of(node, value):
    """as_strided indexes the storage: rebuild it when the input is not its contiguous prefix."""
    m = _meta_of(node)
    if not isinstance(m, torch.Tensor):
        return value
    sizes, strides, offset = tuple(m.shape), m.stride(), m.storage_offset()
    if layout.is_contiguous(sizes, strides) and offset == 0:
        return value
    numel = m.untyped_storage().nbytes() // m.element_size()
    storage = jnp.zeros((numel,), value.dtype)
    return layout.write(storage, value, value.dtype, sizes, strides, offset)


def _shaped(value, meta, k):
    shape = tuple(meta.shape)
    if tuple(value.shape) != shape:
        if value.size == int(np.prod(shape)):
            return value.reshape(shape)
        if value.size == 0:
            # Eval-mode batch norm's saved statistics: PyTorch's CPU kernels return them empty
            # while its meta functions say [C]; nothing reads them, so either shape will do.
            return jnp.zeros(shape, value.dtype)
        raise RuntimeError(
            f"lowering of aten::{k.short_name} produced shape {tuple(value.shape)}, PyTorch expects "
            f"{shape} (a bug in the lowering)")
    return value


def _materialise(spec, bufs, rt):
    if spec is None:
        return None
    if spec is float:
        return next(rt)
    tag = spec[0]
    if tag == "empty":
        return jnp.zeros(spec[2], dtype=jax_dtype(spec[1]))
    if tag == "host":
        return next(rt)
    if tag == "int":
        return spec[1]
    if tag == "const":
        return spec[1]
    dtype, sizes, strides, offset, slot, _ = spec
    return layout.read(bufs[slot], jax_dtype(dtype), sizes, strides, offset)


def _bind_schema(schema, args, kwargs):
    values = list(args)
    arguments = schema.arguments
    for a in arguments[len(values):]:
        values.append(kwargs[a.name] if a.name in kwargs else
                      (a.default_value if a.has_default_value() else None))
    return values


def _bind(k, args, kwargs):
    values = list(args)
    n = len(values)
    if n < len(k.defaults):
        values.extend(None if d is _REQUIRED else d for d in k.defaults[n:])
    for name, v in kwargs.items():
        values[k.index_of[name]] = v
    return values


def _lookup(v, env):
    if isinstance(v, torch.fx.Node):
        return env[v]
    if isinstance(v, list | tuple):
        return [_lookup(x, env) for x in v]
    return v


def _bool_mask_index_put(self, indices, values, accumulate, dtype):
    """``x[mask] = v`` inside a graph, without the data-dependent nonzero eager mode uses."""
    masks = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or masks[0][1].dtype != jnp.bool_:
        raise RuntimeError("boolean-mask index_put mixed with other indices needs data-dependent shapes")
    p, mask = masks[0]
    rest = self.ndim - p - mask.ndim
    full = mask.reshape((1,) * p + mask.shape + (1,) * rest)
    values = values.astype(self.dtype)
    if values.size != 1:
        if p != 0:
            raise RuntimeError("boolean-mask index_put after leading slices needs data-dependent shapes")
        # The k-th True position takes values[k]: positions come from a running count of the mask.
        pos = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, max(values.shape[0] - 1, 0))
        picked = values[pos].reshape(mask.shape + values.shape[1:])
        values = jnp.broadcast_to(picked, mask.shape + self.shape[mask.ndim:])
    else:
        values = values.reshape(())
    out = self + jnp.where(full, values, 0).astype(self.dtype) if accumulate else jnp.where(full, values, self)
    return out.astype(jax_dtype(dtype))
