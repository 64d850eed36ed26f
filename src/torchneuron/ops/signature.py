"""How a lowering is called: the one reading of ATen schemas that every caller shares.

Eager kernels (``eager.kernel.Kernel`` adds a cache key and an executable), adaptive eager (which
records those kernels) and torch.compile graphs (``compile.interpreter``) all go through this
module, so they agree on:

* schema facts -- each argument's kind (tensor, Scalar, static...), which arguments an op mutates,
  which returns alias a mutated input, and how functional, in-place and ``out=`` overloads pair up;
* argument binding (positional, keyword, defaults, in schema order);
* dtype promotion, calling the lowering (positional/keyword split, PRNG key, contiguity flag) and
  splitting its results into new values of mutated arguments and new outputs;
* casting results to the dtypes PyTorch's meta functions give, and assembling what the op returns;

An ``OpSignature`` is built once per overload (eager: once per kernel); its methods run at trace
or plan time, except ``bind`` and ``returned``, which eager runs on every call and which do only
list work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..runtime.dtypes import cast, device_dtype, dtype_name, jax_dtype
from . import devices, registry
from .registry import Lowering

# An argument with no default value, not yet bound.
REQUIRED = object()

# Argument kinds: what an argument becomes in an executable (a traced input, a runtime scalar, or a
# compiled-in Python value). The one enumeration of them: ATen schemas use the first eight
# (``kind_of``); custom kernels' bodies also tell ``Scalar[]`` and ``ScalarType`` arguments apart
# (``kernels.body.arg_kind``).
TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, SCALAR, OPT_SCALAR, STATIC, GENERATOR, SCALAR_LIST, DTYPE = range(10)


def kind_of(arg) -> int:
    t = str(arg.type)
    if t == "Tensor":
        return TENSOR
    if t == "Optional[Tensor]":
        return OPT_TENSOR
    if t == "List[Tensor]" or t == "List[number]":
        # Scalar[] (the _foreach_*.ScalarList ops): runtime values, like a list's wrapped numbers.
        return TENSOR_LIST
    if t == "List[Optional[Tensor]]":
        return OPT_TENSOR_LIST
    if t == "number":
        return SCALAR
    if t == "Optional[number]":
        return OPT_SCALAR
    if t == "Optional[Generator]":
        # Neither input nor compiled in: it only picks the (seed, offset) inputs of random ops.
        return GENERATOR
    return STATIC


# -- schema facts ---------------------------------------------------------------------------------
def registry_name(op) -> str:
    """Registry spelling of an overload: "add.Tensor", "index_put_.default"."""
    schema = op._schema
    return f"{schema.name.split('::', 1)[1]}.{schema.overload_name or 'default'}"


def aten_overload(name: str):
    """The ``torch.ops.aten`` overload a registry name ("add.Tensor") stands for."""
    packet, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), ov or "default")


def writes(arg) -> bool:
    """The schema says the op writes this argument (``Tensor(a!)``)."""
    return arg.alias_info is not None and arg.alias_info.is_write


def mutates(op) -> bool:
    return any(writes(a) for a in op._schema.arguments)


def out_names(op) -> list[str]:
    """Names of an ``out=`` overload's output arguments (keyword-only and written)."""
    return [a.name for a in op._schema.arguments if a.kwarg_only and writes(a)]


def _inputs_key(op):
    """(name, type) of every argument but the ``out=`` ones: equal for an op and its out= form."""
    return tuple((a.name, str(a.type)) for a in op._schema.arguments if not (a.kwarg_only and writes(a)))


def variants_of(functional):
    """(in-place overload, out= overload) computing what ``functional`` computes; either may be None."""
    if mutates(functional):
        return None, None
    schema = functional._schema
    packet_name = schema.name.split("::", 1)[1]
    ov = schema.overload_name or "default"
    inplace = None
    inplace_packet = getattr(torch.ops.aten, packet_name + "_", None)
    if inplace_packet is not None and ov in inplace_packet.overloads():
        inplace = getattr(inplace_packet, ov)
    want = _inputs_key(functional)
    packet = getattr(torch.ops.aten, packet_name)
    for cand in packet.overloads():
        op = getattr(packet, cand)
        if out_names(op) and all(a.kwarg_only for a in op._schema.arguments if writes(a)) \
                and _inputs_key(op) == want:
            return inplace, op
    return inplace, None


