"""Calling a custom kernel's JAX body: the one place every path (fake, neuron, CPU, graphs,
autograd) goes through, so each gets the same argument conventions, checks and error messages.

The body mirrors the op's schema: ``Tensor`` arguments arrive as ``jax.Array`` (lists of them as
lists, an absent ``Tensor?`` as None), ``Scalar`` (``torch.types.Number``) arguments as traced 0-d
arrays, ``torch.dtype`` arguments as JAX dtypes, every other argument (int, float, bool, str,
lists of them, devices) as the Python value, compiled in. It returns the new values of the
arguments named in ``mutates_args`` (in signature order), then the declared results.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import numpy as np
import torch

from ..config import config
from ..ops.signature import DTYPE, SCALAR, SCALAR_LIST, STATIC, TENSOR, TENSOR_LIST
from ..runtime.dtypes import jax_dtype

_serials = itertools.count()


class KernelError(RuntimeError):
    """A custom kernel that cannot run as written; the message names the kernel and its inputs."""


def arg_kind(arg) -> int:
    """What a body receives for a schema argument: absent optionals arrive as None, so ``Tensor?``
    is a TENSOR and ``Tensor?[]`` a TENSOR_LIST here."""
    t = str(arg.type)
    if t in ("Tensor", "Optional[Tensor]"):
        return TENSOR
    if t in ("List[Tensor]", "List[Optional[Tensor]]"):
        return TENSOR_LIST
    if t in ("number", "Optional[number]"):
        return SCALAR
    if t == "List[number]":
        return SCALAR_LIST
    if str(arg.real_type) in ("ScalarType", "Optional[ScalarType]"):
        return DTYPE
    return STATIC


def _return_kind(schema) -> tuple[str, int]:
    types = [str(r.type) for r in schema.returns]
    if not types:
        return "none", 0
    if types == ["List[Tensor]"]:
        return "list", 1
    if all(t == "Tensor" for t in types):
        return ("tensor", 1) if len(types) == 1 else ("tuple", len(types))
    return "unsupported", len(types)


def describe_value(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}@{v.device}"
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{np.dtype(v.dtype).name}{list(v.shape)}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(describe_value(x) for x in v) + "]"
    return repr(v)


class Body:
    """A kernel's JAX function together with the schema facts needed to call it."""

    def __init__(self, qualname: str, fn, schema, *, on_device: bool = False):
        self.qualname = qualname
        self.fn = fn
        args = schema.arguments
        self.names = [a.name for a in args]
        self.kwarg_only = [a.kwarg_only for a in args]
        self.kinds = [arg_kind(a) for a in args]
        self.mutated = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        self.returns, self.n_returns = _return_kind(schema)
        self.on_device = on_device       # traced for the neuron device, else for the host CPU
        self.serial = next(_serials)     # tells this registration from a later one of the same name

    @property
    def platform(self) -> str | None:
        """The platform whose executables the body is traced for (None: the host CPU); read at each
        trace, as the device's platform is chosen when it starts, after kernels are defined."""
        return config.platform if self.on_device else None

    # -- arguments ---------------------------------------------------------------------------------
    def split(self, values):
        """Schema-ordered values -> (positional, keyword) as the body's signature takes them."""
        pos = [v for v, kw in zip(values, self.kwarg_only) if not kw]
        kw = {n: v for n, v, k in zip(self.names, values, self.kwarg_only) if k}
        return pos, kw

    def describe(self, values) -> str:
        return ", ".join(f"{n}={describe_value(v)}" for n, v in zip(self.names, values))

    # -- calling -----------------------------------------------------------------------------------
    def __call__(self, *pos, **kw):
        """The lowering's calling convention (``eager.kernel.call_lowering``): positional arguments
        in schema order, keyword-only ones by name. Returns the flat tuple (new values of the
        mutated tensors, then the new outputs) that eager kernels and graphs consume."""
        values = list(pos)
        for name in self.names[len(values):]:
            values.append(kw[name])
        return self.flatten(self.run(values), values)

    def run(self, values, *, interpret: bool | None = None):
        """Call the user's function on schema-ordered ``values``; errors name the kernel."""
        values = [_jax_dtype_arg(v) if k == DTYPE else v for v, k in zip(values, self.kinds)]
        pos, kw = self.split(values)
        if interpret is None:
            interpret = self.platform in (None, "cpu")
        with pallas_interpret(interpret):
            try:
                return self.fn(*pos, **kw)
            except KernelError:
                raise
            except Exception as err:  # noqa: BLE001 - the user's code: reported with its inputs
                raise self.trace_error(err, values) from err

    def trace_error(self, err, values, what="tracing the kernel") -> KernelError:
        hint = _hint(err)
        if isinstance(err, _TRACE_ERRORS):
            traced = [n for n, k in zip(self.names, self.kinds) if k in (TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST)]
            hint += f" Traced arguments of this kernel: {', '.join(traced)}."
        return KernelError(
            f"torchneuron kernel {self.qualname}: {type(err).__name__} while {what} for inputs "
            f"({self.describe(values)}): {_first_lines(err)}" + (f"\n  {hint}" if hint else ""))

    def flatten(self, out, values) -> tuple:
        """Check a body's result against the signature and flatten it (mutated first)."""
        parts = [f"new value of {self.names[i]!r}" for i in self.mutated]
        if self.returns == "tensor":
            parts.append("the result")
        elif self.returns == "tuple":
            parts.extend(f"result {j}" for j in range(self.n_returns))
        elif self.returns == "list":
            parts.append("the list of results")
        expected = len(parts)
        if expected == 0:
            if out is not None and out != ():
                raise self._error(values, f"returned {_kind_of(out)}; its signature declares no results "
                                          "and mutates nothing, so it must return None")
            return ()
        if expected == 1:
            single_array = self.returns == "tensor" or (self.mutated and self.kinds[self.mutated[0]] == TENSOR)
            if single_array and isinstance(out, list | tuple) and len(out) == 1:
                out = out[0]
            items = [out]
        else:
            if not isinstance(out, list | tuple) or len(out) != expected:
                got = f"{len(out)} values" if isinstance(out, list | tuple) else _kind_of(out)
                raise self._error(values, f"returned {got}; its signature needs {expected} values: ("
                                          + ", ".join(parts) + ")")
            items = list(out)
        flat = []
        for i, item in zip(self.mutated, items):
            flat.extend(self._mutated_value(i, item, values))
        results = items[len(self.mutated):]
        if self.returns == "list":
            lst = results[0]
            if not isinstance(lst, list | tuple):
                raise self._error(values, f"returned {_kind_of(lst)} where its signature declares a list "
                                          "of tensors (-> list[Tensor])")
            results = list(lst)
        for j, r in enumerate(results):
            flat.append(self._array(r, values, "result" if len(results) == 1 else f"result {j}"))
        return tuple(flat)

    def _mutated_value(self, i, item, values):
        name, arg = self.names[i], values[i]
        if arg is None:
            return []
        if self.kinds[i] == TENSOR_LIST:
            if not isinstance(item, list | tuple) or len(item) != len(arg):
                raise self._error(values, f"returned {_kind_of(item)} as the new value of {name!r}, a list "
                                          f"of {len(arg)} tensors; return a list of the same length")
            pairs = [(f"{name}[{j}]", a, x) for j, (a, x) in enumerate(zip(arg, item))]
        else:
            pairs = [(name, arg, item)]
        out = []
        for label, a, x in pairs:
            if a is None:
                continue
            x = self._array(x, values, f"new value of {label!r}")
            if tuple(x.shape) != tuple(a.shape) or x.dtype != a.dtype:
                raise self._error(values, f"returned {describe_value(x)} as the new value of {label!r}, "
                                          f"which is {describe_value(a)}: a mutated argument keeps its "
                                          "shape and dtype (reshape, or .astype(x.dtype))")
            out.append(x)
        return out

    def _array(self, x, values, what):
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):     # under jax.eval_shape
            return x
        raise self._error(values, f"returned {_kind_of(x)} as its {what}; a kernel returns jax arrays")

    def _error(self, values, message) -> KernelError:
        return KernelError(f"torchneuron kernel {self.qualname} {message}. Inputs: ({self.describe(values)})")


