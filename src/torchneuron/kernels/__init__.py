"""Custom kernels: JAX functions (jnp/lax code or Pallas kernels) as PyTorch custom ops.

``torchneuron.kernel("mylib::op")`` registers one; see ``define.py`` for how it is wired and
docs/kernels.md for the guide.
"""

from .body import KernelError
from .define import JaxKernel, NeuronKernel, kernel, registered

__all__ = ["KernelError", "JaxKernel", "NeuronKernel", "kernel", "registered"]
