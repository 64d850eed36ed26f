"""An eager kernel's cache key: what is in it, why a new one was needed, and its name on disk.

A key holds everything that decides the program -- each input's spec (``runtime/inputs.py``: dtype,
sizes, strides, offset rule, storage wiring), the sizes of the storages read, the compiled-in
arguments (frozen so that equal keys mean equal programs), the device and the default dtype -- and
nothing that only varies from call to call (scalar values and view offsets are runtime inputs).
"""

from __future__ import annotations

import torch

from ..config import config
from ..ops.signature import OPT_TENSOR_LIST, TENSOR_LIST
from ..runtime import executable_store
from ..runtime.inputs import is_view

# Static arguments whose schema type admits only hashable values that compare equal exactly when
# they mean the same thing: compiled in as they are. Everything else is frozen (``freeze``).
PLAIN_STATIC = frozenset({"int", "bool", "str", "ScalarType", "Layout", "Device", "MemoryFormat",
                           "Optional[int]", "Optional[bool]", "Optional[str]", "Optional[ScalarType]",
                           "Optional[Layout]", "Optional[Device]", "Optional[MemoryFormat]"})


def freeze(v):
    """A compiled-in argument as a key part that is equal only for arguments meaning the same
    program: Python's ``6 == 6.0 == True`` and ``0.0 == -0.0`` would otherwise share an entry,
    and a NaN would never find its own."""
    cls = v.__class__
    if cls is int or v is None:
        return v
    if cls is list or cls is tuple:
        for x in v:
            if x.__class__ is not int:
                return tuple([freeze(x) for x in v])
        return tuple(v)
    if cls is float:
        return (float, v.hex())
    if cls is bool:
        return (bool, v)
    if cls is complex:
        return (complex, v.real.hex(), v.imag.hex())
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise TypeError("torchneuron: symbolic sizes are not supported in eager mode")
    return v


# -- why a compile happened ------------------------------------------------------------------------
def key_parts(key):
    """The parts of a cache key a compile reason names, each comparable on its own."""
    kernel, specs, statics, storages, device, default_dtype, precision = key
    dtypes, shapes, layouts = [], [], []
    for (_, kind), spec in zip(kernel.inputs, specs):
        items = spec if kind in (TENSOR_LIST, OPT_TENSOR_LIST) and spec is not None else (spec,)
        for s in items:
            if is_view(s):
                dtypes.append(s[0])
                shapes.append(tuple(s[1]))
                layouts.append((s[2], s[3], s[4]))
            elif isinstance(s, tuple):       # (EMPTY, dtype, sizes), (CPU_SCALAR, dtype)
                dtypes.append(s[:2])
                shapes.append(s[2:])
            else:                            # a scalar's Python type, or None
                dtypes.append(s)
    return {"dtype": dtypes, "shape": shapes, "layout": (layouts, storages), "arguments": statics,
            "device": device, "default dtype": default_dtype, "float32 precision setting": precision}


def compile_reason(key, previous) -> str:
    """Why ``key`` needs an executable, next to the keys an op already has: "new op", or the most
    basic part in which it differs from the closest earlier key, in the order dtype, shape, layout
    (strides, storage offsets and sizes), compiled-in arguments, device, default dtype, the float32
    precision setting of matmuls and convolutions."""
    if not previous:
        return "new op"
    parts = list(key_parts(key).items())
    closest = 0
    for old in previous[-64:]:
        old_parts = key_parts(old)
        same = 0
        while same < len(parts) and old_parts[parts[same][0]] == parts[same][1]:
            same += 1
        closest = max(closest, same)
    return "new " + parts[closest][0] if closest < len(parts) else "new entry"


# Compiled-in values that print the same in every process (a Generator's repr holds an address).
_PORTABLE = (int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, type)


def _portable(v) -> bool:
    if isinstance(v, tuple):
        return all(_portable(x) for x in v)
    return isinstance(v, _PORTABLE)


def store_name(key):
    """The persistent-cache entry of an eager cache key, or None for keys that hold values whose
    ``repr`` differs between processes."""
    kernel, specs, statics, storages, device_index, default_dtype, precision = key
    if not kernel.persistent or not _portable(statics):
        return None
    return executable_store.key("eager", kernel.name, kernel.functional is not None, specs, statics,
                                storages, device_index, default_dtype, config.float64, config.device_checks,
                                *(() if precision is None else (precision.name,)))


def describe(key) -> str:
    """An eager key as ``torchneuron cache verify`` names it: the op and its inputs' dtypes and
    sizes ("add.Tensor(float32[2, 3], float32[2, 3])")."""
    kernel, specs = key[0], key[1]
    shown = []
    for (_, kind), spec in zip(kernel.inputs, specs):
        items = spec if kind in (TENSOR_LIST, OPT_TENSOR_LIST) and spec is not None else (spec,)
        for s in items:
            if is_view(s):
                shown.append(f"{str(s[0]).removeprefix('torch.')}{list(s[1])}")
            elif isinstance(s, tuple) and len(s) > 1 and isinstance(s[1], torch.dtype):  # empty, CPU scalar
                shown.append(f"{s[0]} {str(s[1]).removeprefix('torch.')}{list(s[2]) if len(s) > 2 else ''}")
            elif s is not None:
                shown.append(getattr(s, "__name__", repr(s)))
    statics = ", ".join(_thawed(v) for v in key[2])
    return f"{kernel.short_name}({'; '.join(x for x in (', '.join(shown), statics) if x)})"


def _thawed(v) -> str:
    """A compiled-in argument as the user wrote it (``freeze`` undone), for messages."""
    if isinstance(v, tuple):
        if len(v) == 2 and v[0] is float:
            return repr(float.fromhex(v[1]))
        if len(v) == 2 and v[0] is bool:
            return repr(v[1])
        if len(v) == 3 and v[0] is complex:
            return repr(complex(float.fromhex(v[1]), float.fromhex(v[2])))
        return "(" + ", ".join(_thawed(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, torch.dtype | torch.device):
        return str(v).removeprefix("torch.")
    return repr(v)