def functional_of(out_op):
    """For an ``out=`` overload, the functional overload computing the same thing (or None)."""
    if not out_names(out_op):
        return None
    want = _inputs_key(out_op)
    packet = getattr(torch.ops.aten, out_op._schema.name.split("::", 1)[1])
    for name in packet.overloads():
        cand = getattr(packet, name)
        if cand is not out_op and tuple((a.name, str(a.type)) for a in cand._schema.arguments) == want:
            return cand
    return None


def is_composite_implicit(op) -> bool:
    """Ops PyTorch decomposes above the backend (autograd comes from the decomposition): a backend
    kernel would bypass their derivative, so eager mode never reaches one."""
    schema = op._schema
    qualname = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeImplicitAutograd")


def lowers_in_eager(lowering: Lowering, op, platform: str) -> bool:
    """Whether eager mode gives ``op`` a kernel driven by ``lowering`` on ``platform``.

    A lowering of a CompositeImplicitAutograd op would never be reached in eager mode; registering
    one by mistake is an error unless it says ``graph_only=True``.
    """
    if lowering.graph_only or (lowering.platforms is not None and platform not in lowering.platforms):
        return False
    if is_composite_implicit(op):
        raise RuntimeError(
            f"torchneuron: a lowering is registered for aten::{lowering.name}, which PyTorch decomposes "
            "above the backend (CompositeImplicitAutograd): eager mode would never call it. Register it "
            "with graph_only=True if torch.compile graphs need it, or lower the ops it decomposes into.")
    return True


