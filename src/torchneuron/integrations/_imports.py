"""Run a patch on a module as soon as it is imported (or now, if it already is).

A ``sys.meta_path`` finder wraps the loader of the named modules only; every other import is left
to the normal machinery untouched.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

_pending: dict[str, list[Callable]] = {}
_lock = threading.Lock()


def when_imported(name: str, patch: Callable) -> None:
    """Call ``patch(module)`` once module ``name`` has been executed."""
    module = sys.modules.get(name)
    if module is not None:
        # Already imported (or being imported: its definitions so far are what importers will see).
        patch(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(patch)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            with _lock:
                patches = _pending.pop(fullname, [])
            for patch in patches:
                patch(module)

        # The loader object is per module (SourceFileLoader), so this affects this import only.
        loader.exec_module = exec_then_patch
        return spec
