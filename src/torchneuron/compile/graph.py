"""One ATen FX graph (what AOTAutograd hands a compiler) as one PJRT executable.

``GraphProgram`` checks at compile time that every node has a lowering in the one registry that
eager mode uses (``ops.registry``), then compiles lazily, per input signature:

* the signature of a call is each input's dtype, sizes, strides, storage size and which inputs
  share a storage (views and non-contiguous inputs are read from their storage buffers inside the
  executable, exactly as eager kernels read them), so a new layout is a new executable; a view's
  storage offset is a runtime input, so ``fn(x[i])`` compiles once for every ``i``;
* ``jax.jit`` traces the interpreter (``compile.interpreter``) over the graph, which calls each
  node's lowering the way eager kernels do (``ops.signature``);
* input mutations (BatchNorm running stats, optimizer steps) are written back into the inputs'
  storages, outputs are returned as planned by ``compile.outputs``, random nodes draw keys from the
  device generator (reproducible under ``torch.manual_seed``);
* executables are cached in memory and on disk (``compile.executables``).

The rest of the package: ``errors`` (messages that name the op and the user's line), ``foreach``
(foreach nodes lowered element by element), ``backend`` (the Dynamo/AOTAutograd entry point).
"""

from __future__ import annotations

import hashlib
import operator
import sys
import threading
import warnings

import jax
import numpy as np
import torch

from .. import seams
from ..config import config
from ..metrics import metrics
from ..ops import devices, oprecord, precision
from ..ops.signature import registry_name, signature_for
from ..runtime import donation, memory, rng, sites, transfers
from ..runtime.device import current_device
from ..runtime.executable import Executable
from ..runtime.inputs import StableStorages
from . import cache, custom_kernels, executables
from .errors import NeuronCompileError, NodeFailure, lowering_error, metric_name
from .foreach import foreach_plan
from .fusions import Fusions
from .interpreter import Interpreter, Step, call_signature
from .outputs import OutputPlan


