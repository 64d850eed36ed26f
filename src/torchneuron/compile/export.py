"""``torchneuron.export``: save a ``torch.export`` program as a neuron artifact, load it and run it.

``save(exported_program, path)`` writes PyTorch's own ``.pt2`` archive (``torch.export.save``: the
graph, its weights, its signature) with files added under ``torchneuron/``: the StableHLO the
program compiles to on neuron (``program.stablehlo.mlir``; one file per shape bucket under
``buckets/`` for a program exported with ``dynamic_shapes``), the ATen graph that StableHLO comes
from (``program.fx.py``) and a manifest (torch/torchneuron versions, platform, the graph's hash,
the input signature, and for dynamic dims their symbols, ranges, bucket ladders and programs).
``load(path)`` gives a ``NeuronProgram``: calling it runs the whole program as one neuron
executable (the graph compiler's, cached in memory and on disk like any torch.compile graph),
with the weights moved to the device once. The archive stays a plain ``.pt2``:
``torch.export.load`` reads it anywhere.

**Static exports** run as exported: a call with other input shapes than the example inputs'
raises a ``ValueError`` naming both (manifest format 1).

**Dynamic exports** (``torch.export.export(..., dynamic_shapes=...)``, manifest format 2) run with
the bucketed graph machinery of ``compile/dynamic.py`` (whatever ``config.shapes`` says): one
executable per bucket of the dynamic sizes, inputs read as padded boxes, the true sizes runtime
inputs, outputs of the true shapes and equal to the eager module's on them. The bucket ladder is
fixed when saving (``buckets=``, else ``config.shape_buckets``) and recorded in the manifest, so the
serving process buckets as the saving one did. A call with a dynamic size outside the exported
range, or a static dim of another size, raises a ``ValueError`` naming the input, dim, size and
range.

Buffers the program mutates are updated in the loaded program's own state. ``load`` warns when the
manifest's torch / torchneuron versions or platform differ from the running ones (the program is
compiled again from its graph there), and refuses a manifest format it does not know.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import tempfile
import warnings

import sympy
import torch
from torch.utils import _pytree as pytree

from ..config import config
from ..metrics import metrics
from .dynamic import BucketedProgram, bucket_for, parse_buckets
from .graph import GraphProgram

__all__ = ["save", "load", "NeuronProgram"]

_PREFIX = "torchneuron/"
_FILES = ("manifest.json", "program.stablehlo.mlir", "program.fx.py")
_FORMATS = (1, 2)   # 1: static shapes; 2: with dynamic dims, one StableHLO per bucket


def _on_device(ep, device):
    """The program exported again from its module on ``device`` (the graph's values then say
    ``device``, which the graph compiler plans its outputs by), in core ATen."""
    args, kwargs = ep.example_inputs or ((), {})
    moved = pytree.tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, (args, kwargs))
    module = ep.module().to(device)
    return torch.export.export(module, moved[0], moved[1]).run_decompositions()


def _moved(ep, device):
    """A copy of a dynamic program on ``device``, in core ATen, its symbolic sizes kept (exporting
    the module again would need its ``dynamic_shapes``, which the program does not keep)."""
    from torch.export.passes import move_to_device_pass  # here: torch.export loads with the first artifact
    return move_to_device_pass(copy.deepcopy(ep), device).run_decompositions()


def _state_inputs(ep) -> list[tuple[str, str]]:
    """(kind, target) of the graph's inputs that are the program's own state, in placeholder order."""
    return [(s.kind.name, s.target) for s in ep.graph_signature.input_specs if s.kind.name != "USER_INPUT"]


def _state_value(ep, target):
    if target in ep.state_dict:
        return ep.state_dict[target]
    return ep.constants[target]


def _user_inputs(ep) -> list[tuple[str, tuple]]:
    """(name, size expressions) of the program's tensor inputs, in the order of the flattened
    call's tensors (sympy Integers for static sizes)."""
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    found = []
    for node in ep.graph.nodes:
        v = node.meta.get("val")
        if node.op == "placeholder" and node.name in specs and isinstance(v, torch.Tensor):
            found.append((node.name, tuple(s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))
                                           for s in v.shape)))
    return found


