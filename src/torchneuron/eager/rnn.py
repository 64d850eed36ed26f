"""Eager nn.LSTM / nn.GRU / nn.RNN: one fused executable forward and one backward.

PyTorch's ``aten::lstm`` (``gru``, ``rnn_tanh``, ``rnn_relu``) is CompositeImplicitAutograd, so a
plain backend kernel would never be reached with autograd on. ``install(lib)`` registers an
``AutogradPrivateUse1`` kernel for those ops that runs the forward as the custom op
``torchneuron::rnn`` (which also returns the dropout PRNG key) and the backward as
``torchneuron::rnn_backward``; both are ordinary ``Kernel``s over the pure JAX bodies in ``ops/rnn.py``.
A backward that must itself be differentiable (``create_graph=True``) runs ATen's composite RNN
instead (one fused cell per time step, each with its derivative).
"""

from __future__ import annotations

import torch

from ..ops.precision import RNN
from ..ops.registry import Lowering
from ..ops.rnn import GATES, rnn_fused, rnn_fused_backward
from .kernel import Kernel

_DEF = torch.library.Library("torchneuron", "DEF")
_ARGS = ("str mode, Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
         "float dropout, bool train, bool bidirectional, bool batch_first")
_DEF.define(f"rnn({_ARGS}) -> Tensor[]")
_DEF.define(f"rnn_backward(Tensor[] grads, Tensor key_data, {_ARGS}) -> Tensor[]")


_FORWARD = Lowering(name="rnn", fn=rnn_fused, random=True, derive_variants=False, shape_from_lowering=True,
                    precision=RNN)
_BACKWARD = Lowering(name="rnn_backward", fn=rnn_fused_backward, derive_variants=False, shape_from_lowering=True,
                     precision=RNN)
_kernels: dict = {}


def _kernel(which):
    k = _kernels.get(which)
    if k is None:
        k = _kernels[which] = (Kernel(torch.ops.torchneuron.rnn.default, _FORWARD) if which == "forward"
                               else Kernel(torch.ops.torchneuron.rnn_backward.default, _BACKWARD))
    return k


class _FusedRNN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, input, n_hx, *tensors):
        mode, has_biases, num_layers, dropout, train, bidirectional, batch_first = config
        hx, params = list(tensors[:n_hx]), list(tensors[n_hx:])
        outs = _kernel("forward")(mode, input, hx, params, has_biases, num_layers, dropout, train,
                                  bidirectional, batch_first)
        *results, key_data = outs
        ctx.config, ctx.n_hx = config, n_hx
        ctx.save_for_backward(input, key_data, *tensors)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        input, key_data, *tensors = ctx.saved_tensors
        n_hx = ctx.n_hx
        hx, params = tensors[:n_hx], tensors[n_hx:]
        mode, has_biases, num_layers, dropout, train, bidirectional, batch_first = ctx.config
        if torch.is_grad_enabled():   # create_graph=True: the fused backward has no derivative
            return _composite_backward(ctx, grads, input, tensors)
        full = [g if g is not None else torch.zeros_like(ref) for g, ref in
                zip(grads, _reference_outputs(ctx, input, hx))]
        out = _kernel("backward")(full, key_data, mode, input, list(hx), list(params), has_biases, num_layers,
                                  dropout, train, bidirectional, batch_first)
        return (None, out[0], None, *out[1:])


def _composite_backward(ctx, grads, input, tensors):
    """The backward as a differentiable graph (double backward, gradgradcheck): recompute the
    forward with ATen's composite RNN (one fused cell op per time step, each with its derivative)
    from the saved inputs and differentiate it with create_graph."""
    mode, has_biases, num_layers, dropout, train, bidirectional, batch_first = ctx.config
    if dropout > 0 and train:
        raise RuntimeError(
            f"torchneuron: double backward (create_graph=True) through nn.{mode.upper()} with dropout "
            "in training mode is not supported on neuron: the recomputed forward would draw other "
            "dropout masks. Use dropout=0 or eval() for higher-order gradients, or run the module on CPU.")
    n_hx = ctx.n_hx
    hx, params = list(tensors[:n_hx]), list(tensors[n_hx:])
    op = getattr(torch.ops.aten, mode).input
    outs = op.decompose(input, hx if mode == "lstm" else hx[0], params, has_biases, num_layers, dropout,
                        train, bidirectional, batch_first)
    wrt = [(i, t) for i, t in enumerate((input, *tensors)) if t.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    got = torch.autograd.grad([o for o, _ in pairs], [t for _, t in wrt], [g for _, g in pairs],
                              create_graph=True, allow_unused=True)
    result = [None] * (1 + len(tensors))
    for (i, _), g in zip(wrt, got):
        result[i] = g
    return (None, result[0], None, *result[1:])


def _reference_outputs(ctx, input, hx):
    """Empty tensors shaped like each forward output (for gradients autograd passes as None)."""
    mode, has_biases, num_layers, dropout, train, bidirectional, batch_first = ctx.config
    h0 = hx[0]
    dirs = 2 if bidirectional else 1
    hidden = h0.shape[-1]
    out_shape = tuple(input.shape[:-1]) + (hidden * dirs,)
    refs = [input.new_empty(out_shape), torch.empty_like(h0)]
    if mode == "lstm":
        refs.append(torch.empty_like(hx[1]))
    return refs


def _autograd_kernel(mode):
    def kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        hx_list = list(hx) if mode == "lstm" else [hx]
        config = (mode, has_biases, num_layers, float(dropout), train, bidirectional, batch_first)
        outs = _FusedRNN.apply(config, input, len(hx_list), *hx_list, *params)
        return tuple(outs)
    return kernel


def install(lib) -> None:
    """Route aten::lstm/gru/rnn_tanh/rnn_relu on neuron tensors to the fused kernels (eager)."""
    for mode in GATES:
        lib.impl(f"{mode}.input", _autograd_kernel(mode), "AutogradPrivateUse1")
        lib.impl(f"{mode}.input", _autograd_kernel(mode), "PrivateUse1")
