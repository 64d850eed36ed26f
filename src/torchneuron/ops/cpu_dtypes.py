"""The dtypes PyTorch's CPU kernels refuse, refused on neuron too.

A lowering is a JAX function: it computes ``abs`` of a bool tensor, ``gelu`` of an int64 one or a
complex ``clamp`` where ATen's CPU kernels raise (``"abs_cpu" not implemented for 'Bool'``). A result
no CPU run can be checked against is worse than CPU's error, and PyTorch's own tests (OpInfo's
``test_dtypes``) hold a device to CPU's dtype lists. ``data/cpu_dtype_refusals.json`` (package
data) records, per ATen overload, the argument dtypes CPU refused and its error, measured by running every OpInfo sample of
every dtype on CPU (``python -m tools.cpu_dtypes`` regenerates it for a new torch).

An eager kernel checks this once per executable-cache entry, when it plans one (the key holds every
dtype the check reads), so a cached call pays nothing. torch.compile graphs are not checked against
the table: they hold the ops of PyTorch's decompositions, with dtype combinations CPU's eager kernels
never see. Two kinds of refusal hold in graphs too (``graph_check``): ATen's rules for every device
(``RULES``: subtraction of a bool), and ``_foreach_*`` ops, which the user calls (decompositions do
not emit them) and which refuse what their base op refuses for any element (``_foreach_trunc`` of a
bool list is ``trunc`` of a bool tensor) -- the table, measured on single-tensor samples, has no
entries of their own.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch

from .signature import (
    OPT_SCALAR,
    OPT_TENSOR,
    OPT_TENSOR_LIST,
    SCALAR,
    TENSOR,
    TENSOR_LIST,
    registry_name,
    writes,
)

_CODES = {torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64", torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
          torch.float64: "f64", torch.complex64: "c64", torch.complex128: "c128"}
_VALUE_KINDS = (TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, SCALAR, OPT_SCALAR)


def _code(v):
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return _CODES.get(v.dtype, str(v.dtype))
    if isinstance(v, torch.dtype):
        return _CODES.get(v, str(v))
    if isinstance(v, list | tuple):
        return tuple(_code(x) for x in v)
    return type(v).__name__        # a Python scalar (or a wrapped number): its type picks the dtype


def checked_positions(sig) -> tuple[int, ...]:
    """The arguments whose dtypes a refusal depends on: tensors, scalars and ``dtype=`` arguments;
    not ``out=`` tensors (their dtype decides casting, not whether the kernel exists)."""
    positions = []
    for i, (arg, kind) in enumerate(zip(sig.overload._schema.arguments, sig.kinds)):
        if arg.kwarg_only and writes(arg):
            continue
        if kind in _VALUE_KINDS or str(arg.type) in ("ScalarType", "Optional[ScalarType]"):
            positions.append(i)
    return tuple(positions)


def dtype_signature(sig, values, wild: bool = False) -> tuple:
    """The dtypes of one call of ``sig`` (an ``OpSignature``) with bound ``values``, as the table
    spells them; ``wild``: ``Scalar`` arguments as "*" (whatever their type, for refusals that
    hold for every scalar the samples passed)."""
    kinds = sig.kinds
    return tuple("*" if wild and kinds[i] in (SCALAR, OPT_SCALAR) else _code(values[i])
                 for i in checked_positions(sig))


def has_empty_tensor(sig, values) -> bool:
    """A tensor argument without elements: CPU kernels often return before their dtype dispatch."""
    for i in checked_positions(sig):
        v = values[i]
        for t in (v if isinstance(v, list | tuple) else (v,)):
            if isinstance(t, torch.Tensor) and t.numel() == 0:
                return True
    return False


TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu_dtype_refusals.json")


class RefusalTable(NamedTuple):
    torch_version: str    # the torch the table was measured with
    refusals: dict        # overload -> {dtype signature (a tuple): (exception type, CPU's message)}


def _signature(codes) -> tuple:
    # JSON has lists where the table has tuples (a tensor list's dtypes nest).
    return tuple(_signature(c) if isinstance(c, list) else c for c in codes)


def load_table(path: str = TABLE_PATH) -> RefusalTable:
    """The table as ``tools/cpu_dtypes.py`` wrote it: ``{"torch_version": ..., "refusals":
    {overload: [[dtype signature, exception type, message], ...]}}``."""
    with open(path) as f:
        data = json.load(f)
    return RefusalTable(data["torch_version"],
                        {name: {_signature(sig): (kind, message) for sig, kind, message in entries}
                         for name, entries in data["refusals"].items()})


_table = None
# CPU gaps an accelerator fills: its half dtypes (erfcx of bfloat16), and kernels whose CUDA
# versions take dtypes CPU's refuse where model code relies on it (transformers' MoE layers call
# histc on int32 on accelerators).
_HALF = {"f16", "bf16"}
_ACCELERATOR_KERNELS = {"histc.default"}


def _refusals():
    global _table
    if _table is None:
        refusals = load_table().refusals   # a large table: read at the first plan
        _table = {name: {sig: hit for sig, hit in refused.items() if not _HALF & set(_flat(sig))}
                  for name, refused in refusals.items() if name not in _ACCELERATOR_KERNELS}
    return _table


def _flat(signature):
    for c in signature:
        if isinstance(c, tuple):
            yield from _flat(c)
        else:
            yield c


def refusals_of(name: str, functional: str | None = None) -> tuple[str, dict | None]:
    """(the table's entry, its refused dtype signatures or None) for overload ``name``: its own
    entry, else that of the functional overload it derives from."""
    table = _refusals()
    refused = table.get(name)
    if refused is None and functional is not None:
        return functional, table.get(functional)
    return name, refused


def _sub_rule(values):
    """ATen's ``sub_check`` (every device): a bool operand, tensor or Python bool, is refused."""
    bools = [isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype is torch.bool) for v in values[:2]]
    if all(bools):
        return "RuntimeError", ("Subtraction, the `-` operator, with two bool tensors is not supported. "
                                "Use the `^` or `logical_xor()` operator instead.")
    if any(bools):
        return "RuntimeError", ("Subtraction, the `-` operator, with a bool tensor is not supported. "
                                "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")
    return None


