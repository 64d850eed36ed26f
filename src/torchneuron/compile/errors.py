"""Errors of torch.compile(backend="neuron") that name the op, its inputs and the user's line."""

from __future__ import annotations

import os

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)


class NeuronCompileError(RuntimeError):
    """A graph torch.compile(backend="neuron") cannot turn into an executable."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


class NodeFailure(Exception):
    """A node whose lowering failed while the graph was traced (reported by ``lowering_error``)."""

    def __init__(self, node, error):
        super().__init__(str(error))
        self.node = node
        self.error = error


def meta_of(v):
    """The fake tensor (``meta['val']``) of an FX node, recursively through lists."""
    if isinstance(v, torch.fx.Node):
        return v.meta.get("val", v.name)
    if isinstance(v, list | tuple):
        return type(v)(meta_of(x) for x in v)
    return v


def _describe_meta(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor{list(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_describe_meta(x) for x in v) + "]"
    return repr(v)


def describe_node(node) -> str:
    args = [_describe_meta(meta_of(a)) for a in node.args]
    args += [f"{k}={_describe_meta(meta_of(v))}" for k, v in node.kwargs.items()]
    return "(" + ", ".join(args) + ")"


def user_source(node) -> str:
    """The user's source line that produced ``node`` (from the trace's stack), or ''."""
    stack = node.meta.get("stack_trace") or ""
    lines = stack.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if not frames:
        return ""
    # The innermost frame outside torch itself is the user's line.
    pick = next((i for i in reversed(frames) if _TORCH_DIR not in lines[i]), frames[-1])
    return "\n".join(x.rstrip() for x in lines[pick:pick + 2])


def target_name(node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.name()
    return getattr(t, "__name__", str(t))


def metric_name(node) -> str:
    """Op names as the other metrics spell them ("add.Tensor", "special_bessel_j0")."""
    return target_name(node).removeprefix("aten::")


def lowering_error(node, kind, reason) -> NeuronCompileError:
    where = user_source(node)
    where = f"\n  from your code:\n    {where.strip()}" if where else ""
    name = target_name(node)
    return NeuronCompileError(
        f"torchneuron: torch.compile(backend=\"neuron\") cannot lower {name} {describe_node(node)} in "
        f"this {kind} graph: {reason}.{where}\n  Run such graphs eagerly on neuron instead with "
        "torch.compile(..., options={\"fallback\": \"eager\"}) or TORCHNEURON_COMPILE_FALLBACK=eager "
        "(torchneuron.config.compile_fallback = \"eager\"), or avoid the op.",
        op=name)