def unboxed(args) -> list:
    """A graph program's arguments as a list. A boxed call (AOTAutograd's convention: one list)
    gives up the list: it is emptied, freeing the caller's references to the inputs."""
    if len(args) == 1 and isinstance(args[0], list):
        boxed = args[0]
        args = list(boxed)
        boxed.clear()
        return args
    return list(args)


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
            self._use_eager([metric_name(n) for n, _ in missing], err)
        self.random = any(s.random for s in self.steps)
        # Matmuls and convolutions are traced with PyTorch's float32 precision settings of the call
        # (Dynamo guards on the matmul one only): the settings are part of the executable's key.
        self.precision_readers = precision.readers(s.precision for s in self.steps)
        # torchneuron.kernel ops: counted per run and per compile; their code is not part of the
        # graph's text, so the hash holds their registrations and the on-disk index is skipped
        # (JAX's own cache, keyed by the traced program, still applies).
        self.custom_kernels = [k.name for k in custom_kernels.kernels_in(self.steps)]
        self.output_plan = OutputPlan(self.placeholders, self.output_node)
        self.stable = StableStorages(self.placeholders)
        # Device checks (ops/checks.py) are compiled into the graph as they are set now.
        self.device_checks = config.device_checks
        self.graph_hash = self._hash()

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self):
        steps, constants, missing = [], {}, []
        self.fusions = fusions = Fusions(self.gm.graph, config.platform)
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output") or node in fusions.skipped:
                continue
            if node in fusions.steps:
                sig, args = fusions.steps[node]
                steps.append(Step(node, oprecord.OP, sig, args))
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
                steps.append(Step(node, "getitem"))
                continue
            if target in custom_kernels.AUTO_FUNCTIONALIZED:
                # A mutating custom kernel, functionalized by AOTAutograd.
                sig = custom_kernels.auto_functionalized_kernel(node, config.platform)
                if sig is None:
                    missing.append((node, f"the mutating op {node.args[0]} has no neuron lowering"))
                else:
                    steps.append(Step(node, "auto_functionalized", sig))
                continue
            if not isinstance(target, torch._ops.OpOverload):
                missing.append((node, "only ATen operators can be lowered"))
                continue
            name = registry_name(target) if target.namespace == "aten" else None
            kind = oprecord.GRAPH_KINDS.get(name)   # noop, sym, index_put (ops/oprecord.py)
            if kind == oprecord.NOOP:
                continue
            if kind == oprecord.SYM:
                steps.append(Step(node, oprecord.SYM))
                continue
            sig = signature_for(target, config.platform)
            if sig is not None:
                devices.check_graph_node(sig, node)   # CPU index arguments, as in eager mode
                steps.append(Step(node, oprecord.INDEX_PUT if kind == oprecord.INDEX_PUT else oprecord.OP, sig))
                continue
            if name is not None and name.startswith("_foreach_"):
                # No lowering of the foreach op itself: lower it element by element.
                plan = foreach_plan(target)
                if plan is not None:
                    steps.append(Step(node, "foreach", plan))
                    continue
                missing.append((node, "neither it nor its element-wise base op has a neuron lowering"))
                continue
            missing.append((node, "the op has no neuron lowering"))
        return steps, constants, missing

    def _hash(self) -> str:
        h = hashlib.sha256()
        h.update(self.gm.code.encode())
        for node, value in self.constants.items():
            h.update(node.name.encode())
            h.update(str((value.dtype, value.shape)).encode())
            h.update(np.ascontiguousarray(value).tobytes())
        h.update(f"{self.kind}|{config.float64}|{self.device_checks}|{self.fusions.describe()}".encode())
        h.update(custom_kernels.fingerprint(custom_kernels.kernels_in(self.steps)).encode())
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
        args = unboxed(args)
        if self.eager:
            return self._run_eager(args)
        ins, specs = call_signature(args, self.stable)
        bufs, runtime, device_index = ins.bufs, ins.runtime, ins.device_index
        if self.random:
            gen = rng.generator(device_index if device_index is not None else current_device())
            runtime.extend(gen.next_key_inputs())
        # What decides the program: every input's spec and the sizes of the storages they read.
        key = (tuple(specs), tuple(ins.storages))
        if self.precision_readers:
            key += precision.settings(self.precision_readers)
        exe = self.executables.get(key)
        if exe is None:
            with self._lock:
                exe = self.executables.get(key)
                if exe is None:
                    exe = self._compile(key, specs, bufs, runtime, device_index)
                    if exe is None:            # fell back to eager
                        return self._run_eager(args)
                    self.executables[key] = exe
        if exe.donated:   # the storages it writes are updated in place
            donation.make_private(bufs, exe.donated, device_index)
        try:
            results = exe.call(*bufs, *runtime)
        except Exception as err:
            memory.raise_if_out_of_memory(err, device_index)   # torch.OutOfMemoryError
            raise
        if self.custom_kernels:
            metrics.custom_kernel_calls.update(self.custom_kernels)
        return self._finish(exe, results, args, ins.addrs, device_index)

    def _run_eager(self, args):
        out = self.gm(*args)
        return list(out) if isinstance(out, tuple | list) else [out]

    def _finish(self, exe, results, args, addrs, device_index):
        dev = device_index if device_index is not None else current_device()
        new = self.output_plan.new_tensors(results, dev)
        k = exe.n_new
        host_vals = list(results[k:k + exe.n_host])
        k += exe.n_host
        k = exe.take_writes(results, k, addrs)
        host_writes = list(results[k:k + len(exe.host_writes)])
        if exe.checks:   # the outcome of the graph's device checks, last
            exe.report(results[k + len(exe.host_writes)], sites.place(sys._getframe()))
        if host_vals or host_writes:
            fetched = jax.device_get(host_vals + host_writes)
            for a in fetched:
                metrics.d2h_copies += 1
                metrics.d2h_bytes += np.asarray(a).nbytes
            host_vals = [transfers.torch_from_host(np.asarray(a)) for a in fetched[:len(host_vals)]]
            for i, a in zip(exe.host_writes, fetched[len(host_vals):]):
                with torch.no_grad():
                    args[i].copy_(transfers.torch_from_host(np.asarray(a)).reshape(args[i].shape))
        return self.output_plan.assemble(new, host_vals, args)

    # -- compiling ---------------------------------------------------------------------------------
    def _compile(self, key, specs, bufs, runtime, device_index):
        if self.executables:
            metrics.recompiles[f"{self.kind} graph called with a new input layout "
                               "(dtype/shape/strides/storage size/aliasing)"] += 1
        need_trace = bool(self.dump_dir or config.dump_dir or self.custom_kernels)
        exe = executables.cached(self.graph_hash, key, device_index, need_trace=need_trace)
        if exe is not None:
            return exe
        fn = Interpreter(self, specs, len(bufs))
        # The jitted function's name is part of the HLO module, hence of JAX's cache key: keep it
        # deterministic across processes.
        fn.__name__ = f"neuron_{self.kind}"
        try:
            lowered, compiled, jax_cache_hits = executables.compile_traced(
                fn, bufs, runtime, index=None if need_trace else (self.graph_hash, key, device_index),
                not_indexed="graphs with custom kernels, or dumped graphs, are looked up in JAX's "
                            "compilation cache only, which had no entry for this one", donate=True)
        except NodeFailure as failure:
            err = lowering_error(failure.node, self.kind, f"{type(failure.error).__name__}: {failure.error}")
            if self.fallback == "eager":
                self._use_eager([metric_name(failure.node)], err)
                return None
            raise err from failure.error
        name = f"{self.name}_{self.graph_hash[:12]}_{executables.digest(key)[:8]}"
        cache.dump(name, self.gm, lowered, specs, self.dump_dir)
        exe = Executable(compiled, name, fn.writes, self.device_checks, fn.checks,
                         n_new=len(self.output_plan.buffers), n_host=len(self.output_plan.host_outputs),
                         host_writes=fn.host_writes)
        exe.donated = donation.donated_slots(compiled)
        if not jax_cache_hits:
            metrics.custom_kernel_compiles.update(set(self.custom_kernels))
        executables.remember(self.graph_hash, key, device_index, exe, compiled, from_jax_cache=bool(jax_cache_hits),
                             on_disk=not self.custom_kernels)
        return exe


# -- tracing (torch.profiler ranges, readiness-report call sites) ---------------------------------
# As eager kernels (``eager.kernel.set_tracing``): swapped in only while metrics.tracer is installed,
# so untraced graphs pay nothing.
_plain_call = GraphProgram.__call__
_plain_compile = GraphProgram._compile


_traced_call = seams.traced(__name__, "_plain_call", "graph")
_traced_compile = seams.traced(__name__, "_plain_compile", "graph_compile")


def set_tracing(on: bool) -> None:
    GraphProgram.__call__ = _traced_call if on else _plain_call
    GraphProgram._compile = _traced_compile if on else _plain_compile


def clear_cache() -> None:
    """Forget in-memory graph executables (the persistent cache on disk stays)."""
    executables.clear_cache()


def _host_value(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type == "neuron":
        return transfers.to_host(t)
    return transfers.host_array(t)


__all__ = ["GraphProgram", "NeuronCompileError", "clear_cache"]