def _is_dynamic(ep) -> bool:
    return any(not isinstance(e, sympy.Integer) for _, exprs in _user_inputs(ep) for e in exprs)


def _dynamic_dims(ep, buckets) -> list[dict]:
    """The manifest's entry per dynamic input dim: the input, the dim, its size's symbol, the
    range it may take (the export's range constraints) and the ladder's buckets covering it."""
    ladder = parse_buckets(buckets if buckets is not None else config.shape_buckets)
    ranges, dims = {}, []
    for i, (name, exprs) in enumerate(_user_inputs(ep)):
        for d, e in enumerate(exprs):
            if isinstance(e, sympy.Integer):
                continue
            if not isinstance(e, sympy.Symbol):   # a derived dim (2*s0): checked from its symbols
                dims.append({"input": i, "name": name, "dim": d, "size": str(e)})
                continue
            if e not in ranges:
                ranges[e] = _served_range(ep, e, name, d, ladder)
            lo, hi = ranges[e]
            dims.append({"input": i, "name": name, "dim": d, "symbol": str(e), "min": lo, "max": hi,
                         "buckets": _covering(lo, hi, ladder, f"dim {d} of input {name}")})
    return dims


def _served_range(ep, symbol, name, d, ladder) -> tuple[int, int]:
    vr = ep.range_constraints.get(symbol)
    lo = int(vr.lower) if vr is not None and isinstance(vr.lower, sympy.Integer) else 0
    hi = int(vr.upper) if vr is not None and isinstance(vr.upper, sympy.Integer) else None
    kind, arg = ladder
    if hi is None:
        if kind == "pow2":
            raise ValueError(f"torchneuron.export.save: dim {d} of input {name} ({symbol}) has no upper bound: "
                             "an artifact holds one program per bucket of the range, so give the dim a maximum "
                             "(torch.export.Dim(..., max=N)) or a list of buckets (buckets=[...])")
        hi = arg[-1]   # a list ladder: the sizes up to its largest bucket are served
    elif kind == "list" and hi > arg[-1]:
        raise ValueError(f"torchneuron.export.save: dim {d} of input {name} ({symbol}) may be up to {hi}, above "
                         f"the largest bucket {arg[-1]} (buckets {list(arg)}): add a bucket of at least {hi}, "
                         "or export with a smaller maximum")
    return lo, hi


def _covering(lo: int, hi: int, ladder, what) -> list[int]:
    """The buckets that sizes ``lo`` to ``hi`` round up to."""
    top = bucket_for(max(hi, 1), ladder, what)
    first = bucket_for(max(lo, 1), ladder, what)
    kind, arg = ladder
    if kind == "list":
        return [b for b in arg if first <= b <= top]
    sizes = [first]
    while sizes[-1] < top:
        sizes.append(sizes[-1] * 2)
    return sizes


def _bucket_sets(dims) -> list[dict]:
    """Every combination of the dynamic symbols' buckets: the programs an artifact holds."""
    per_symbol = {}
    for dim in dims:
        if "symbol" in dim:
            per_symbol.setdefault(dim["symbol"], dim["buckets"])
    names = sorted(per_symbol)
    return [dict(zip(names, combo)) for combo in itertools.product(*(per_symbol[n] for n in names))]


def _bucket_file(bucket_set: dict) -> str:
    tag = "_".join(f"{s}-{b}" for s, b in sorted(bucket_set.items()))
    return f"{_PREFIX}buckets/{tag}.stablehlo.mlir"


def _sample(tensors, inputs, dims, bucket_set):
    """The example inputs resized so that every dynamic size falls in ``bucket_set``'s buckets: the
    largest size of the range in each bucket (its own values repeated along the dim)."""
    by_name = {dim["symbol"]: min(bucket_set[dim["symbol"]], dim["max"]) for dim in dims if "symbol" in dim}
    out = []
    for t, (_, exprs) in zip(tensors, inputs):
        for d, e in enumerate(exprs):
            if isinstance(e, sympy.Integer):
                continue
            size = int(e.subs({s: by_name[str(s)] for s in e.free_symbols}))
            index = torch.arange(size) % t.shape[d]
            t = t.index_select(d, index)
        out.append(t)
    return out


