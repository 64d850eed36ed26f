"""Where an op's index and mask arguments may live: PyTorch's CUDA rule, which neuron follows.

An accelerator op refuses CPU tensors among its arguments, except 0-dim ones where ATen takes them
as scalar operands. Index tensors are a case users meet when they migrate (``x[idx]`` with ``idx``
left on the CPU). What CUDA does, per op (ATen's sources and PyTorch's tests):

* accepted, moved to the device by the op: the ``indices`` of ``index`` (``x[idx]``), ``index_put``,
  ``index_put_`` and ``_index_put_impl_`` (``x[idx] = v``), masks included, and ``_unsafe_index``
  and ``_unsafe_index_put`` (index and index_put without bounds checks, which ATen implements
  through them: what decompositions of upsampling emit) -- ``index``'s meta
  function allows "indices ... either on cpu or on the same device as the indexed tensor", and
  ``make_info``/``computeLinearIndex`` move them (test_indexing.py ``test_cpu_indices``,
  ``test_index_put_src_datatype``). The value of ``index_put_`` may be on the CPU only when 0-dim
  (``test_invalid_device``). ``eager/host_ops.py`` does the move on neuron, as a counted
  host->device copy.
* refused, a 0-dim CPU index included: ``DEVICE_INDEX`` below. ``index_fill_`` runs a
  TensorIterator over the index restrided to ``self``'s rank (never a CPU scalar there);
  ``index_copy``'s meta check, ``take``'s and ``put_``'s checks ("self, index and ... expected to be
  in the same device"), ``masked_fill_``'s ("expected self and mask to be on the same device"),
  ``index_select``'s ("Input, output and indices must be on the current device"), and the device
  check of the generated CUDA wrappers (``index_add``, ``index_reduce``, ``gather``, ``scatter*``:
  test_indexing.py ``test_gather_take_along_dim_cross_device``).

The refusal names the op, the argument, both devices and the way out. Eager kernels apply the rule
once per cache entry; torch.compile graphs once per graph (``check_graph_node``): Dynamo's fake
tensors refuse CPU index tensors with elements already, but take 0-dim ones as CPU scalars.
"""

from __future__ import annotations

import torch

# Op (schema name without the in-place underscore) -> its index or mask argument, which CUDA
# requires on the op's device even when it is a 0-dim tensor.
DEVICE_INDEX = {
    "index_fill": "index",
    "index_add": "index",
    "index_copy": "index",
    "index_reduce": "index",
    "index_select": "index",
    "gather": "index",
    "scatter": "index",
    "scatter_add": "index",
    "scatter_reduce": "index",
    "masked_fill": "mask",
    "take": "index",
    "put": "index",
}

# The ops that take index tensors (and masks) on the CPU, for the refusal's hint.
HOST_INDEX_OPS = "x[idx], x[idx] = v, index_put_, index_put, _unsafe_index and _unsafe_index_put"


def device_index_name(packet: str) -> str | None:
    """The argument ``DEVICE_INDEX`` names for an op's schema name ("index_add_"), or None."""
    if packet.endswith("_") and not packet.endswith("__"):
        packet = packet[:-1]
    return DEVICE_INDEX.get(packet)


def device_index_argument(overload) -> int | None:
    """Position of the argument of ``overload`` that ``DEVICE_INDEX`` names, or None."""
    arg = device_index_name(overload._schema.name.split("::", 1)[-1])
    if arg is None:
        return None
    return next((i for i, a in enumerate(overload._schema.arguments) if a.name == arg), None)


def mismatch_error(op_name: str, arg_name: str, t: torch.Tensor, device_index: int, index_arg: bool,
                   describe: str) -> RuntimeError:
    """The error for argument ``arg_name`` of ``op_name`` living on ``t.device`` while the op runs on
    neuron:``device_index``: PyTorch's CUDA text, then what torchneuron knows and the way out."""
    target = f"neuron:{device_index}"
    message = ("Expected all tensors to be on the same device, but found at least two devices, "
               f"{target} and {t.device}! (when checking argument for argument {arg_name} in method "
               f"{op_name})\n[torchneuron] in {op_name}{describe}: move '{arg_name}' to the op's device "
               f"first ({arg_name}.to('{target}')).")
    if index_arg and t.device.type == "cpu":
        message += (f" As on CUDA, {op_name} takes its {arg_name} only on the device; index tensors and "
                    f"masks may stay on the CPU for {HOST_INDEX_OPS} only.")
    return RuntimeError(message)


def check_graph_node(sig, node) -> None:
    """The rule for one op node of a torch.compile graph, from its arguments' fake tensors."""
    i = sig.device_index_arg
    if i is None:
        return
    values = sig.bind(node.args, node.kwargs)
    index = _fake(values[i])
    if index is None or index.device.type != "cpu":
        return
    device_index = next((v.device.index or 0 for v in map(_fake, values)
                         if v is not None and v.device.type == "neuron"), 0)
    raise mismatch_error(sig.name, sig.arg_names[i], index, device_index, True,
                         f" (graph node {node.name})")


def _fake(v):
    val = getattr(v, "meta", {}).get("val")
    return val if isinstance(val, torch.Tensor) else None
