"""The Dynamo backend: Dynamo graph -> AOTAutograd (core-ATen decompositions) -> GraphProgram.

Shapes are static, as on TorchNeuron: a graph Dynamo traced symbolically (``dynamic=True``, or
Dynamo's automatic dynamic shapes after a size change) is compiled once per concrete shape, each
new shape counted in ``metrics.recompiles``; with ``config.shapes = "bucketed"`` (or
``options={"shapes": "bucketed"}``) such a graph compiles once per shape bucket instead
(``compile/dynamic.py``). Dynamo's own recompiles and graph breaks are counted there too, keyed by
their reason.
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
import warnings
from dataclasses import dataclass

import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import inductor_prims
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..config import config
from ..metrics import metrics
from ..ops import registry
from ..ops.signature import mutates, registry_name
from ..runtime import fork
from . import dynamic, dynamo_hooks, graph
from .graph import GraphProgram

fork.forbid(GraphProgram, "__call__", "running a torch.compile graph")
fork.forbid(graph, "_plain_call", "running a torch.compile graph")   # what profiler tracing swaps back in
fork.forbid(dynamic.BucketedProgram, "__call__", "running a torch.compile graph")

_OPTIONS = ("fallback", "dump_dir", "shapes", "buckets")
_graph_ids = itertools.count()


@dataclass(frozen=True)
class CompileOptions:
    fallback: str = "error"
    dump_dir: str = ""
    shapes: str = "static"
    buckets: object = None

    @classmethod
    def parse(cls, options, mode) -> CompileOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"torchneuron: unknown torch.compile option(s) {unknown} for backend "
                             f"\"neuron\"; valid options: {list(_OPTIONS)}")
        fallback = options.get("fallback") or config.compile_fallback
        if fallback not in ("error", "eager"):
            raise ValueError(f"torchneuron: options['fallback'] must be 'error' or 'eager', got {fallback!r}")
        if mode not in (None, "default"):
            warnings.warn(f"torchneuron: torch.compile mode={mode!r} has no effect on the neuron backend",
                          stacklevel=3)
        shapes = options.get("shapes") or config.shapes
        if shapes not in ("static", "bucketed"):
            raise ValueError(f"torchneuron: options['shapes'] must be 'static' or 'bucketed', got {shapes!r}")
        buckets = options.get("buckets")
        if buckets is not None:
            buckets = tuple(buckets) if isinstance(buckets, list | tuple) else buckets
            dynamic.parse_buckets(buckets)       # validated now, not at the first call
        return cls(fallback, options.get("dump_dir") or config.dump_dir, shapes, buckets)


def neuron_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode=None):
    """torch.compile(backend="neuron"): compile a Dynamo graph (forward and backward)."""
    opts = CompileOptions.parse(options, mode)
    dynamo_hooks.install(neuron_backend)
    dynamo_hooks.note_recompile()
    if _is_symbolic(example_inputs):
        if opts.shapes == "bucketed":
            # One executable per shape bucket (compile/dynamic.py): AOTAutograd keeps the symbols.
            return _compile_aot(gm, example_inputs, opts, bucketed=True)
        if not torch._dynamo.config.assume_static_by_default:
            warnings.warn(
                "torchneuron: torch.compile(dynamic=True) is ignored by the neuron backend: like "
                "TorchNeuron it compiles static shapes only (dynamic=False is applied), since each "
                "executable is specialised to its shapes. Every new input shape compiles a new "
                "executable, counted in torchneuron.metrics()['recompiles']; keep shapes stable with "
                "torchneuron.pad_to_multiple() / torchneuron.bucket_length().", stacklevel=2)
        return StaticShapes(gm, opts)
    return _compile_aot(gm, example_inputs, opts)


def _compile_aot(gm, example_inputs, opts: CompileOptions, bucketed: bool = False):

    _refuse_data_dependent_backward(gm)
    graph_id = next(_graph_ids)
    # dynamic=True makes every dim symbolic, varying or not: its sizes are compiled exactly until
    # they vary. Otherwise a symbolic dim has varied (automatic dynamic) or was marked dynamic.
    exact_first = not torch._dynamo.config.assume_static_by_default

    def compiler(kind):
        def compile_graph(aten_gm, aten_inputs):
            # AOTAutograd calls compilers with its FakeTensorMode active. Constants the graph holds
            # as real tensors (torch.tensor([...], device=...) in the compiled code, transformers'
            # DynamicCache) are read to the host while planning: that must run on real tensors.
            with unset_fake_temporarily():
                if bucketed:
                    return dynamic.BucketedProgram(aten_gm, kind, fallback=opts.fallback,
                                                   name=f"g{graph_id}_{kind}", dump_dir=opts.dump_dir,
                                                   buckets=opts.buckets, exact_first=exact_first)
                return GraphProgram(aten_gm, kind, fallback=opts.fallback, name=f"g{graph_id}_{kind}",
                                    dump_dir=opts.dump_dir)
        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=decompositions(),
        partition_fn=min_cut_rematerialization_partition,
        # BatchNorm running stats and optimizer state updates stay in the graph (written back into
        # the inputs' storages) instead of becoming eager copies after it.
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


# Ops whose output shape is static but whose derivative for one argument is not: the gradient of
# a value written through a bool mask is ``grad[mask]`` (``nonzero``), and index_fill's value
# gradient sums the distinct indices (``_unique``).
_MASK_WRITES = {torch.index_put, torch.Tensor.index_put, torch.Tensor.index_put_, "index_put", "index_put_",
                operator.setitem}
_INDEX_FILLS = {torch.index_fill, torch.Tensor.index_fill, torch.Tensor.index_fill_, "index_fill", "index_fill_"}


def _refuse_data_dependent_backward(gm) -> None:
    """Raise what FakeTensor raises for an op whose output shape depends on data, before
    AOTAutograd's joint trace meets it inside the backward: there the error crosses autograd's
    engine on the neuron device, whose Python device guard then calls Python with the error still
    pending, and the process aborts (std::terminate). Raised here, Dynamo runs the frame eagerly,
    as it does for CPU (``exceptions_allowed_to_be_fallback``)."""
    if not torch.is_grad_enabled():
        return
    for node in gm.graph.nodes:
        target = node.target if node.op in ("call_function", "call_method") else None
        if target in _MASK_WRITES:
            index, value = (*node.args[1:3], None, None)[:2]   # (x, indices, values) and setitem's
            if _requires_grad(value) and any(_is_mask(n) for n in _nodes_in(index)):
                _data_dependent(node, torch.ops.aten.nonzero.default,
                                "a value written through a bool mask needs grad[mask]")
        elif target in _INDEX_FILLS and len(node.args) >= 4 and _requires_grad(node.args[3]):
            _data_dependent(node, torch.ops.aten._unique.default,
                            "index_fill's value gradient sums over the distinct indices")


def _nodes_in(arg) -> list:
    found = []
    torch.fx.node.map_arg(arg, found.append)
    return found


def _example(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _requires_grad(arg) -> bool:
    value = _example(arg)
    return isinstance(value, torch.Tensor) and value.requires_grad


def _is_mask(node) -> bool:
    value = _example(node)
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


def _data_dependent(node, func, why: str):
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
    op = f"{getattr(node.target, '__name__', node.target)} ({why})"
    metrics.graph_fallbacks[op] += 1
    warnings.warn(f"torchneuron: a torch.compile graph runs eagerly: its backward needs an output "
                  f"shape that depends on data: {op}. On CPU Dynamo falls back the same way; "
                  "torch.where(mask, value, x) keeps a masked write compiled.", stacklevel=3)
    raise DynamicOutputShapeException(func)


@functools.cache
def decompositions() -> dict:
    """Core-ATen decompositions, minus functional ops the registry lowers directly (eager's lowering
    of the op is then also the graph's, and the graph stays smaller)."""

    table = {}
    for op, fn in core_aten_decompositions().items():
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten" and _lowered_directly(op):
            continue
        table[op] = fn
    # Dynamo itself rewrites addcmul_/addcdiv_ with a value into this prim.
    table[inductor_prims.fma] = lambda a, b, c: torch.add(torch.mul(a, b), c)
    return table


def _lowered_directly(op) -> bool:
    name = registry_name(op)
    if not mutates(op):
        low = registry.get(name)
        return low is not None and not low.mutates
    # In-place ops (lerp_.Scalar): functionalization rewrites them to their functional op plus a
    # copy, so a lowering of the functional op covers them.
    packet, _, overload = name.partition(".")
    if packet.endswith("_") and not packet.endswith("__"):
        low = registry.get(f"{packet[:-1]}.{overload}")
        return low is not None and not low.mutates
    return False


def _is_symbolic(example_inputs) -> bool:
    for x in example_inputs:
        if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
            return True
    return False


def _concrete_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.device, tuple(a.shape), a.stride(), a.requires_grad)
    return (type(a), a)