# -- one overload's signature ---------------------------------------------------------------------
class OpSignature:
    """What the schema of one overload (and its lowering) says about calling that lowering.

    ``functional`` is set for in-place variants derived from a functional lowering (``add_.Tensor``
    runs ``add.Tensor``'s lowering). With ``lowering=None`` only the schema facts are meaningful.
    """

    def __init__(self, overload, lowering: Lowering | None, functional=None):
        self.overload = overload
        self.lowering = lowering
        self.functional = functional
        self.name = overload.name()            # "aten::add.Tensor"
        self.short_name = self.name.split("::", 1)[1]
        schema = overload._schema
        args = schema.arguments
        self.arg_names = [a.name for a in args]
        self.kwarg_only = [a.kwarg_only for a in args]
        self.defaults = [a.default_value if a.has_default_value() else REQUIRED for a in args]
        self.index_of = {a.name: i for i, a in enumerate(args)}
        self.kinds = [kind_of(a) for a in args]
        # Arguments that are inputs of an executable (traced or runtime values) vs compiled in.
        self.generator_index = next((i for i, k in enumerate(self.kinds) if k == GENERATOR), None)
        self.dynamic = [i for i, k in enumerate(self.kinds) if k not in (STATIC, GENERATOR)]
        self.static = [i for i, k in enumerate(self.kinds) if k == STATIC]
        if lowering is not None and lowering.static_scalars:
            self.dynamic = [i for i in self.dynamic if self.kinds[i] not in (SCALAR, OPT_SCALAR)]
            self.static = sorted(set(range(len(args))) - set(self.dynamic) - {self.generator_index})
        extra_mutated = lowering.mutates if lowering is not None else ()
        # Mutated arguments (in-place self, out=, running stats...) in schema order.
        self.mutated = [i for i, a in enumerate(args) if writes(a) or a.name in extra_mutated]
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
        # The index argument CUDA wants on the device even as a 0-dim CPU tensor (ops/devices.py).
        self.device_index_arg = devices.device_index_argument(overload)
        self.same_dtype = None
        if lowering is not None and lowering.same_dtype is not None:
            a, b, message = lowering.same_dtype
            self.same_dtype = (self.index_of[a], self.index_of[b], a, b, message)
        self.promote_idx = None
        if lowering is not None and lowering.promote:
            names = lowering.promote_args or tuple(
                a.name for a, k in zip(args, self.kinds) if k in (TENSOR, SCALAR, OPT_SCALAR, OPT_TENSOR)
                and not a.kwarg_only)
            self.promote_idx = [self.index_of[n] for n in names if n in self.index_of]

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, args, kwargs, missing=REQUIRED) -> list:
        """The arguments in schema order: positional, then defaults, then keywords."""
        values = list(args)
        n = len(values)
        defaults = self.defaults
        if n < len(defaults):
            if missing is REQUIRED:
                values.extend(defaults[n:])
            else:
                values.extend(missing if d is REQUIRED else d for d in defaults[n:])
        if kwargs:
            index_of = self.index_of
            for k, v in kwargs.items():
                values[index_of[k]] = v
        return values

    def split_call(self, values):
        """(positional, keyword) arguments of a call in schema order, for the op or its lowering."""
        pos = [v for v, kwo in zip(values, self.kwarg_only) if not kwo]
        kw = {n: v for n, v, kwo in zip(self.arg_names, values, self.kwarg_only) if kwo}
        return pos, kw

    def mutated_tensors(self, values):
        """(argument index, position in its list, tensor) of every mutated tensor in ``values``."""
        found = []
        for i in self.mutated:
            v = values[i]
            if v is None:
                continue
            for pos, t in enumerate(v if isinstance(v, list | tuple) else (v,)):
                found.append((i, pos, t))
        return found

    def other_tensors(self, values):
        """The tensor arguments other than the written ones (list elements included: index_put_'s
        indices); the written tensor passed again as another argument is one of them."""
        written = self.mutated
        return [t for i, v in enumerate(values) if i not in written
                for t in (v if isinstance(v, list | tuple) else (v,)) if isinstance(t, torch.Tensor)]

    # -- results ----------------------------------------------------------------------------------
    def new_output_metas(self, meta_out) -> list:
        """The entries of the op's (meta) result that are new tensors, not aliases of inputs."""
        if self.returns_list:
            return list(meta_out) if self.new_outputs else []
        outs = meta_out if isinstance(meta_out, tuple) else (meta_out,)
        return [o for o, src in zip(outs, self.return_sources) if src is None]

    def returned(self, outs, sources):
        """What the op returns: its new outputs, and for each return that aliases a mutated input,
        ``sources[i]`` (the input itself in eager mode, its new value in a graph)."""
        if self.returns_list:
            return outs
        returned = []
        j = 0
        for src in self.return_sources:
            if src is None:
                returned.append(outs[j])
                j += 1
            else:
                returned.append(sources[src])
        if not returned:
            return None
        return returned[0] if len(returned) == 1 else tuple(returned)

    def check_dtypes(self, values) -> None:
        """The dtype rules CPU kernels check and meta kernels do not (``Lowering.same_dtype``):
        at plan/trace time, on tensors or their metas. (Graphs also check ``cpu_dtypes.graph_check``,
        eager plans the whole table, ``cpu_dtypes.check``.)"""
        if self.same_dtype is None:
            return
        i, j, a, b, message = self.same_dtype
        x, y = values[i], values[j]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype != y.dtype:
            raise RuntimeError(message.format(**{a: dtype_name(x.dtype), b: dtype_name(y.dtype)}))

    # -- promotion and the call -------------------------------------------------------------------
    def promotion_dtype(self, values, new_meta):
        """The dtype the lowering's promoted arguments are cast to, from (meta) tensors and scalars."""
        if self.lowering.promote == "result":
            if new_meta:
                return device_dtype(new_meta[0].dtype, self.short_name)
            return values[self.mutated[0]].dtype
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

    def input_contiguous(self, values):
        """Whether the lowering's ``contiguity_of`` argument (a tensor or its meta) is C-contiguous."""
        name = self.lowering.contiguity_of
        return None if name is None else bool(values[self.index_of[name]].is_contiguous())

    def call_lowering(self, values, promote, key, n_mut, n_new, contiguous=None):
        """Run the lowering on materialised arguments.

        ``values`` holds the arguments in schema order (tensors as jax arrays) and is updated in
        place. Arguments named by the lowering's promotion are cast to ``promote`` (a torch dtype or
        None); ``key`` is the PRNG key of a random lowering; ``contiguous`` whether the lowering's
        ``contiguity_of`` argument is C-contiguous. Returns (new values of the ``n_mut`` mutated
        tensors, the ``n_new`` new outputs) -- a lowering returns the mutated arguments first.
        """
        low = self.lowering
        if promote is not None:
            for i in self.promote_idx:
                v = values[i]
                if v is None:
                    continue
                if i in self.static:
                    # Static Scalars (static_scalars lowerings) are compiled-in Python numbers.
                    if self.kinds[i] in (SCALAR, OPT_SCALAR):
                        values[i] = jnp.asarray(v, dtype=jax_dtype(promote))
                else:
                    values[i] = cast(v, promote)
        if low.overwrites:
            for i in self.mutated:
                if isinstance(values[i], jax.Array):
                    values[i] = jnp.zeros(values[i].shape, values[i].dtype)
        pos, kw = self.split_call(values)
        if low.random:
            kw["key"] = key
        if low.contiguity_of is not None:
            kw["contiguous"] = contiguous
        result = low.fn(*pos, **kw)
        if self.functional is not None and not isinstance(result, tuple):
            # In-place forms of list ops (_foreach_add_) mutate every tensor of the list.
            result = tuple(result) if isinstance(result, list) else (result,)
        results = list(result) if isinstance(result, list | tuple) else [result]
        # Mutated arguments come first in what a lowering returns, then new outputs.
        mutated_vals = results[:n_mut] if self.mutated else []
        new_vals = results[n_mut:] if self.mutated else results
        if self.returns_list and len(new_vals) == 1 and isinstance(new_vals[0], list | tuple):
            new_vals = list(new_vals[0])
        if len(new_vals) != n_new or len(mutated_vals) != n_mut:
            raise RuntimeError(
                f"torchneuron: lowering of {self.name} returned {len(results)} values; the "
                f"schema needs {n_mut} mutated + {n_new} new outputs (a bug in the lowering)"
            )
        return mutated_vals, new_vals

    def fit_output(self, value, dtype, shape, *, reshape_same_size=False):
        """A new output of the lowering as PyTorch's meta function describes it: cast to ``dtype``,
        with ``shape``. A 0-d value of one element takes the shape; ``reshape_same_size`` also
        accepts any value of the right size, and an empty one (graphs: eval-mode batch norm's saved
        statistics, which PyTorch's CPU kernels return empty while its meta functions say [C])."""
        value = cast(jnp.asarray(value), dtype)
        shape = tuple(shape)
        if tuple(value.shape) == shape:
            return value
        numel = 1
        for s in shape:
            numel *= s
        if value.size == numel and (value.ndim == 0 or reshape_same_size):
            return value.reshape(shape)
        if reshape_same_size and value.size == 0:
            return jnp.zeros(shape, value.dtype)
        raise RuntimeError(
            f"torchneuron: lowering of {self.name} produced shape {tuple(value.shape)}, "
            f"PyTorch expects {shape} (a bug in the lowering)")


