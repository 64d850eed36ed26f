"""Argument checks that neither meta kernels nor lowerings can make.

``random_(from, to)`` and ``uniform_(from, to)`` check their range against the tensor's dtype,
``normal(mean, std)`` checks that no element of a tensor ``std`` is negative, and
``leaky_relu_backward``/``elu_backward`` refuse the backward of an in-place leaky_relu/elu with a
negative slope/alpha, and ``put``/``put_`` alert under deterministic algorithms as ATen's kernels do. These values are runtime inputs of the executables (one executable serves
every range and slope), and meta kernels skip the checks, so the eager kernel runs the check below before each call of these
ops (no other op pays for it):
the range checks replay the call on an empty CPU tensor of the same dtype, so the errors and
warnings are CPU PyTorch's own; the ``std`` check reads one bool from the device, as CUDA does.
"""

from __future__ import annotations

import torch

from ..runtime import sites


def _replay_on_empty_cpu(kernel, values) -> None:
    """Run the op on an empty CPU tensor of ``self``'s dtype: ATen checks the range (and warns)
    before it looks at the elements. float64 tensors are checked as float64 (the user's dtype)."""
    positional = [v for v, kw in zip(values, kernel.kwarg_only) if not kw]
    try:
        kernel.overload(torch.empty(0, dtype=values[0].dtype), *positional[1:])
    except RuntimeError as err:
        raise RuntimeError(f"{err}\n[torchneuron] in {kernel.name}") from None


def _std_not_negative(kernel, values) -> None:
    std = values[kernel.index_of["std"]]
    if isinstance(std, torch.Tensor) and std.numel() and not bool((std >= 0).all()):
        raise RuntimeError("normal expects all elements of std >= 0.0")


def _inplace_leaky_relu_slope(kernel, values) -> None:
    _, _, negative_slope, self_is_result = values[:4]
    if self_is_result and negative_slope < 0:
        raise RuntimeError(
            "In-place leakyReLu backward calculation is triggered with a negative slope which is not "
            "supported. This is caused by calling in-place forward function with a negative slope, please "
            "call out-of-place version instead. File an issue at https://github.com/pytorch/pytorch if you "
            "do require supporting in-place leakRelu backward calculation with negative slope")


def _inplace_elu_alpha(kernel, values) -> None:
    # elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result)
    alpha, is_result = values[1], values[4]
    if is_result and alpha < 0:
        raise RuntimeError(
            "In-place elu backward calculation is triggered with a negative slope which is not supported. "
            "This is caused by calling in-place forward function with a negative slope, please call "
            "out-of-place version instead.")


def _put_determinism(kernel, values) -> None:
    """``put_``/``put`` without accumulation write duplicate indices in an unspecified order: under
    ``torch.use_deterministic_algorithms(True)`` CPU and CUDA alert, and so does neuron."""
    if values[3] or not torch._C._get_deterministic_algorithms():
        return
    message = ("put_ does not have a deterministic implementation, but you set "
               "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
               "operation, or you can use the 'warn_only=True' option, if that's acceptable for your "
               "application. You can also file an issue at https://github.com/pytorch/pytorch/issues to "
               "help us prioritize adding deterministic support for this operation.")
    if torch._C._get_deterministic_algorithms_warn_only():
        sites.warn(message)
    else:
        raise RuntimeError(message)


CHECKS = {
    "put": _put_determinism,
    "put_": _put_determinism,
    "elu_backward": _inplace_elu_alpha,
    "leaky_relu_backward": _inplace_leaky_relu_slope,
    "random_.from": _replay_on_empty_cpu,
    "random_.to": _replay_on_empty_cpu,
    "uniform_": _replay_on_empty_cpu,
    "normal.Tensor_Tensor": _std_not_negative,
    "normal.float_Tensor": _std_not_negative,
}