class NeuronProgram:
    """An exported program loaded for neuron: call it like the module it was exported from.

    ``stablehlo`` is a static artifact's saved StableHLO; ``programs`` maps each bucket program's
    file in a dynamic artifact to its StableHLO, and ``dims`` lists its dynamic dims (the
    manifest's ``dynamic_dims``)."""

    def __init__(self, exported_program, device="neuron", stablehlo: str = "", manifest: dict | None = None,
                 *, dims: list | None = None, programs: dict | None = None):
        self.device = torch.device(device)
        self.original = exported_program
        self.stablehlo = stablehlo
        self.manifest = manifest or {}
        # Dynamic programs: the manifest's dynamic dims and the StableHLO of each bucket's program.
        self.dims = dims if dims is not None else self.manifest.get("dynamic_dims", [])
        self.programs = programs or {}
        dynamic = bool(self.dims)
        self.exported_program = ep = (_moved if dynamic else _on_device)(exported_program, self.device)
        self._specs = _state_inputs(ep)
        with torch.no_grad():
            self.state = {target: _state_value(ep, target).detach().to(self.device)
                          for _, target in self._specs}
        self._inputs = _user_inputs(ep)
        if dynamic:
            ladder = sorted({b for dim in self.dims for b in dim.get("buckets", ())})
            self._program = BucketedProgram(ep.graph_module, "inference", fallback=config.compile_fallback,
                                            name="export", buckets=ladder)
        else:
            self._program = GraphProgram(ep.graph_module, "inference", config.compile_fallback, name="export")
        self._shapes = [tuple(t.shape) for t in pytree.tree_leaves(exported_program.example_inputs or ((), {}))
                        if isinstance(t, torch.Tensor)]

    def _check_shapes(self, tensors):
        if not self.dims:
            shapes = [tuple(a.shape) for a in tensors]
            if self._shapes and shapes != self._shapes:
                raise ValueError(f"torchneuron.export: this program was exported for input shapes {self._shapes}, "
                                 f"got {shapes}: artifacts of static exports have static shapes (export again "
                                 "with inputs of the new shapes, or with dynamic_shapes)")
            return
        ranges = {(dim["input"], dim["dim"]): dim for dim in self.dims}
        values = {}
        for i, (a, (name, exprs)) in enumerate(zip(tensors, self._inputs)):
            if a.dim() != len(exprs):
                raise ValueError(f"torchneuron.export: input {name} has {a.dim()} dims, the program was "
                                 f"exported with {len(exprs)}")
            for d, (n, e) in enumerate(zip(a.shape, exprs)):
                dim = ranges.get((i, d))
                if isinstance(e, sympy.Integer):
                    if n != int(e):
                        raise ValueError(f"torchneuron.export: input {name} dim {d} has size {n}; the program "
                                         f"was exported with the static size {int(e)} there")
                elif dim is not None and "symbol" in dim:
                    if not dim["min"] <= n <= dim["max"]:
                        raise ValueError(f"torchneuron.export: input {name} dim {d} has size {n}, outside the "
                                         f"range [{dim['min']}, {dim['max']}] of its dynamic size "
                                         f"{dim['symbol']} this program was saved for (buckets "
                                         f"{dim['buckets']})")
                    if values.setdefault(e, n) != n:
                        raise ValueError(f"torchneuron.export: input {name} dim {d} has size {n}, but the "
                                         f"program's dynamic size {e} is {values[e]} in another input")
        for a, (name, exprs) in zip(tensors, self._inputs):
            for d, (n, e) in enumerate(zip(a.shape, exprs)):
                if not isinstance(e, sympy.Integer | sympy.Symbol) and e.free_symbols <= set(values):
                    want = int(e.subs(values))
                    if n != want:
                        raise ValueError(f"torchneuron.export: input {name} dim {d} has size {n}; the program "
                                         f"says {e} = {want} there")

    def _run(self, args, kwargs, dump_dir=None):
        flat, _ = pytree.tree_flatten((args, kwargs))
        self._check_shapes([a for a in flat if isinstance(a, torch.Tensor)])
        flat = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in flat]
        program = self._program
        if dump_dir is not None and not self.dims:
            program = GraphProgram(self.exported_program.graph_module, "inference", config.compile_fallback,
                                   name="export", dump_dir=dump_dir)
        elif self.dims:
            program.dump_dir = dump_dir   # each new bucket's StableHLO (save collects them)
        with torch.no_grad():
            outs = program(*[self.state[t] for _, t in self._specs], *flat)
        user = []
        for spec, value in zip(self.exported_program.graph_signature.output_specs, outs):
            if spec.kind.name == "BUFFER_MUTATION":
                self.state[spec.target] = value
            elif spec.kind.name == "USER_OUTPUT":
                user.append(value)
        return pytree.tree_unflatten(user, self.exported_program.call_spec.out_spec)

    def __call__(self, *args, **kwargs):
        return self._run(args, kwargs)

    def module(self) -> torch.nn.Module:
        """The program as an eager ``nn.Module`` on the device (``ExportedProgram.module()``)."""
        return self.original.module().to(self.device)


