"""What the neuron backend needs from Dynamo besides graphs.

* torchneuron's own Python must never be traced (``runtime/dynamo_skip.py``, installed at
  registration); modules loaded since are marked again here.
* Graph breaks and recompiles of graphs compiled for neuron are counted in ``torchneuron.metrics()``
  (``graph_breaks``, ``recompiles``), keyed by their reason.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from ..metrics import metrics
from ..runtime.dynamo_skip import skip_own_frames


def _reason(message: str) -> str:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "unknown"
    return first[:200]


def _compiles_for_neuron(tx) -> bool:
    """True when the frame ``tx`` traces is compiled by the neuron backend."""
    try:
        # torch._dynamo (seconds to import) is loaded by then: a frame is being traced.
        from torch._dynamo.eval_frame import innermost_backend
        fn = innermost_backend(tx.output.compiler_fn)
    except Exception:  # noqa: BLE001 - not a frame being traced
        return False
    fn = getattr(fn, "compiler_fn", fn)
    # By identity: other backends need not be hashable (Inductor's wrapper is not), and a frame
    # they compile must never fail in this hook.
    return any(fn is backend for backend in _backends)


def _counting_log_graph_break(log_graph_break):
    """Dynamo logs every graph break it makes exactly once through ``log_graph_break`` (unsupported
    calls, explicit ``graph_break()``, data-dependent branches such as ``if x.sum() > 0:``): count
    the breaks of neuron frames there, keyed by the first line of their reason."""
    def counted(self, code_options, reason, exc):
        if not getattr(exc, "logged", False) and _compiles_for_neuron(self):
            metrics.graph_breaks[_reason(getattr(exc, "msg", None) or reason)] += 1
        return log_graph_break(self, code_options, reason, exc)
    counted._torchneuron_counts = True
    return counted


_SYMBOLIC_CONVERT = "torch._dynamo.symbolic_convert"


def _count_breaks(symbolic_convert) -> None:
    tx_class = symbolic_convert.InstructionTranslatorBase
    if not getattr(tx_class.log_graph_break, "_torchneuron_counts", False):
        tx_class.log_graph_break = _counting_log_graph_break(tx_class.log_graph_break)


class _CountOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Installs the graph-break counter the moment Dynamo's tracer is imported: torchneuron.compile
    may be imported first (the profiler and the readiness report do), and the first frame a
    ``torch.compile`` traces must already be counted."""

    def find_spec(self, name, path, target=None):
        if name != _SYMBOLIC_CONVERT:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            self.loader = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _count_breaks(module)


# The functions that are the neuron backend (the entry point's and the compiler's), as ``install``
# was given them: the hooks recognise neuron frames without importing the modules that define them.
_backends: list = []


def install(backend=None) -> None:
    """Install the hooks; ``backend``: a function Dynamo may hold as the neuron backend."""
    if backend is not None and not any(backend is b for b in _backends):
        _backends.append(backend)
    skip_own_frames()
    module = sys.modules.get(_SYMBOLIC_CONVERT)
    if module is not None:
        _count_breaks(module)
    elif not any(isinstance(f, _CountOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _CountOnImport())


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
