"""Float32 contraction precision, as PyTorch's own settings ask for it.

PyTorch keeps float32 matmuls at full precision unless ``torch.set_float32_matmul_precision``
("high"/"medium"), ``torch.backends.cuda.matmul.allow_tf32`` or the newer ``fp32_precision``
settings allow TF32 (or bfloat16) arithmetic; convolutions and recurrent networks follow
``torch.backends.cudnn.allow_tf32`` (``cudnn.conv`` / ``cudnn.rnn.fp32_precision``), which is on by
default: on CUDA PyTorch runs both through cuDNN. Lowerings read the setting while they are traced and pass it to XLA as the
dot's precision: HIGHEST is float32, HIGH is TF32 where the platform has it (bfloat16x3 on TPU),
DEFAULT the platform's fastest. XLA:CPU computes float32 either way. The setting is part of every
cache key of a lowering that reads it (``Lowering.precision``), so changing it compiles anew
instead of reusing a program traced under the old one.
"""

from __future__ import annotations

import torch
from jax import lax

MATMUL = "matmul"             # mm, bmm, addmm, linear, matmul, linalg products, attention
CONVOLUTION = "convolution"   # convolution and its backward (cuDNN's setting in PyTorch)
RNN = "rnn"                   # the gate matmuls of LSTM / GRU / RNN (cuDNN's RNN setting)

HIGHEST, HIGH, DEFAULT = lax.Precision.HIGHEST, lax.Precision.HIGH, lax.Precision.DEFAULT
_LEGACY_MATMUL = {"highest": HIGHEST, "high": HIGH, "medium": DEFAULT}
_FP32_PRECISION = {"ieee": HIGHEST, "tf32": HIGH, "bf16": DEFAULT}


def _new_api(*settings, default):
    """The first of ``fp32_precision`` settings (most specific first) that is not "none"."""
    for owner in settings:
        value = getattr(owner, "fp32_precision", "none")
        if value != "none":
            return _FP32_PRECISION.get(value, default)
    return default


def matmul_precision() -> lax.Precision:
    try:
        return _LEGACY_MATMUL[torch.get_float32_matmul_precision()]
    except RuntimeError:   # the fp32_precision API was used: torch refuses the legacy reading
        b = torch.backends
        return _new_api(b.cuda.matmul, b, default=HIGHEST)


def convolution_precision() -> lax.Precision:
    try:
        return HIGH if torch.backends.cudnn.allow_tf32 else HIGHEST
    except RuntimeError:
        b = torch.backends
        return _new_api(b.cudnn.conv, b.cudnn, b, default=HIGH)


def rnn_precision() -> lax.Precision:
    try:
        return HIGH if torch.backends.cudnn.allow_tf32 else HIGHEST
    except RuntimeError:
        b = torch.backends
        return _new_api(getattr(b.cudnn, "rnn", None), b.cudnn, b, default=HIGH)


READERS = {MATMUL: matmul_precision, CONVOLUTION: convolution_precision, RNN: rnn_precision}


def of(kind: str | None):
    """The precision a lowering of ``kind`` is traced with now (None for other lowerings)."""
    return None if kind is None else READERS[kind]()


def readers(kinds) -> tuple:
    """The setting readers of a program whose lowerings read ``kinds`` (None: none), in one order."""
    return tuple(READERS[kind] for kind in sorted(set(kinds) - {None}))


def settings(program_readers) -> tuple:
    """The settings a program is traced with now: part of its executable key."""
    return tuple(read().name for read in program_readers)