def save(exported_program, path, *, device="neuron", buckets=None) -> None:
    """Write ``exported_program`` (from ``torch.export.export``) and its neuron StableHLO to ``path``.

    A program exported with ``dynamic_shapes`` is saved with one StableHLO program per bucket of
    its dynamic sizes: ``buckets`` is the ladder (what ``config.shape_buckets`` accepts: ``"pow2"``,
    ``"pow2:<min>"`` or a list of sizes; ``config.shape_buckets`` when None), and the artifact holds
    **every** bucket that the export's range (``Dim(min=..., max=...)``) reaches, each compiled
    once here. All of them, not a list of chosen ones: the export promises that any size in its
    range runs, and a deployed process can see in the manifest which programs exist and that
    none is missing; to write fewer programs, give a coarser ladder or a narrower range (the
    ladder is the one place that says which sizes share a program). A range without a maximum
    needs a list ladder (its largest bucket is then the largest size served); a finite maximum
    above a list's largest bucket is refused.
    """
    if not isinstance(exported_program, torch.export.ExportedProgram):
        raise TypeError(f"torchneuron.export.save: expected a torch.export.ExportedProgram, got "
                        f"{type(exported_program).__name__} (make one with torch.export.export(model, args))")
    dynamic = _is_dynamic(exported_program)
    if exported_program.range_constraints and not dynamic:
        raise ValueError("torchneuron.export.save: the program has symbolic sizes that are not input sizes "
                         f"({', '.join(map(str, exported_program.range_constraints))}); artifacts hold "
                         "programs per bucket of input sizes only")
    args, kwargs = exported_program.example_inputs or ((), {})
    if dynamic:
        extra, manifest_fields, program = _save_buckets(exported_program, device, buckets)
    else:
        program = NeuronProgram(exported_program, device)
        extra = {}
        with tempfile.TemporaryDirectory() as dump:
            program._run(args, kwargs, dump_dir=dump)
            for name in sorted(os.listdir(dump)):
                kind = "program.stablehlo.mlir" if name.endswith(".stablehlo.mlir") else "program.fx.py"
                with open(os.path.join(dump, name)) as f:
                    extra[_PREFIX + kind] = f.read()
        manifest_fields = {"format": 1, "graph_hash": program._program.graph_hash}
    from .. import __version__  # here: the package's __init__ imports the layers, not they it
    manifest = {"format": manifest_fields.pop("format"), "torch": torch.__version__, "torchneuron": __version__,
                "platform": config.platform, **manifest_fields}
    if not dynamic:
        manifest["inputs"] = [[str(t.dtype), list(t.shape)] for t in pytree.tree_leaves((args, kwargs))
                              if isinstance(t, torch.Tensor)]
    extra[_PREFIX + "manifest.json"] = json.dumps(manifest, indent=1)
    torch.export.save(exported_program, path, extra_files=extra)


