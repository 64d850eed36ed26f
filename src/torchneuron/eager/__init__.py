"""Eager execution: schema-driven kernels, the executable cache, CPU fallback, adaptive mode."""

from ..runtime import fork as _fork
from . import kernel as _kernel

# A process forked after the runtime started refuses every op (see runtime/fork.py).
_fork.forbid(_kernel.Kernel, "__call__", lambda k: k.name)
_fork.forbid(_kernel, "_plain_call", lambda k: k.name)   # what profiler tracing swaps back in