def _kind_of(x) -> str:
    if x is None:
        return "None"
    if isinstance(x, list | tuple):
        return f"a {type(x).__name__} of {len(x)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {describe_value(x)}"
    return f"a {type(x).__name__}"


def _jax_dtype_arg(v):
    return np.dtype(jax_dtype(v)) if isinstance(v, torch.dtype) else v


def _first_lines(err, n=6) -> str:
    lines = str(err).strip().splitlines()
    text = "\n    ".join(lines[:n])
    return text + ("\n    ..." if len(lines) > n else "")


_TRACE_ERRORS = tuple(getattr(jax.errors, n) for n in (
    "ConcretizationTypeError", "TracerBoolConversionError", "TracerIntegerConversionError",
    "TracerArrayConversionError") if hasattr(jax.errors, n))


def _hint(err) -> str:
    if isinstance(err, _TRACE_ERRORS):
        return ("JAX cannot trace this code: it needs the value of a traced array while building the "
                "program (a Python if/for/int() on it, or a shape taken from it). Tensor arguments and "
                "Scalars (torch.types.Number) are traced; values that shape the program must be declared "
                "int, float or bool (static, compiled in). For data-dependent choices use jnp.where, "
                "lax.cond or lax.fori_loop.")
    text = str(err)
    if "Linearization failed" in text or "reverse-mode" in text:
        return ("jax.vjp cannot differentiate this kernel (Pallas kernels and some primitives have no "
                "reverse-mode rule): give torchneuron.kernel(..., backward=fn) a JAX function of "
                "(the kernel's arguments..., output gradients...).")
    if isinstance(err, TypeError | AttributeError) and ("torch" in text or "Tensor" in text):
        return ("The body receives jax.Array values, not torch tensors: write it with jax.numpy/lax "
                "(jnp.exp, x.astype(...)), not torch functions or tensor methods.")
    return ""


# -- Pallas --------------------------------------------------------------------------------------
try:   # Pallas consults this (thread-local) setting when a pallas_call is traced.
    from jax._src import config as _jax_config
    _INTERPRET = _jax_config.pallas_tpu_interpret_mode_context_manager
except (ImportError, AttributeError):   # pragma: no cover - jax is pinned
    _INTERPRET = None


@contextlib.contextmanager
def pallas_interpret(on: bool):
    """Trace Pallas kernels in interpret mode (``pallas_call(..., interpret=True)``): the only way
    they run on the CPU platform. Elsewhere they compile natively."""
    if not on or _INTERPRET is None:
        yield
        return
    previous = _INTERPRET.swap_local(True)
    try:
        yield
    finally:
        _INTERPRET.set_local(previous)
