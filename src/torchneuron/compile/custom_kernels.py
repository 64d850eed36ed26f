"""Custom kernels (``torchneuron.kernel``) inside torch.compile graphs.

A functional kernel is an ordinary graph node (its OpOverload) whose signature ``kernels``
registered with ``ops.signature``: the same JAX body, traced into the graph's one executable. A mutating kernel reaches the
backend functionalized by AOTAutograd, as an ``auto_functionalized`` (v1) or
``auto_functionalized_v2`` node: the op's arguments, the mutated ones given as views of "bases",
and a result of (the op's outputs..., the new value of every base). ``run_auto_functionalized``
evaluates such a node from the kernel's body.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from torch._higher_order_ops.auto_functionalize import (
    AliasViewInfo,
    AsStridedViewInfo,
    NotView,
    SliceViewInfo,
    get_mutable_args_from_schema,
    read_view_information_from_args,
)

from ..kernels import NeuronKernel
from ..ops.signature import signature_for
from ..runtime import layout
from ..runtime.dtypes import cast, device_dtype, jax_dtype

AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def auto_functionalized_kernel(node, platform):
    """The signature of the mutating custom kernel an ``auto_functionalized`` node wraps, or None."""
    op = node.args[0] if node.args else None
    sig = signature_for(op, platform) if isinstance(op, torch._ops.OpOverload) else None
    return sig if isinstance(sig, NeuronKernel) else None


def kernels_in(steps) -> list:
    """The custom kernels a planned graph runs (one entry per node)."""
    return [s.signature for s in steps if isinstance(s.signature, NeuronKernel)]


def fingerprint(kernels) -> str:
    """Which registration of each custom kernel a graph runs: a kernel re-registered with a new body
    (a notebook cell run again) must not reuse executables traced from the old one."""
    return ";".join(sorted({f"{k.name}#{k.body.serial}" for k in kernels}))


def run_auto_functionalized(k, node, lookup, meta_of):
    """The value of an auto_functionalized(_v2) node: (outputs..., new bases or new arguments)."""
    op = node.args[0]
    schema = op._schema
    kwargs = dict(node.kwargs)
    names, types = get_mutable_args_from_schema(schema)
    v2 = node.target is torch.ops.higher_order.auto_functionalized_v2
    if v2:
        base_nodes = list(kwargs.pop("_all_bases"))
        bases = [lookup(b) for b in base_nodes]
        base_metas = [meta_of(b) for b in base_nodes]
        kwargs.pop("_only_clone_these_bases", None)
        info = read_view_information_from_args(names, types, kwargs, base_nodes)
        mutated = {n: _map(info[n], lambda vi: _regenerate(vi, bases, base_metas)) for n in names}
    else:
        kwargs.pop("_only_clone_these_tensors", None)
        mutated = {n: lookup(kwargs[n]) for n in names}
    values = []
    for a in schema.arguments:
        if a.name in mutated:
            values.append(mutated[a.name])
        elif a.name in kwargs:
            values.append(lookup(kwargs[a.name]))
        else:
            values.append(a.default_value if a.has_default_value() else None)
    targets = [(n, j, x) for n in names for j, x in _items(mutated[n]) if x is not None]
    out_meta = meta_of(node)
    n_returns = len(schema.returns)
    new_meta = out_meta[0] if k.returns_list else list(out_meta[:n_returns])
    mutated_vals, new_vals = k.call_lowering(values, None, None, len(targets), len(new_meta))
    outs = [cast(jnp.asarray(v), device_dtype(m.dtype, k.name)) for v, m in zip(new_vals, new_meta)]
    if k.returns_list:
        head = [outs]
    elif n_returns == 0:
        head = [None]
    else:
        head = outs
    new_values = {(n, j): v for (n, j, _), v in zip(targets, mutated_vals)}
    if not v2:
        tail = []
        for n in names:
            cur = mutated[n]
            if isinstance(cur, list):
                tail.append([new_values.get((n, j), x) for j, x in enumerate(cur)])
            else:
                tail.append(new_values.get((n, None), cur))
        return tuple(head) + tuple(tail)
    new_bases = list(bases)
    for n in names:
        for j, vi in _items(info[n]):
            if vi is not None and (n, j) in new_values:
                b = vi.base_index
                new_bases[b] = _write_back(vi, new_bases[b], base_metas[b], new_values[(n, j)])
    return tuple(head) + tuple(new_bases)


def _items(v):
    if isinstance(v, list):
        return list(enumerate(v))
    return [(None, v)]


def _map(v, fn):
    if v is None:
        return None
    if isinstance(v, list):
        return [None if x is None else fn(x) for x in v]
    return fn(v)


def _storage(base, meta):
    """The base's flat storage (bases are whole tensors: contiguous from offset 0)."""
    if meta.storage_offset() != 0 or not meta.is_contiguous():
        raise NotImplementedError(
            f"a mutating custom kernel on a view of a non-contiguous base {list(meta.shape)} "
            f"(strides {list(meta.stride())}) inside a compiled graph")
    return base.reshape(-1)


def _regenerate(vi, bases, metas):
    base, meta = bases[vi.base_index], metas[vi.base_index]
    if isinstance(vi, NotView | AliasViewInfo):
        return base
    if isinstance(vi, SliceViewInfo):
        idx = [slice(None)] * base.ndim
        idx[vi.dim] = slice(vi.start, vi.end)
        return base[tuple(idx)]
    if isinstance(vi, AsStridedViewInfo):
        return layout.read(_storage(base, meta), base.dtype, tuple(vi.size), tuple(vi.stride), vi.storage_offset)
    raise NotImplementedError(f"view kind {type(vi).__name__} of a mutated custom-kernel argument")


def _write_back(vi, base, meta, value):
    value = value.astype(base.dtype)
    if isinstance(vi, NotView | AliasViewInfo):
        return value.reshape(base.shape)
    if isinstance(vi, SliceViewInfo):
        idx = [slice(None)] * base.ndim
        idx[vi.dim] = slice(vi.start, vi.end)
        return base.at[tuple(idx)].set(value)
    storage = layout.write(_storage(base, meta), value, jax_dtype(meta.dtype), tuple(vi.size), tuple(vi.stride),
                           vi.storage_offset)
    return storage.reshape(base.shape)
