"""``python -m torchneuron.where OP [OP...]``: where every fact about an ATen op lives.

For each overload ("add.Tensor", "index.Tensor", "exp.default"), from its record
(``ops.oprecord``): the lowering and the line that registered it (loops included), the eager kernel
and the special cases around it, the in-place/``out=`` variants derived from it (or the functional
op it derives from), the device-index rule, the torch.compile graph kind, the dtypes CPU refuses,
autocast's list, the random-op argument check, PyTorch's decomposition -- each with file:line.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch
from torch._decomp import decomposition_table

from . import ops  # noqa: F401  (every lowering module, filling the registry)
from .config import config
from .eager import argument_checks, fallback, out_variants, registration
from .ops import cpu_dtypes, devices, oprecord
from .ops.registry import Lowering
from .ops.signature import aten_overload, is_composite_implicit
from .runtime import autocast

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _path(file: str) -> str:
    file = os.path.abspath(file)
    return os.path.relpath(file, _SRC) if file.startswith(_SRC + os.sep) else file


def location(obj) -> str | None:
    """``file:line`` of a function or class (the wrapped one for a decorated function), or None."""
    obj = inspect.unwrap(obj)
    try:
        return f"{_path(inspect.getsourcefile(obj))}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return None


def _line_of(module, needle: str) -> str:
    """``file:line`` of the first line of ``module``'s source (or of the file at that path)
    holding ``needle``."""
    file = module if isinstance(module, str) else inspect.getsourcefile(module)
    with open(file) as f:
        for i, line in enumerate(f, 1):
            if needle in line:
                return f"{_path(file)}:{i}"
    return _path(file)


_NO_LOWERING = ("none: no lowering: a graph node of it fails to compile (unless core-ATen decompositions "
                "remove it; a _foreach_ op runs element by element)")
_NO_GRAPH_KIND = {oprecord.OUT: "none: graphs hold the functional op (AOTAutograd functionalizes out= calls)"}


def _quoted(name: str) -> str:
    return f'"{name}"'


def _flags(low) -> str:
    defaults = Lowering(name=low.name, fn=low.fn)
    flags = [f"{f}={getattr(low, f)!r}" for f in low.__dataclass_fields__
             if f not in ("name", "fn") and getattr(low, f) != getattr(defaults, f)]
    return ", ".join(flags)


def _eager_kernel(rec, overload, dispatcher_name: str) -> str:
    """What runs the op in eager mode, and where that is written."""
    if rec.kernel is None:
        if is_composite_implicit(overload):
            return "PyTorch decomposes it above the backend (CompositeImplicitAutograd)"
        if dispatcher_name in fallback.SKIP_DECOMPOSITION:
            route = (f"no kernel: the CPU kernel through the fallback, which skips its decomposition "
                     f"({_line_of(fallback, _quoted(dispatcher_name))})")
        elif overload in decomposition_table:
            route = "no kernel: the fallback runs its decomposition (counted)"
        else:
            route = "no kernel: the CPU kernel through the fallback (counted, warned once)"
        return f"{route}, {location(registration.implementation(rec))}"
    built_by = location(registration.implementation(rec))
    if rec.kernel in (oprecord.LOWERED, oprecord.INPLACE, oprecord.OUT, oprecord.METADATA):
        text = f"{rec.kernel}: {built_by}"
    elif rec.kernel == oprecord.RUNTIME_LR:
        text = f"{rec.kernel}: {built_by}, through {rec.policy.via}'s kernel"
    else:
        text = f"hand-written {rec.kernel}: {built_by}"
    if rec.lowered is not None and rec.kernel != rec.lowered:
        text += f" (in place of the {rec.lowered!r} kernel its lowering gives, which graphs use)"
    return text


def facts(name: str, platform: str | None = None) -> dict[str, str]:
    """Fact -> where it lives, for one op (``python -m torchneuron.where`` prints these)."""
    platform = platform or config.platform
    packet = getattr(torch.ops.aten, name, None) if "." not in name else None
    if packet is not None:
        # The default overload is the op's only if it takes tensors (aten::add's is on Python scalars).
        if "default" not in packet.overloads() or "Tensor" not in str(packet.default._schema):
            raise SystemExit(f"torchneuron.where: aten::{name} has several overloads; name one of "
                             f"{', '.join(f'{name}.{o}' for o in packet.overloads() if o != 'default')}")
        name += ".default"   # `where exp` asks about aten::exp, whose overload is exp.default
    rec = oprecord.record(name, platform)
    try:
        overload = aten_overload(name)
    except AttributeError:
        raise SystemExit(f"torchneuron.where: no ATen overload aten::{name} (spell it 'add.Tensor', "
                         "'exp.default')") from None
    out = {"op": f"aten::{name}  {overload._schema}"}
    low = rec.lowering
    if low is None:
        out["lowering"] = "none"
    else:
        site = rec.site
        where = f"{_path(site[0])}:{site[1]}" if site else "?"
        fn = f"{getattr(low.fn, '__module__', '?')}.{getattr(low.fn, '__qualname__', low.fn)!s}"
        defined = location(low.fn)
        text = f"{fn}, registered at {where}"
        if defined and defined != where:
            text += f", defined at {defined}"
        flags = _flags(low)
        out["lowering"] = text + (f"  [{flags}]" if flags else "")
    dispatcher_name = f"aten::{name.removesuffix('.default')}"
    out["eager kernel"] = _eager_kernel(rec, overload, dispatcher_name)
    if rec.kernel is not None:
        registered = name in registration.KERNELS
        out["registered"] = "yes, PrivateUse1" if registered else "no (another platform's config?)"
    if rec.name in oprecord.EAGER:
        wrappers = [f"{w} ({location(registration.WRAPPERS[w])})" for w in rec.wrappers]
        out["eager policy"] = (_line_of(oprecord, _quoted(name) + ":")
                               + (f"; wraps: {', '.join(wrappers)}" if wrappers else ""))
    if rec.functional is not None:
        out["derived from"] = f"{rec.functional} ({rec.lowered} variant, from the schema)"
    if rec.kernel == oprecord.OUT and name.partition(".")[0] in out_variants.DTYPE_FROM_OUT:
        out["out= dtype"] = f"out's dtype picks the result's ({_line_of(out_variants, 'DTYPE_FROM_OUT =')})"
    if dispatcher_name in fallback.KEEP_OUT_SHAPE:
        out["out= shape"] = (f"an out= of the result's element count keeps its shape "
                             f"({_line_of(fallback, _quoted(dispatcher_name))})")
    if rec.variants:
        out["derived variants"] = ", ".join(rec.variants)
    arg, arg_op = rec.device_index, name.partition(".")[0].removesuffix("_")
    if arg is not None:
        out["device index"] = (f"'{arg}' must be on the op's device, a 0-dim CPU tensor too "
                               f"({_line_of(devices, _quoted(arg_op) + ':')})")
    elif rec.policy.host_indices:
        out["device index"] = ("index tensors and masks may live on the CPU: moved to the device "
                               f"({location(registration.WRAPPERS['host_indices'])})")
    kind = rec.graph_kind
    out["graph kind"] = (f"{kind}" + (f" ({_line_of(oprecord, _quoted(name) + ':')})"
                                      if name in oprecord.GRAPH_KINDS else "")
                         if kind else _NO_GRAPH_KIND.get(rec.kernel, _NO_LOWERING))
    entry, refused = rec.dtype_refusals()
    if refused:
        codes = sorted({"/".join(map(str, sig)) for sig in refused})
        more = f", ... ({len(codes)} in all)" if len(codes) > 6 else ""
        out["dtype refusals"] = (f"{', '.join(codes[:6])}{more} "
                                 f"({_line_of(cpu_dtypes.TABLE_PATH, _quoted(entry) + ': [')})")
    elif refused is not None:
        out["dtype refusals"] = f"none refused ({_line_of(cpu_dtypes.TABLE_PATH, _quoted(entry) + ': [')})"
    else:
        out["dtype refusals"] = "not measured (no OpInfo sample reaches it)"
    for listed, label in ((autocast.LOWER_PRECISION, "lower precision"), (autocast.FLOAT32, "float32")):
        if name in listed:
            out["autocast"] = f"{label} ({_line_of(autocast, _quoted(name))})"
    check = argument_checks.CHECKS.get(name.removesuffix(".default"))
    if check is not None:
        out["argument check"] = f"{check.__name__} ({location(check)})"
    decomposition = decomposition_table.get(overload)
    if decomposition is not None:
        out["decomposition"] = f"{getattr(decomposition, '__qualname__', decomposition)} ({location(decomposition)})"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchneuron.where", description=__doc__.split("\n\n")[0])
    p.add_argument("ops", nargs="+", help="ATen overloads, e.g. add.Tensor index.Tensor exp.default")
    p.add_argument("--platform", default=None, help="PJRT platform to answer for (default: the configured one)")
    args = p.parse_args(argv)
    for i, name in enumerate(args.ops):
        if i:
            print()
        for fact, where in facts(name, args.platform).items():
            print(f"{fact:>17}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