class StaticShapes:
    """A graph Dynamo traced with symbolic shapes, compiled once per concrete input shape."""

    def __init__(self, gm, opts: CompileOptions):
        self.gm = gm
        self.opts = opts
        self.compiled: dict = {}
        # Python floats Dynamo left unspecialized (dynamic=True): 0-dim CPU tensor inputs the graph
        # reads only with .item() (nn.Embedding's norm_type, a scale). A static retrace cannot read
        # a fake tensor's value, so their values are compiled in, and are part of the key.
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.items = [i for i, ph in enumerate(placeholders)
                      if ph.users and all(u.op == "call_method" and u.target == "item" for u in ph.users)]

    def __call__(self, *args):
        items = tuple((i, args[i].item()) for i in self.items
                      if isinstance(args[i], torch.Tensor) and args[i].device.type == "cpu" and args[i].dim() == 0)
        key = (tuple(_concrete_key(a) for a in args), items)
        fn = self.compiled.get(key)
        if fn is None:
            if self.compiled:
                metrics.recompiles["new input shapes (the neuron backend compiles static shapes)"] += 1
            fn = self.compiled[key] = _compile_aot(_with_values(self.gm, dict(items)), list(args), self.opts)
        return fn(*args)


def _with_values(gm, values: dict):
    """``gm`` with each ``.item()`` of the placeholders at these positions replaced by its value."""
    if not values:
        return gm
    graph = copy.deepcopy(gm.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, value in values.items():
        for item in list(placeholders[i].users):
            def swap(n, item=item, value=value):
                return value if n is item else n
            for user in list(item.users):
                user.args = torch.fx.node.map_arg(user.args, swap)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, swap)
            graph.erase_node(item)
    return torch.fx.GraphModule(gm, graph)


# What symbolic decompositions leave in graphs that GraphProgram has no lowering for.
_RETRACE = {
    torch.ops.prims.convert_element_type.default: lambda x, dtype: x.to(dtype),
    torch.ops.aten.true_divide.Tensor: torch.div,
}


def static_aten_program(aten_gm, kind, fallback, name, dump_dir):
    """A symbolic ATen graph compiled once per concrete input shape (the bucketed path's fallback):
    each new shape retraces the graph with its concrete sizes."""
    programs: dict = {}

    def run(args):
        key = tuple(_concrete_key(a) for a in args)
        prog = programs.get(key)
        if prog is None:
            if programs:
                metrics.recompiles["new input shapes (a bucketed graph without dynamic rules)"] += 1
            from torch.fx.experimental.proxy_tensor import make_fx  # loads with the first fallback
            static_gm = make_fx(aten_gm, tracing_mode="fake", decomposition_table=_RETRACE)(*args)
            with unset_fake_temporarily():
                prog = programs[key] = GraphProgram(static_gm, kind, fallback=fallback, name=name,
                                                    dump_dir=dump_dir)
        return prog(list(args))
    return run
