"""The shape of the code: layers point down, no import cycles, no reaching into other packages'
privates, and the registration traps that would otherwise fail silently."""

from __future__ import annotations

import ast
import os

import pytest
import torch

import torchneuron
from torchneuron import seams
from torchneuron.compile import cache
from torchneuron.ops import registry
from torchneuron.ops.registry import Lowering
from torchneuron.ops.signature import lowers_in_eager, registry_name, signature_for, variants_of

_ROOT = os.path.dirname(os.path.abspath(torchneuron.__file__))
# Layers, lowest first: a package (or top-level module) may import only from its own layer or
# those below. The settings, the counters and the seams are below everything; the package's own
# __init__ (which registers the device) is above everything.
_LAYERS = {"config": -1, "metrics": -1, "seams": -1, "versions": -1,
           "runtime": 0, "ops": 1, "eager": 2, "kernels": 2, "compile": 3, "distributed": 3, "integrations": 3,
           "profiler": 4, "where": 4, "shape_warmup": 4, "report": 5, "cache_tools": 5, "cli": 6, "__main__": 7}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(_ROOT))[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def _modules() -> dict[str, str]:
    return {_module_name(p): p for p in cache.package_sources()}


def _imports(path: str, module: str, modules):
    """(imported torchneuron module, line, at module level) for every import in one file."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "torchneuron":
                found.append((name, node.lineno, id(node) in top_level, node))
    return found


def _layer(module: str):
    parts = module.split(".")
    return _LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_import_only_downwards():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        mine = _layer(module)
        if mine is None:
            continue
        for name, line, _, _ in _imports(path, module, modules):
            theirs = _layer(name)
            if theirs is not None and theirs > mine:
                wrong.append(f"{module}:{line} imports {name}")
    assert not wrong, "imports that point up the layers runtime -> ops -> eager -> compile:\n" + "\n".join(wrong)


def test_every_package_and_module_has_a_layer():
    unlayered = sorted({m.split(".")[1] for m in _modules() if m != "torchneuron" and _layer(m) is None})
    assert not unlayered, f"give these a layer in _LAYERS (tests/test_structure.py): {unlayered}"


def _imported_aliases(path, module, modules):
    """name -> the torchneuron module (or module-level object) it is bound to in this file."""
    aliases = {}
    for name, _, _, node in _imports(path, module, modules):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torchneuron"):
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or "torchneuron"
        else:
            for a in node.names:
                target = name if name.endswith("." + a.name) else f"{name}.{a.name}"
                aliases[a.asname or a.name] = target
    return aliases


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


# Their attributes are data every layer may set: the settings object and the counters.
_DATA = ("torchneuron.config", "torchneuron.metrics")


def test_no_attribute_of_another_package_is_swapped_outside_the_seams():
    """A higher layer plugs into a lower one only through torchneuron.seams (install/uninstall):
    assigning another package's module attribute (``memory.flush_pending = flush``) or class
    attribute (``graph.GraphProgram.__call__ = ...``) is a hidden upward call this test refuses."""
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        aliases = _imported_aliases(path, module, modules)
        mine = _package_of(module)
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    base = t
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if t is base or not isinstance(base, ast.Name) or base.id not in aliases:
                        continue
                    owner = aliases[base.id]
                    if owner in _DATA and t.attr not in seams.SEAMS:
                        continue   # a setting (validated by config) or a counter, not a swap
                    if _package_of(owner) != mine:
                        wrong.append(f"{module}:{node.lineno} assigns {ast.unparse(t)} of {owner}")
    assert not wrong, "attribute swaps across packages (declare a seam in torchneuron/seams.py):\n" + "\n".join(wrong)


def test_every_seam_names_a_real_attribute_and_restores_its_default():
    for name, seam in seams.SEAMS.items():
        assert seam.attribute == name
        seam.current()   # the owner holds the attribute
        __import__(seam.installer)
    s = seams.seam("wait_in_flight")
    installed = s.current()
    s.install(lambda reason: None)
    try:
        assert s.current() is not installed
    finally:
        s.install(installed)
    assert s.current() is installed
    for switch in seams.TRACING_SWITCHES:
        module, _, fn = switch.rpartition(".")
        assert callable(getattr(__import__(module, fromlist=[fn]), fn))


def test_module_level_imports_have_no_cycles():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        deps = set()
        for name, _, top, _ in _imports(path, module, modules):
            if not top:
                continue
            # Importing a.b.c runs the __init__ of a.b first (unless a.b is this module's own
            # package, which is already importing when this module runs).
            parts = name.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[module] = {d for d in deps if d in modules and d != module and not module.startswith(d + ".")}
    # A package's __init__ importing its own submodules is not a cycle of the code.
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                if not all(c.startswith(cycle[0] + ".") or c == cycle[0] for c in cycle):
                    cycles.append(" -> ".join(cycle))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


def test_no_private_names_imported_across_packages():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        for name, line, _, node in _imports(path, module, modules):
            if not isinstance(node, ast.ImportFrom):
                continue
            if name.split(".")[:2] == module.split(".")[:2]:
                continue   # within one package (or the top-level modules)
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                wrong.append(f"{module}:{line} imports {private} from {name}")
    assert not wrong, "\n".join(wrong)


def test_function_level_imports_say_why():
    """An import inside a function dodges something (an import cycle, start-up cost): it says what."""
    modules = _modules()
    silent = set()
    for module, path in modules.items():
        lines = open(path).read().splitlines()
        for _, line, top, _ in _imports(path, module, modules):
            if top:
                continue
            # The reason: a comment on the import, or on the line above its block of imports.
            i = line - 1
            block = []
            while i >= 0 and lines[i].strip().startswith(("from ", "import ")) or (i >= 0 and not lines[i].strip()):
                block.append(lines[i])
                i -= 1
            if not any("#" in b for b in block) and not (i >= 0 and lines[i].strip().startswith("#")):
                silent.add(f"{module}:{line}: {lines[line - 1].strip()}")
    assert not silent, "function-level imports without a reason:\n" + "\n".join(sorted(silent))


def test_package_sources_lists_every_source_file():
    sources = {os.path.relpath(p, _ROOT) for p in cache.package_sources()}
    for path, _, files in os.walk(_ROOT):
        if "__pycache__" in path:
            continue
        for f in files:
            if f.endswith(".py"):
                assert os.path.relpath(os.path.join(path, f), _ROOT) in sources


def test_lowering_is_built_by_keyword():
    with pytest.raises(TypeError):
        Lowering("add.Tensor", lambda a, b: a + b)   # positional fields are refused


def test_lowering_of_composite_implicit_op_is_refused_unless_graph_only():
    # aten::square is CompositeImplicitAutograd: eager mode would never call a kernel for it.
    op = torch.ops.aten.square.default
    low = Lowering(name="square.default", fn=lambda x: x * x)
    with pytest.raises(RuntimeError, match="CompositeImplicitAutograd.*graph_only=True"):
        lowers_in_eager(low, op, "cpu")
    assert not lowers_in_eager(Lowering(name="square.default", fn=low.fn, graph_only=True), op, "cpu")
    assert lowers_in_eager(registry.get("mul.Tensor"), torch.ops.aten.mul.Tensor, "cpu")


def test_every_registered_lowering_passes_the_registration_check():
    for name, low in registry.LOWERINGS.items():
        packet, _, ov = name.partition(".")
        lowers_in_eager(low, getattr(getattr(torch.ops.aten, packet), ov or "default"), "cpu")


def test_signature_pairs_functional_inplace_and_out_overloads():
    inplace, out = variants_of(torch.ops.aten.add.Tensor)
    assert (inplace, out) == (torch.ops.aten.add_.Tensor, torch.ops.aten.add.out)
    sig = signature_for(torch.ops.aten.add_.Tensor, "cpu")
    assert sig.functional is torch.ops.aten.add.Tensor and sig.mutated == [0]
    assert registry_name(torch.ops.aten.index_put_.default) == "index_put_.default"
