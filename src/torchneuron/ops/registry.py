"""The one table of lowerings: ATen overload -> pure JAX function.

Eager kernels, adaptive eager and the torch.compile interpreter all read this table. A lowering
mirrors its ATen schema: tensors arrive as ``jax.Array``s (already materialised from their views),
``Scalar``s as traced JAX scalars, everything else as plain Python values. It returns the op's
outputs (for an in-place or ``out=`` op registered under its own name: the new values of the
mutated arguments). Dtype promotion, output casting, ``out=`` and in-place variants are handled by
the one calling convention every caller shares (``ops.signature``), so a lowering holds only the
math.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..versions import pinned_torch


@dataclass(frozen=True, kw_only=True)
class Lowering:
    name: str                      # ATen overload, e.g. "add.Tensor"
    fn: Callable
    # Cast these arguments to the result dtype ("result") or to their common dtype ("common")
    # before the lowering sees them; None leaves dtypes alone.
    promote: str | None = None
    promote_args: tuple[str, ...] | None = None
    # Scalar arguments that shape the result (arange's end) are compiled in, not runtime inputs.
    static_scalars: bool = False
    # The lowering receives ``key=`` (a fresh jax PRNG key per call, from the device generator).
    random: bool = False
    # The lowering ignores the current values of mutated arguments (fill_, uniform_, copy_...).
    overwrites: bool = False
    # Register in-place/out= variants derived from this functional lowering.
    derive_variants: bool = True
    # Arguments the op mutates although its schema does not say so (legacy native_batch_norm).
    mutates: tuple[str, ...] = ()
    # Only for graphs (torch.compile); eager mode never calls it: view ops are metadata-only there
    # (PyTorch's own kernels build them over the same storage), and CompositeImplicitAutograd ops
    # run their decomposition. Registering a lowering that eager mode would silently ignore without
    # this flag is an error (``signature.lowers_in_eager``).
    graph_only: bool = False
    # PJRT platforms whose JAX lowering of this op exists (e.g. LAPACK-only custom calls); None: all.
    # Elsewhere the op gets no kernel and runs through the explicit, counted CPU fallback.
    platforms: tuple[str, ...] | None = None
    # Output shapes/dtypes come from tracing the lowering, not the op's meta kernel (for meta
    # kernels stricter than the CPU kernel, e.g. _grouped_mm's CUDA-only bfloat16 check).
    shape_from_lowering: bool = False
    # An argument whose memory layout picks ATen's algorithm (``_linalg_det`` factors A^T when A is
    # C-contiguous, and its backward relies on that): the lowering receives ``contiguous=`` (bool).
    contiguity_of: str | None = None
    # Two tensor arguments that must have the same dtype (CPU checks it, meta kernels do not), and
    # CPU's message, formatted with each argument's c10 dtype name: ("self", "source", "... {self}").
    same_dtype: tuple[str, str, str] | None = None
    # Where ATen's CPU kernel lays its outputs out otherwise than PyTorch's meta kernel says:
    # ``fn(output_metas, bound_values)`` -> one strides tuple per output (None: meta's), or None.
    output_strides: Callable | None = None
    # The float32 precision setting the lowering reads while traced (ops/precision.py: "matmul",
    # "convolution"): it enters the lowering's cache keys.
    precision: str | None = None


class NotImplementedForDtype(NotImplementedError):
    """Raised by a lowering, while it is traced, for an input dtype PyTorch's CPU kernel has no
    implementation for either ("upsample_bilinear2d" not implemented for 'Int'): the caller passes it
    on as PyTorch's own error instead of computing something no CPU result can be checked against."""


class InvalidArguments(RuntimeError):
    """Raised by a lowering, while it is traced, for arguments ATen's CPU kernel rejects with a
    check PyTorch's meta kernel does not make (fractional_max_pool3d's ``_random_samples``): the
    caller passes it on as PyTorch's error, not as a failure to compile."""


LOWERINGS: dict[str, Lowering] = {}
# Lowerings of ops the installed torch does not have (a release older than the pinned one): left
# out of the table and named here (``torchneuron doctor``). Under the pinned torch it is a typo.
ABSENT: list[str] = []
# Where each lowering was registered: (file, line) of the ``@lowering``/``add`` call, a loop's too
# (``exp.default`` is registered in a loop over names, so the file never spells it).
SITES: dict[str, tuple[str, int]] = {}


def lowering(*names: str, promote: str | None = None, promote_args=None, static_scalars=False,
             random=False, overwrites=False, derive_variants=True, mutates=(), graph_only=False,
             platforms=None, shape_from_lowering=False, contiguity_of=None, same_dtype=None,
             output_strides=None, precision=None):
    """Register ``fn`` as the lowering of each ATen overload in ``names`` ("add.Tensor")."""
    def register(fn):
        for name in names:
            add(Lowering(name=name, fn=fn, promote=promote,
                         promote_args=tuple(promote_args) if promote_args else None,
                         static_scalars=static_scalars, random=random, overwrites=overwrites,
                         derive_variants=derive_variants, mutates=tuple(mutates), graph_only=graph_only,
                         platforms=tuple(platforms) if platforms else None,
                         shape_from_lowering=shape_from_lowering, contiguity_of=contiguity_of,
                         same_dtype=same_dtype, output_strides=output_strides, precision=precision))
        return fn
    return register


def add(entry: Lowering) -> None:
    if entry.name in LOWERINGS:
        raise ValueError(f"lowering for aten::{entry.name} registered twice")
    if not _op_exists(entry.name):
        if pinned_torch():
            raise RuntimeError(f"torchneuron: lowering registered for unknown op aten::{entry.name}")
        ABSENT.append(entry.name)
        return
    LOWERINGS[entry.name] = entry
    frame = sys._getframe(1)
    while frame.f_code.co_filename == __file__:
        frame = frame.f_back
    SITES[entry.name] = (frame.f_code.co_filename, frame.f_lineno)


def _op_exists(name: str) -> bool:
    packet, _, overload = name.partition(".")
    return hasattr(getattr(torch.ops.aten, packet, None), overload or "default")


def get(name: str) -> Lowering | None:
    return LOWERINGS.get(name)
