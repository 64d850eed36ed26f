"""torch <-> JAX dtype mapping and the float64 policy."""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..config import config
from ..metrics import metrics
from . import sites

_TORCH_TO_JAX = {
    torch.bool: jnp.bool_, torch.uint8: jnp.uint8, torch.int8: jnp.int8, torch.int16: jnp.int16,
    torch.int32: jnp.int32, torch.int64: jnp.int64, torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32, torch.float64: jnp.float64,
    torch.complex64: jnp.complex64, torch.complex128: jnp.complex128, torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32, torch.uint64: jnp.uint64,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}

SUPPORTED = frozenset(_TORCH_TO_JAX)


def jax_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(
            f"torchneuron: dtype {dtype} is not supported on the neuron device (supported: "
            "float32, bfloat16, float16, float64 (run as float32), complex64, int8/16/32/64, uint8, "
            "bool). Convert the tensor first, e.g. t.to(torch.float32)."
        ) from None


# c10's names of scalar types, as PyTorch's C++ errors print them ("result type Float ...").
_C10_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def torch_dtype(dtype) -> torch.dtype:
    return _JAX_TO_TORCH[np.dtype(dtype)]


_warned_float64: set = set()
# Set while PyTorch's own code makes a float64 value it converts back at once (GradScaler's
# 1/scale): the downcast is exact there, so it is neither warned, counted nor refused.
_internal_float64 = threading.local()


@contextlib.contextmanager
def internal_float64():
    previous = getattr(_internal_float64, "active", False)
    _internal_float64.active = True
    try:
        yield
    finally:
        _internal_float64.active = previous

# float64 -> float32 and complex128 -> complex64 under the default policy.
_NARROW = {torch.float64: torch.float32, torch.complex128: torch.complex64}


def device_dtype(dtype: torch.dtype, op_name: str) -> torch.dtype:
    """The dtype a result of ``op_name`` with PyTorch dtype ``dtype`` has on the device."""
    narrow = _NARROW.get(dtype)
    if narrow is None or config.float64 == "keep":
        return dtype
    if getattr(_internal_float64, "active", False):
        return narrow
    if config.float64 == "error":
        raise TypeError(
            f"torchneuron: {op_name} would produce a {dtype} tensor, and TORCHNEURON_FLOAT64=error "
            f"forbids 64-bit floats on neuron. Convert inputs with .to(torch.float32), or set "
            "TORCHNEURON_FLOAT64=downcast (run as float32) or keep."
        )
    metrics.float64_downcasts[op_name] += 1
    if metrics.tracer is not None:   # the readiness report records where it happened
        metrics.tracer.float64(op_name)
    if op_name not in _warned_float64:
        _warned_float64.add(op_name)
        sites.warn(
            f"torchneuron: {op_name} produced {dtype}; the neuron device runs it as {narrow} "
            "(set TORCHNEURON_FLOAT64=keep to keep 64-bit floats, or =error to make this an error).")
    return narrow


def cast_and_broadcast(value, dtype, shape):
    """``value`` cast to ``dtype`` and broadcast to ``shape`` (the new value of a mutated tensor)."""
    return jnp.broadcast_to(cast(jnp.asarray(value), dtype), tuple(shape))


def cast(value, dtype):
    """``value`` (a jax array or Python scalar) as ``dtype`` (torch or numpy), keeping complex
    values complex when a real result is computed from them."""
    target = jax_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype
    if isinstance(value, jax.Array) or hasattr(value, "dtype"):
        if jnp.iscomplexobj(value) and not jnp.issubdtype(target, jnp.complexfloating):
            # A real result of a complex input (abs, angle) is computed from the complex value:
            # casting the input to the real result type would drop its imaginary part.
            target = jnp.result_type(target, jnp.complex64)
        return value if value.dtype == target else value.astype(target)
    return jnp.asarray(value, dtype=target)
