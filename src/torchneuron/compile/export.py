"""``torchneuron.export``: save a ``torch.export`` program as a neuron artifact, load it and run it.

``save(exported_program, path)`` writes PyTorch's own ``.pt2`` archive (``torch.export.save``: the
graph, its weights, its signature) with three files added under ``torchneuron/``: the StableHLO
the program compiles to on neuron for its example inputs (``program.stablehlo.mlir``), the ATen
graph that StableHLO comes from (``program.fx.py``) and a manifest (torch/torchneuron versions,
platform, the graph's hash, the input signature). ``load(path)`` gives a ``NeuronProgram``: calling
it runs the whole program as one neuron executable (the graph compiler's, cached in memory and on
disk like any torch.compile graph), with the weights moved to the device once. The archive stays a
plain ``.pt2``: ``torch.export.load`` reads it anywhere.

The program runs as exported: static shapes only. A program exported with ``dynamic_shapes`` is
refused by ``save`` (no bucket metadata is written yet), and a call with other input shapes than
the example inputs' raises a ``ValueError`` naming both. Buffers the program mutates are updated in
the loaded program's own state. ``load`` warns when the manifest's torch / torchneuron versions or
platform differ from the running ones (the program is compiled again from its graph there), and
refuses a manifest format it does not know.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
from torch.utils import _pytree as pytree

from ..config import config
from .graph import GraphProgram

__all__ = ["save", "load", "NeuronProgram"]

_PREFIX = "torchneuron/"
_FILES = ("manifest.json", "program.stablehlo.mlir", "program.fx.py")


def _on_device(ep, device):
    """The program exported again from its module on ``device`` (the graph's values then say
    ``device``, which the graph compiler plans its outputs by), in core ATen."""
    args, kwargs = ep.example_inputs or ((), {})
    moved = pytree.tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, (args, kwargs))
    module = ep.module().to(device)
    return torch.export.export(module, moved[0], moved[1]).run_decompositions()


def _state_inputs(ep) -> list[tuple[str, str]]:
    """(kind, target) of the graph's inputs that are the program's own state, in placeholder order."""
    return [(s.kind.name, s.target) for s in ep.graph_signature.input_specs if s.kind.name != "USER_INPUT"]


def _state_value(ep, target):
    if target in ep.state_dict:
        return ep.state_dict[target]
    return ep.constants[target]


class NeuronProgram:
    """An exported program loaded for neuron: call it like the module it was exported from."""

    def __init__(self, exported_program, device="neuron", stablehlo: str = "", manifest: dict | None = None):
        self.device = torch.device(device)
        self.original = exported_program
        self.exported_program = ep = _on_device(exported_program, self.device)
        self.stablehlo = stablehlo
        self.manifest = manifest or {}
        self._specs = _state_inputs(ep)
        with torch.no_grad():
            self.state = {target: _state_value(ep, target).detach().to(self.device)
                          for _, target in self._specs}
        self._program = GraphProgram(ep.graph_module, "inference", config.compile_fallback, name="export")
        self._shapes = [tuple(t.shape) for t in pytree.tree_leaves(exported_program.example_inputs or ((), {}))
                        if isinstance(t, torch.Tensor)]

    def _run(self, args, kwargs, dump_dir=None):
        flat, _ = pytree.tree_flatten((args, kwargs))
        shapes = [tuple(a.shape) for a in flat if isinstance(a, torch.Tensor)]
        if self._shapes and shapes != self._shapes:
            raise ValueError(f"torchneuron.export: this program was exported for input shapes {self._shapes}, "
                             f"got {shapes}: artifacts have static shapes (export again with inputs of "
                             "the new shapes)")
        flat = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in flat]
        program = self._program
        if dump_dir is not None:
            program = GraphProgram(self.exported_program.graph_module, "inference", config.compile_fallback,
                                   name="export", dump_dir=dump_dir)
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


def save(exported_program, path, *, device="neuron") -> None:
    """Write ``exported_program`` (from ``torch.export.export``) and its neuron StableHLO to ``path``."""
    if not isinstance(exported_program, torch.export.ExportedProgram):
        raise TypeError(f"torchneuron.export.save: expected a torch.export.ExportedProgram, got "
                        f"{type(exported_program).__name__} (make one with torch.export.export(model, args))")
    if exported_program.range_constraints:
        raise ValueError("torchneuron.export.save: the program was exported with dynamic_shapes "
                         f"({', '.join(map(str, exported_program.range_constraints))}); artifacts have "
                         "static shapes (no bucket metadata yet): export it with example inputs of the "
                         "shapes to serve")
    program = NeuronProgram(exported_program, device)
    args, kwargs = exported_program.example_inputs or ((), {})
    extra = {}
    with tempfile.TemporaryDirectory() as dump:
        program._run(args, kwargs, dump_dir=dump)
        for name in sorted(os.listdir(dump)):
            kind = "program.stablehlo.mlir" if name.endswith(".stablehlo.mlir") else "program.fx.py"
            with open(os.path.join(dump, name)) as f:
                extra[_PREFIX + kind] = f.read()
    from .. import __version__  # here: the package's __init__ imports the layers, not they it
    manifest = {"format": 1, "torch": torch.__version__, "torchneuron": __version__,
                "platform": config.platform, "graph_hash": program._program.graph_hash,
                "inputs": [[str(t.dtype), list(t.shape)] for t in pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor)]}
    extra[_PREFIX + "manifest.json"] = json.dumps(manifest, indent=1)
    torch.export.save(exported_program, path, extra_files=extra)


def load(path, *, device="neuron") -> NeuronProgram:
    """Read an artifact ``save`` wrote: a ``NeuronProgram`` that runs it on ``device``."""
    extra = {_PREFIX + name: "" for name in _FILES}
    ep = torch.export.load(path, extra_files=extra)
    manifest = json.loads(extra[_PREFIX + "manifest.json"] or "{}")
    if not manifest:
        raise ValueError(f"torchneuron.export.load: {path} holds no torchneuron manifest (it was not "
                         "written by torchneuron.export.save); torch.export.load reads it as a plain program")
    _check_manifest(manifest, path)
    return NeuronProgram(ep, device, extra[_PREFIX + "program.stablehlo.mlir"], manifest)


def _check_manifest(manifest: dict, path) -> None:
    """Refuse a manifest format this version cannot read; warn where the artifact was saved under
    other versions or another platform than this process runs."""
    if manifest.get("format") != 1:
        raise ValueError(f"torchneuron.export.load: {path} has manifest format {manifest.get('format')!r}; "
                         "this torchneuron reads format 1 (save it again with this version)")
    from .. import __version__  # here: the package's __init__ imports the layers, not they it
    here = {"torch": torch.__version__, "torchneuron": __version__, "platform": config.platform}
    differ = [f"{k} {manifest.get(k)!r} (here {v!r})" for k, v in here.items() if manifest.get(k) != v]
    if differ:
        warnings.warn(f"torchneuron.export.load: {path} was saved with {', '.join(differ)}: its "
                      "program is compiled again here from its graph, and its saved StableHLO is "
                      "kept for reference only", stacklevel=3)
