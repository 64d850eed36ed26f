"""Op pairs of AOTAutograd graphs that lower as one step (``GraphProgram`` plans them).

A graph is lowered node by node and XLA fuses what it can; a few pairs it cannot fuse well because
the second op reduces what the first one materialises. Each fusion here is an op of the
``torchneuron`` namespace with a CompositeExplicitAutograd kernel (the pair itself, so it runs
anywhere, and its meta is the pair's) and a pure JAX lowering in ``ops/``. The user's graph is not
rewritten: the planner skips the producer and gives the consumer's step the fused op's arguments.

* ``log_softmax_nll_backward``: cross-entropy's backward, ``_log_softmax_backward_data`` of
  ``nll_loss_backward``. The NLL gradient is a (batch x classes) one-hot whose row sums the
  log-softmax backward re-reduces; fused it is one elementwise pass over the logits (a language
  model's LM-head gradient: 8M elements for 1,024 tokens of an 8,192 vocabulary).
"""

from __future__ import annotations

import torch

from ..ops.losses import log_softmax_nll_backward
from ..ops.registry import Lowering
from ..ops.signature import OpSignature, signature_for

_LIB = torch.library.Library("torchneuron", "FRAGMENT")
_LIB.define(
    "log_softmax_nll_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, int reduction, "
    "SymInt ignore_index, Tensor total_weight, Tensor output, int dim, ScalarType input_dtype) -> Tensor")

_NLL_BACKWARD = (torch.ops.aten.nll_loss_backward.default, torch.ops.aten.nll_loss2d_backward.default)
_LOG_SOFTMAX_BACKWARD = torch.ops.aten._log_softmax_backward_data.default


def _cross_entropy_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight, output, dim,
                            input_dtype):
    nll = _NLL_BACKWARD[1] if self.dim() == 4 else _NLL_BACKWARD[0]
    grad = nll(grad_output, self, target, weight, reduction, ignore_index, total_weight)
    return _LOG_SOFTMAX_BACKWARD(grad, output, dim, input_dtype)


_LIB.impl("log_softmax_nll_backward", _cross_entropy_backward, "CompositeExplicitAutograd")

CROSS_ENTROPY_BACKWARD = torch.ops.torchneuron.log_softmax_nll_backward.default
_CROSS_ENTROPY_SIGNATURE = OpSignature(CROSS_ENTROPY_BACKWARD, Lowering(
    name="log_softmax_nll_backward", fn=log_softmax_nll_backward, derive_variants=False, graph_only=True))


class Fusions:
    """The fused pairs of one graph: ``steps[consumer] = (signature, arguments)``, ``skipped`` the
    producers no step evaluates."""

    def __init__(self, graph: torch.fx.Graph, platform: str):
        self.steps: dict = {}
        self.skipped: set = set()
        for node in graph.nodes:
            if node.op == "call_function" and node.target is _LOG_SOFTMAX_BACKWARD:
                args = _cross_entropy_arguments(node, platform)
                if args is not None:
                    self.steps[node] = (_CROSS_ENTROPY_SIGNATURE, args)
                    self.skipped.add(node.args[0])

    def describe(self) -> str:
        """What enters the graph's hash: which nodes were fused into what."""
        return ",".join(f"{n.name}:{sig.name}" for n, (sig, _) in self.steps.items())


def _cross_entropy_arguments(node, platform):
    """The fused op's arguments when ``node`` (a log-softmax backward) reduces an NLL backward over
    the class dim and is its only user; else None."""
    grad = node.args[0]
    if not (isinstance(grad, torch.fx.Node) and grad.op == "call_function" and grad.target in _NLL_BACKWARD
            and len(grad.users) == 1):
        return None
    nll_sig = signature_for(grad.target, platform)
    soft_sig = signature_for(_LOG_SOFTMAX_BACKWARD, platform)
    if nll_sig is None or soft_sig is None:
        return None
    nll_values = nll_sig.bind(grad.args, grad.kwargs, missing=None)
    _, output, dim, input_dtype = soft_sig.bind(node.args, node.kwargs, missing=None)
    val, out_val = grad.meta.get("val"), node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(out_val, torch.Tensor)):
        return None
    ndim = out_val.ndim
    class_dim = 1 if ndim >= 2 else 0
    if ndim == 0 or dim % ndim != class_dim or val.shape != out_val.shape:
        return None
    return (*nll_values, output, dim, input_dtype)