# Refusals CPU (and CUDA) decide by a rule, not by a dtype kernel list: overload -> rule(values) ->
# (exception type, message) or None. In-place and out= overloads are judged by their functional form.
RULES = {"sub.Tensor": _sub_rule, "sub.Scalar": _sub_rule, "rsub.Tensor": _sub_rule, "rsub.Scalar": _sub_rule}


def _refusal(name, functional, sig, values, table: bool):
    """(exception type, message) CPU raises for ``values`` of overload ``name``, or None."""
    rule = RULES.get(name) or (RULES.get(functional) if functional is not None else None)
    hit = rule(values) if rule is not None else None
    if hit is None and table:
        _, refused = refusals_of(name, functional)
        if refused and not has_empty_tensor(sig, values):
            hit = refused.get(dtype_signature(sig, values))
            if hit is None:
                hit = refused.get(dtype_signature(sig, values, wild=True))
    return hit


def _foreach_refusal(sig, values, table: bool):
    """A ``_foreach_*`` call: the refusal of its base op for the first element that has one."""
    # The plan maps the foreach arguments onto the base op's.
    from .foreach_plan import foreach_plan
    overload = sig.functional if sig.functional is not None else sig.overload
    plan = foreach_plan(overload)
    if plan is None:
        return None
    base = plan.base
    lists = [values[i] for i, how in plan.mapping.values() if how == "list" and isinstance(values[i], list | tuple)]
    for e in range(len(lists[0]) if lists else 0):
        bound = base.bind((), {}, missing=None)
        for j, (i, how) in plan.mapping.items():
            v = values[i]
            if how == "list":
                v = v[e]
            elif how == "index":     # _foreach_*.Tensor: element e's scalar, of the tensor's kind
                v = 0.0 if v.dtype.is_floating_point else (False if v.dtype is torch.bool else 0)
            bound[j] = v
        hit = _refusal(registry_name(base.overload), None, base, bound, table)
        if hit is not None:
            return hit
    return None


def _raise(sig, values, describe, hit):
    kind, message = hit
    cls = NotImplementedError if kind == "NotImplementedError" else RuntimeError
    raise cls(f"{message}\n[torchneuron] in {sig.name}{describe(values)}: PyTorch's CPU kernel refuses "
              "these dtypes too; convert the inputs to a dtype it supports")


def check(sig, values, describe, table: bool = True) -> None:
    """Raise CPU's error if its kernels refuse these dtypes for this overload (an in-place overload
    the table never saw is judged by its functional form). ``describe(values)`` names the inputs.
    ``table=False`` (graphs): the rules only, and ``_foreach_*`` ops element by element."""
    functional = None if sig.functional is None else registry_name(sig.functional)
    name = registry_name(sig.overload)
    hit = _refusal(name, functional, sig, values, table)
    if hit is None and name.startswith("_foreach_"):
        hit = _foreach_refusal(sig, values, table=True)
    if hit is not None:
        _raise(sig, values, describe, hit)


def _metas(values) -> str:
    """A graph node's arguments as an error names them: dtypes and sizes of its (meta) tensors."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(one(x) for x in v) + "]"
        return repr(v)
    return "(" + ", ".join(one(v) for v in values) + ")"


def graph_check(sig, values) -> None:
    """The refusals that hold in torch.compile graphs (see the module docstring), on metas."""
    check(sig, values, _metas, table=False)
