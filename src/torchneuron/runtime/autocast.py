"""``torch.autocast("neuron")``: PyTorch registers per-op autocast kernels only for built-in
devices, so the neuron device's ``AutocastPrivateUse1`` key gets them here, following CUDA's
policy: matmul/convolution-like ops run in the autocast dtype, precision-sensitive ops in float32,
everything else falls through unchanged.

``torch.amp.GradScaler("neuron")`` computes ``1/scale`` in float64 and converts it back at once;
that float64 value is PyTorch's, not the user's, so it does not warn, count or fail under the
float64 policy (``TORCHNEURON_FLOAT64=error`` would otherwise make the scaler unusable).
"""

from __future__ import annotations

import functools

import torch

from .dtypes import internal_float64

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# CUDA's "lower precision fp" list (ops that exist as ATen overloads).
LOWER_PRECISION = [
    "_convolution.default", "conv1d.default", "conv2d.default", "conv3d.default", "conv_tbc.default",
    "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input", "convolution.default",
    "prelu.default", "addmm.default", "addmv.default", "addr.default", "matmul.default", "einsum.default",
    "mm.default", "mv.default", "linear.default", "addbmm.default", "baddbmm.default", "bmm.default",
    "chain_matmul.default", "linalg_multi_dot.default", "lstm_cell.default", "gru_cell.default",
    "rnn_tanh_cell.default", "rnn_relu_cell.default", "scaled_dot_product_attention.default",
]
# CUDA's "fp32" list, the commonly used part.
FLOAT32 = [
    "acos.default", "asin.default", "cosh.default", "erfinv.default", "exp.default", "expm1.default",
    "log.default", "log10.default", "log2.default", "log1p.default", "reciprocal.default", "rsqrt.default",
    "sinh.default", "tan.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus.default",
    "layer_norm.default", "native_layer_norm.default", "group_norm.default", "frobenius_norm.dim",
    "nuclear_norm.default", "cosine_similarity.default", "poisson_nll_loss.default",
    "cosine_embedding_loss.default", "nll_loss.default", "nll_loss2d.default", "hinge_embedding_loss.default",
    "kl_div.default", "l1_loss.default", "smooth_l1_loss.default", "huber_loss.default", "mse_loss.default",
    "margin_ranking_loss.default", "multilabel_margin_loss.default", "soft_margin_loss.default",
    "triplet_margin_loss.default", "multi_margin_loss.default", "binary_cross_entropy_with_logits.default",
    "dist.default", "pdist.default", "cdist.default", "renorm.default", "logsumexp.default",
    "softmax.int", "log_softmax.int", "cross_entropy_loss.default", "cumsum.default", "cumprod.default",
    "sum.default", "sum.dim_IntList", "prod.default", "norm.Scalar",
]

_libs = []


def _cast_kernel(overload, target):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("neuron") if target is None else target

        def cast(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.device.type == "neuron" \
                    and v.dtype != dtype and v.dtype != torch.float64:
                return v.to(dtype)
            if isinstance(v, list | tuple):
                return type(v)(cast(x) for x in v)
            return v

        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return overload(*cast(args), **{k: cast(v) for k, v in kwargs.items()})
    return kernel


def _unscale_without_float64(unscale_):
    @functools.wraps(unscale_)
    def wrapper(self, optimizer):
        if self._device != "neuron":
            return unscale_(self, optimizer)
        with internal_float64():
            return unscale_(self, optimizer)
    wrapper.__torchneuron_wrapped__ = True
    return wrapper


def install() -> None:
    if _libs:
        return
    scaler = torch.amp.GradScaler
    if not hasattr(scaler.unscale_, "__torchneuron_wrapped__"):
        scaler.unscale_ = _unscale_without_float64(scaler.unscale_)
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for names, target in ((LOWER_PRECISION, None), (FLOAT32, torch.float32)):
        for name in names:
            packet, _, overload_name = name.partition(".")
            overload = getattr(getattr(torch.ops.aten, packet, None), overload_name, None)
            if overload is None:
                continue
            lib.impl(name.removesuffix(".default"), _cast_kernel(overload, target), _KEY)
    _libs.extend([fallthrough, lib])
