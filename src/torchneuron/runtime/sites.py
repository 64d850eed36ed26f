"""Call sites: the first stack frame in the user's own code (outside torch, torchneuron, jax, stdlib)."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
import warnings

_packages: tuple[str, ...] | None = None
_stdlib: tuple[str, ...] = ()
_is_internal: dict[str, bool] = {}


def _init() -> None:
    global _packages, _stdlib
    dirs = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}   # torchneuron
    for mod in ("torch", "jax", "jaxlib", "numpy", "ml_dtypes", "functorch"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "__file__", None):
            dirs.add(os.path.dirname(os.path.abspath(m.__file__)))
    _packages = tuple(d + os.sep for d in dirs)
    paths = sysconfig.get_paths()
    _stdlib = tuple({os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)})


def internal(filename: str) -> bool:
    """True for frames of torch, torchneuron, jax, numpy and the standard library."""
    hit = _is_internal.get(filename)
    if hit is None:
        if _packages is None:
            _init()
        if filename.startswith("<"):
            hit = filename.startswith("<frozen")
        else:
            path = os.path.abspath(filename)
            hit = path.startswith(_packages) or (
                path.startswith(_stdlib) and "site-packages" not in path and "dist-packages" not in path)
        _is_internal[filename] = hit
    return hit


def _describe(frame, via: str | None) -> dict:
    return _site(frame.f_code, frame.f_lineno, via)


def _site(code, line: int, via: str | None = None) -> dict:
    filename = code.co_filename
    shown = filename
    try:
        rel = os.path.relpath(filename)
        if not rel.startswith(".."):
            shown = rel
    except ValueError:
        pass
    site = {
        "file": shown,
        "line": line,
        "function": code.co_name,
        "code": linecache.getline(filename, line).strip(),
    }
    if via:
        site["via"] = via
    return site


def _walk(frame):
    while frame is not None:
        if not internal(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def user_site(skip: int = 1) -> dict | None:
    """Where the user's code called into torch, as {file, line, function, code[, via]}.

    Ops run by the autograd engine execute on its own thread, which has no Python caller: they are
    attributed to the main thread's current user frame (the ``loss.backward()`` line).
    """
    frame = _walk(sys._getframe(skip))
    if frame is not None:
        return _describe(frame, None)
    main = threading.main_thread()
    if threading.current_thread() is not main:
        main_frame = sys._current_frames().get(main.ident)
        frame = _walk(main_frame)
        if frame is not None:
            return _describe(frame, "autograd backward")
    return None


def place(frame):
    """(code object, line) of the innermost user frame at or above ``frame``, or None: the cheap
    record of a call site for code that describes it only if something goes wrong later. Ops the
    autograd engine runs on its own thread get the main thread's user line (``loss.backward()``)."""
    found = _walk(frame)
    if found is None and threading.current_thread() is not threading.main_thread():
        found = _walk(sys._current_frames().get(threading.main_thread().ident))
    return None if found is None else (found.f_code, found.f_lineno)


def describe_place(where) -> dict | None:
    """The site dict (as :func:`user_site`) of a :func:`place`, or None."""
    return None if where is None else _site(*where)


def format_place(where) -> str:
    """"file:line in function: code" of a :func:`place`."""
    if where is None:
        return "(no user frame)"
    site = _site(*where)
    return format_site(site) + (f": {site['code']}" if site["code"] else "")


def format_site(site: dict | None, *, function: bool = True, missing: str = "(no user frame)") -> str:
    """"file:line in function (via)" of a site dict (also the report's text of a kept call site)."""
    if not site:
        return missing
    text = f"{site['file']}:{site['line']}"
    if function:
        text += f" in {site['function']}"
    if site.get("via"):
        text += f" ({site['via']})"
    return text


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` at the user's line: the first frame outside torch, torchneuron, jax and the
    standard library (a warning from inside ``torch.zeros`` or an op's kernel would otherwise show,
    and be filtered once, at a line of torch or torchneuron). A thread without such a frame (the
    autograd engine's) warns at its caller's line."""
    frame, level = sys._getframe(1), 2
    while frame is not None and internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
