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
* ``mm_transposed_self``: ``mm(t(a), b)``, a Linear's weight gradient, computed in the
  orientation XLA:CPU runs fast (``ops/linalg.py``) when ``a`` (k x m) is wider than ``b`` (k x n).
  It materialises ``b.t()`` and the (m x n) result's transpose; with m <= n those cost more than
  they save (an MLP's down projection: a 1024 x 1024 saved activation transposed in 5 ms of a
  3 ms dot). The ``t`` stays when it has other users.
"""

from __future__ import annotations

import torch

from ..ops.linalg import mm_transposed_self
from ..ops.losses import log_softmax_nll_backward
from ..ops.precision import MATMUL
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
_LIB.define("mm_transposed_self(Tensor self, Tensor mat2) -> Tensor")
_LIB.impl("mm_transposed_self", lambda self, mat2: torch.mm(self.t(), mat2), "CompositeExplicitAutograd")

CROSS_ENTROPY_BACKWARD = torch.ops.torchneuron.log_softmax_nll_backward.default
_CROSS_ENTROPY_SIGNATURE = OpSignature(CROSS_ENTROPY_BACKWARD, Lowering(
    name="log_softmax_nll_backward", fn=log_softmax_nll_backward, derive_variants=False, graph_only=True))
MM_TRANSPOSED_SELF = torch.ops.torchneuron.mm_transposed_self.default
_MM_SIGNATURE = OpSignature(MM_TRANSPOSED_SELF, Lowering(
    name="mm_transposed_self", fn=mm_transposed_self, derive_variants=False, graph_only=True, precision=MATMUL,
    promote="common", promote_args=("self", "mat2")))
_MM = torch.ops.aten.mm.default
_TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


class Fusions:
    """The fused pairs of one graph: ``steps[consumer] = (signature, arguments)``, ``skipped`` the
    producers no step evaluates."""

    def __init__(self, graph: torch.fx.Graph, platform: str):
        self.steps: dict = {}
        self.skipped: set = set()
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is _LOG_SOFTMAX_BACKWARD:
                args = _cross_entropy_arguments(node, platform)
                if args is not None:
                    self.steps[node] = (_CROSS_ENTROPY_SIGNATURE, args)
                    self.skipped.add(node.args[0])
            elif node.target is _MM:
                source = _transposed_source(node.args[0])
                if source is not None and _wider_than(source, node.args[1]):
                    self.steps[node] = (_MM_SIGNATURE, (source, node.args[1]))
                    if len(node.args[0].users) == 1:
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


def _wider_than(a, b) -> bool:
    """Whether 2-D ``a`` (k x m) has more columns than 2-D ``b`` (k x n): the weight gradients
    ``mm_transposed_self`` speeds up (bench/weight_grad_dots.py)."""
    a_val = a.meta.get("val")
    b_val = b.meta.get("val") if isinstance(b, torch.fx.Node) else None
    if not (isinstance(b_val, torch.Tensor) and b_val.ndim == 2):
        return False
    m, n = a_val.shape[1], b_val.shape[1]
    return isinstance(m, int) and isinstance(n, int) and m > n


def _transposed_source(node):
    """``a`` when ``node`` is ``a`` transposed (a 2-D ``t``, ``transpose(0, 1)``, ``permute([1, 0])``)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES
            and not node.kwargs):
        return None
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.ndim != 2:
        return None
    if node.target is torch.ops.aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        return None
    if node.target is torch.ops.aten.permute.default and [d % 2 for d in node.args[1]] != [1, 0]:
        return None
    return source
