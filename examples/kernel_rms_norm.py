"""A fused RMSNorm written in jax.numpy, registered as a PyTorch op with torchneuron.kernel.

One JAX function gives the op everywhere: on neuron tensors it compiles into one executable (in
eager mode, fused into adaptive-eager regions, and inside torch.compile graphs); on CPU tensors the
same function runs on the host, so CPU PyTorch checks it. Gradients come from jax.vjp.

    .venv/bin/python examples/kernel_rms_norm.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

import torchneuron


@torchneuron.kernel("examples::rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Statistics in float32 whatever the input dtype (bfloat16 activations), one pass over x.
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same computation as PyTorch composite ops."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Drop-in module using the kernel (it survives torch.save/torch.load of the model)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def main():
    torch.manual_seed(0)
    x = torch.randn(8, 64, 256)
    w = torch.randn(256)
    for device in ("cpu", "neuron"):
        xd = x.detach().to(device).requires_grad_()
        wd = w.detach().to(device).requires_grad_()
        y = rms_norm(xd, wd)
        y.square().sum().backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = reference(xr, wr)
        ref.square().sum().backward()
        torch.testing.assert_close(y.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xd.grad.cpu(), xr.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(wd.grad.cpu(), wr.grad, rtol=1e-4, atol=1e-3)
        print(f"{device:6s}: values and gradients match PyTorch")

    compiled = torch.compile(lambda a, b: rms_norm(a, b) * 2, backend="neuron")
    out = compiled(x.to("neuron"), w.to("neuron"))
    torch.testing.assert_close(out.cpu(), reference(x, w) * 2, rtol=1e-5, atol=1e-5)
    print("torch.compile(backend='neuron'): matches PyTorch")
    m = torchneuron.metrics()
    print(f"custom kernel calls: {m['custom_kernel_calls']}")
    print(f"custom kernel compiles: {m['custom_kernel_compiles']}")


if __name__ == "__main__":
    main()