# -- signatures for graphs ------------------------------------------------------------------------
_signatures: dict = {}
# Ops outside ATen that bring their own lowering (torchneuron.kernel custom ops), registered by the
# package that defines them: graphs find them here like ATen ops.
_registered: dict = {}


def register_signature(op, sig) -> None:
    """Make ``sig`` (an OpSignature with its lowering) the signature graphs lower ``op`` with;
    ``sig=None`` forgets it."""
    if sig is None:
        _registered.pop(op, None)
    else:
        _registered[op] = sig


def signature_for(op, platform: str):
    """The signature (with its lowering) an overload runs with, or None without a lowering.

    One registered with ``register_signature`` (custom kernels); for ATen: the overload's own lowering, or for an in-place overload the functional lowering eager mode
    derives it from (``add_.Tensor`` from ``add.Tensor``).
    """
    sig = _registered.get(op)
    if sig is not None:
        return sig
    if op in _signatures:
        return _signatures[op]
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
        name = registry_name(op)
        low = registry.get(name)
        if low is not None:
            sig = OpSignature(op, low)
        else:
            sig = _derived_inplace(op, name, platform)
    _signatures[op] = sig
    return sig


def _derived_inplace(op, name, platform):
    packet, _, ov = name.partition(".")
    if not packet.endswith("_") or packet.endswith("__"):
        return None
    base = f"{packet[:-1]}.{ov}"
    low = registry.get(base)
    if low is None or not low.derive_variants or is_composite_implicit(op):
        return None
    functional = aten_overload(base)
    if not lowers_in_eager(low, functional, platform) or variants_of(functional)[0] is not op:
        return None
    return OpSignature(op, low, functional=functional)