def _save_buckets(ep, device, buckets):
    """The extra files and manifest fields of a dynamic program: its bucket programs compiled (on
    the example inputs resized into each bucket), their StableHLO collected."""
    dims = _dynamic_dims(ep, buckets)
    fallbacks = _fallbacks()
    program = NeuronProgram(ep, device, dims=dims)
    args, kwargs = ep.example_inputs or ((), {})
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    inputs = _user_inputs(ep)
    extra, programs = {}, []
    for bucket_set in _bucket_sets(dims):
        resized = iter(_sample(tensors, inputs, dims, bucket_set))
        call = pytree.tree_unflatten([next(resized) if isinstance(a, torch.Tensor) else a for a in flat], spec)
        with tempfile.TemporaryDirectory() as dump:
            if program._program.static is None:
                program._run(call[0], call[1], dump_dir=dump)
            if program._program.static is not None:   # an op without a bucketed rule
                why = "; ".join(k.removeprefix("bucketed_fallback: ") for k in _fallbacks() - fallbacks)
                raise ValueError("torchneuron.export.save: this program cannot be saved with dynamic shapes, "
                                 f"it has no bucketed rule for {why or 'one of its ops'} (see docs/shapes.md); "
                                 "export it with static shapes (one artifact per shape) instead")
            for name in sorted(os.listdir(dump)):
                with open(os.path.join(dump, name)) as f:
                    text = f.read()
                key = _bucket_file(bucket_set) if name.endswith(".stablehlo.mlir") else _PREFIX + "program.fx.py"
                extra[key] = text
        if _bucket_file(bucket_set) not in extra:   # an artifact must not list a program it lacks
            raise RuntimeError(f"torchneuron.export.save: the program of buckets {bucket_set} wrote no StableHLO")
        programs.append({"buckets": bucket_set, "file": _bucket_file(bucket_set)})
    program._program.dump_dir = None
    graph_hash = hashlib.sha256(program.exported_program.graph_module.code.encode()).hexdigest()
    ladder = parse_buckets(buckets if buckets is not None else config.shape_buckets)
    fields = {"format": 2, "graph_hash": graph_hash,
              "inputs": [[str(t.dtype), [int(e) if isinstance(e, sympy.Integer) else str(e) for e in exprs]]
                         for t, (_, exprs) in zip(tensors, inputs)],
              "ladder": list(ladder[1]) if ladder[0] == "list" else f"pow2:{ladder[1]}",
              "dynamic_dims": dims, "programs": programs}
    return extra, fields, program


def _fallbacks() -> set:
    """The bucketed fallbacks counted so far in this process (``compile/dynamic.py``), by reason."""
    return {k for k, v in metrics.extra.items() if k.startswith("bucketed_fallback: ") and v}


def load(path, *, device="neuron") -> NeuronProgram:
    """Read an artifact ``save`` wrote: a ``NeuronProgram`` that runs it on ``device``."""
    extra = {_PREFIX + name: "" for name in _FILES}
    ep = torch.export.load(path, extra_files=extra)   # fills in every extra file of the archive
    manifest = json.loads(extra[_PREFIX + "manifest.json"] or "{}")
    if not manifest:
        raise ValueError(f"torchneuron.export.load: {path} holds no torchneuron manifest (it was not "
                         "written by torchneuron.export.save); torch.export.load reads it as a plain program")
    _check_manifest(manifest, path)
    programs = {p["file"]: extra.get(p["file"], "") for p in manifest.get("programs", ())}
    missing = [f for f, text in programs.items() if not text]
    if missing:
        raise ValueError(f"torchneuron.export.load: {path} lists bucket programs it does not hold: {missing}")
    return NeuronProgram(ep, device, extra[_PREFIX + "program.stablehlo.mlir"], manifest, programs=programs)


def _check_manifest(manifest: dict, path) -> None:
    """Refuse a manifest format this version cannot read; warn where the artifact was saved under
    other versions or another platform than this process runs."""
    if manifest.get("format") not in _FORMATS:
        raise ValueError(f"torchneuron.export.load: {path} has manifest format {manifest.get('format')!r}; "
                         f"this torchneuron reads formats {', '.join(map(str, _FORMATS))} (save it again "
                         "with this version)")
    from .. import __version__  # here: the package's __init__ imports the layers, not they it
    here = {"torch": torch.__version__, "torchneuron": __version__, "platform": config.platform}
    differ = [f"{k} {manifest.get(k)!r} (here {v!r})" for k, v in here.items() if manifest.get(k) != v]
    if differ:
        warnings.warn(f"torchneuron.export.load: {path} was saved with {', '.join(differ)}: its "
                      "program is compiled again here from its graph, and its saved StableHLO is "
                      "kept for reference only", stacklevel=3)
