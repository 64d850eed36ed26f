"""``_foreach_*`` nodes without a lowering of their own: run element by element through the
lowering of their base op (``_foreach_add.List`` -> ``add.Tensor`` per pair of tensors)."""

from __future__ import annotations

import torch

from ..config import config
from .signature import OpSignature, mutates, signature_for

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
    """``_foreach_<op>.<ov>(lists...)``: the base op's signature and how each argument maps onto it."""

    def __init__(self, op, base, mapping):
        self.op = op
        self.signature = OpSignature(op, None)   # binds the foreach node's own arguments
        self.base = base
        self.mapping = mapping        # base arg index -> (foreach arg index, how) ; how: list/same/index


def foreach_plan(op):
    """The plan of a functional ``_foreach_*`` overload, or None when no base op lowers it."""
    schema = op._schema
    name = schema.name.split("::", 1)[1]
    if not name.startswith("_foreach_") or mutates(op):
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
        sig = signature_for(cand, config.platform)
        if sig is None:
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
            return ForeachPlan(op, sig, mapping)
    return None
