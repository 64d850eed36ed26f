"""Printing neuron tensors: format a host copy (one transfer) instead of running the formatter's
dozen small ops, and their float64 conversions, on the device."""

from __future__ import annotations

import torch
import torch._tensor_str as tensor_str

_original_str_intern = tensor_str._str_intern


def _str_intern(inp, *, tensor_contents=None):
    # Only real neuron tensors (plain Tensors and Parameters): fake/functional subclasses that merely
    # report device neuron (Dynamo, AOTAutograd logging) have no data to copy.
    if (tensor_contents is None and type(inp) in (torch.Tensor, torch.nn.Parameter) and inp.device.type == "neuron"
            and inp.layout == torch.strided and not torch._C._functorch.is_functorch_wrapped_tensor(inp)):
        host = inp.detach().cpu()
        tensor_contents = tensor_str._tensor_str(host, len("tensor("))
    return _original_str_intern(inp, tensor_contents=tensor_contents)


def install() -> None:
    tensor_str._str_intern = _str_intern
