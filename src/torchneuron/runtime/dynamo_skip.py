"""torchneuron's own Python is never traced by Dynamo, whatever backend a ``torch.compile`` uses.

Between compiled graphs (after a graph break, in code it does not compile) Dynamo's frame hook sees
every Python frame, including the eager kernels the dispatcher calls for ops on neuron tensors, the
storage-lifetime callbacks and the device hooks; tracing into them fails ("Expected np.nditer
base") or records device internals into a user's graph. Their code objects are marked "skip,
recursively" (it costs nothing at call time): the modules loaded at registration, and each
torchneuron module imported later, as it is imported. Marking needs only torch's C extension, not
``torch._dynamo`` (seconds to import).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

# User-facing helpers Dynamo should trace into (they are plain torch code).
_TRACEABLE = frozenset({"torchneuron.compile.shapes"})
_marked: set[str] = set()


def _code_objects(module):
    seen = set()

    def walk(code):
        if code in seen:
            return
        seen.add(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    def visit(obj, depth=0):
        obj = getattr(obj, "__func__", obj)
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    visit(f, depth)
            return
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            walk(code)
        elif isinstance(obj, type) and depth < 2:
            for v in vars(obj).values():
                visit(v, depth + 1)

    for value in list(vars(module).values()):
        # Only what the module defines itself (not what it imported).
        if getattr(value, "__module__", None) == module.__name__:
            visit(value)
    return seen


def _own(name: str) -> bool:
    return (name == "torchneuron" or name.startswith("torchneuron.")) and name not in _TRACEABLE


def _mark(module) -> None:
    name = module.__name__
    if name in _marked or not _own(name):
        return
    _marked.add(name)
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for code in _code_objects(module):
        set_code_exec_strategy(code, strategy)


def skip_own_frames() -> None:
    """Mark every loaded torchneuron module's code "skip recursively" for Dynamo's frame hook."""
    for name, module in list(sys.modules.items()):
        if module is not None and _own(name) and name not in _marked:
            _mark(module)


class _MarkOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Marks each torchneuron module imported after registration once it has run."""

    def find_spec(self, name, path, target=None):
        if not _own(name):
            return None
        # PathFinder directly: asking importlib.util.find_spec would consult this finder again.
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self_loader = _Marking(spec.loader)
        spec.loader = self_loader
        return spec


class _Marking(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _mark(module)

    def __getattr__(self, name):   # get_resource_reader, get_source... of the real loader
        return getattr(self.loader, name)


def install() -> None:
    skip_own_frames()
    if not any(isinstance(f, _MarkOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _MarkOnImport())
