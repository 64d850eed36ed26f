"""How a graph's outputs come back: new buffers, aliases of each other, inputs and views of them.

Computed outputs are grouped by the (fake) storage they share, so outputs that alias each other
(``y`` and ``y.view(-1)``) come back as views of one buffer, as in eager mode; outputs that are
graph inputs or views of them are returned as real aliases of the inputs.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..runtime import layout, memory
from ..runtime.dtypes import device_dtype
from .errors import metric_name

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_AS_STRIDED = torch.ops.aten.as_strided.default.redispatch


class OutputPlan:
    """``buffers``: the device buffers the executable returns, each ("node", node, dtype, sizes,
    strides) or ("storage", [(member node, sizes, strides, offset)...], dtype, (numel,), (1,));
    ``host_outputs``: nodes whose values live on the CPU; ``outputs``: per graph output, where its
    value comes from (``assemble``)."""

    def __init__(self, placeholders, output_node):
        ph_storage = {}
        for i, ph in enumerate(placeholders):
            v = ph.meta.get("val")
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                ph_storage.setdefault(StorageWeakRef(v.untyped_storage()), i)
        ph_index = {ph: i for i, ph in enumerate(placeholders)}
        plans, groups, host = [], {}, {}
        for out in flat_outputs(output_node):
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
            if src is not None and placeholders[src].meta["val"].dtype == val.dtype:
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
            dtype = device_dtype(torch_dtype, metric_name(nodes[0]))
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
        self.outputs = [where[p[2]] if p[0] == "group" else p for p in plans]

    def new_tensors(self, results, device_index):
        """The executable's new device buffers as neuron tensors (its first results)."""
        return [memory.new_buffer_tensor(buf, dtype, device_index, sizes, strides)
                for buf, (_, _, dtype, sizes, strides) in zip(results, self.buffers)]

    def assemble(self, new, host_vals, args):
        """The graph's outputs from its new tensors, host values and the call's inputs."""
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
                outs.append(static_value(p[1]))
            else:
                outs.append(p[1])
        return outs


def _covers(val, numel) -> bool:
    """The fake tensor spans its whole storage densely from offset 0."""
    sizes, strides = tuple(val.shape), tuple(val.stride())
    return val.storage_offset() == 0 and val.numel() == numel and layout.is_dense(sizes, strides)


def flat_outputs(output_node):
    out = output_node.args[0]
    return list(out) if isinstance(out, list | tuple) else [out]


def static_value(node):
    """A node whose value is known from the trace (a size: shapes are static)."""
    v = node.meta.get("val")
    return int(v) if isinstance(v, torch.SymInt | int) else v
