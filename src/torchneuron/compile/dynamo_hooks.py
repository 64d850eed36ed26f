"""What the neuron backend needs from Dynamo besides graphs.

* torchneuron's own Python (eager kernels called by the dispatcher, storage-lifetime callbacks, device
  hooks) must never be traced: between compiled graphs Dynamo's frame hook sees every Python frame,
  including kernels that ops run on neuron tensors call into. Their code objects are marked "skip,
  recursively", which costs nothing at call time.
* Graph breaks and recompiles of graphs compiled for neuron are counted in ``torchneuron.metrics()``
  (``graph_breaks``, ``recompiles``), keyed by their reason.
"""

from __future__ import annotations

import sys
import types
from collections import Counter

from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

from ..metrics import metrics

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


def skip_own_frames() -> None:
    """Mark every loaded torchneuron module's code "skip recursively" for Dynamo's frame hook."""
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for name, module in list(sys.modules.items()):
        if module is None or name in _marked or name in _TRACEABLE:
            continue
        if name != "torchneuron" and not name.startswith("torchneuron."):
            continue
        _marked.add(name)
        for code in _code_objects(module):
            set_code_exec_strategy(code, strategy)


def _reason(message: str) -> str:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "unknown"
    return first[:200]


def _for_neuron() -> bool:
    """True while Dynamo is tracing a frame whose backend is the neuron backend."""
    try:
        # torch._dynamo (seconds to import) is loaded by then: a frame is being traced.
        from torch._dynamo.eval_frame import innermost_backend
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        fn = innermost_backend(tx.output.compiler_fn)
    except Exception:  # noqa: BLE001 - no frame being traced
        return False
    # compile/__init__.py imports this module, and backend.py loads Dynamo: both only when tracing.
    from . import neuron_backend
    from .backend import neuron_backend as impl
    fn = getattr(fn, "compiler_fn", fn)
    return fn is neuron_backend or fn is impl


class _BreakCounter(Counter):
    """Dynamo's ``counters["graph_break"]``, also counting neuron graphs' breaks in our metrics."""

    def __setitem__(self, key, value):
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if delta > 0 and _for_neuron():
            metrics.graph_breaks[_reason(key)] += delta


def install() -> None:
    skip_own_frames()
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.utils import counters  # loaded already (checked above)
    current = counters.get("graph_break")
    if not isinstance(current, _BreakCounter):
        counters["graph_break"] = _BreakCounter(current or {})


_last_compile = None


def note_recompile() -> None:
    """Count a Dynamo recompile of the frame being compiled (once per compile), with its reason."""
    global _last_compile
    # Called while Dynamo compiles a frame, so torch._dynamo is loaded; this module must not load it.
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext
    compile_id = CompileContext.current_compile_id()
    context = get_metrics_context()
    # Compile ids repeat after torch._dynamo.reset(); the start time tells compiles apart.
    this = (compile_id, getattr(context, "_start_time_ns", None))
    if compile_id is None or this == _last_compile:
        return
    _last_compile = this
    if not compile_id.frame_compile_id:
        return
    reason = getattr(context, "_metrics", {}).get("recompile_reason")
    metrics.recompiles[_reason(reason or "guard failure (reason not recorded by Dynamo)")] += 1
