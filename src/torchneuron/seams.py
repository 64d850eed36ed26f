"""Every place where one part of torchneuron plugs behaviour into another at run time.

Imports point down the layers (runtime -> ops -> eager -> compile, see docs/contributing.md), yet a
few lower-layer paths must reach work a higher layer owns: a host read must first run adaptive
eager's pending region, a copy between neuron tensors goes through the eager kernel of ``copy_``,
the profiler wraps kernels and graphs. Each such path reads a module attribute that holds a plain
default, and the higher layer replaces it through ``install``/``uninstall`` here -- never by
assigning another package's attribute (``tests/test_structure.py`` fails on any such assignment).
The hot path keeps reading its own module attribute (``eager.kernel.recorder``), so a seam costs
nothing per call.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

from .metrics import metrics


@dataclass
class Seam:
    """A module attribute of ``owner`` that ``installer`` replaces (``default``: its own value)."""

    owner: str          # the module (or "module:object") holding the attribute, which reads it
    attribute: str
    installer: str      # the module that installs the replacement
    purpose: str
    default: object = field(default=None, repr=False)
    _saved: bool = field(default=False, repr=False)

    def _module(self):
        module, _, obj = self.owner.partition(":")
        found = importlib.import_module(module)
        return getattr(found, obj) if obj else found

    def install(self, value) -> None:
        module = self._module()
        if not self._saved:
            self.default = getattr(module, self.attribute)
            self._saved = True
        setattr(module, self.attribute, value)

    def uninstall(self) -> None:
        if self._saved:
            setattr(self._module(), self.attribute, self.default)

    def current(self):
        return getattr(self._module(), self.attribute)


# By attribute name (each is unique).
SEAMS = {s.attribute: s for s in (
    Seam("torchneuron.runtime.memory", "flush_pending", "torchneuron.eager.adaptive",
         "run the pending adaptive-eager region before a host read, a synchronize, a fallback or a "
         "collective (default: nothing pending)"),
    Seam("torchneuron.runtime.memory", "wait_in_flight", "torchneuron.eager.adaptive",
         "wait for adaptive eager's fused run in flight before a host read reports device checks"),
    Seam("torchneuron.eager.kernel", "recorder", "torchneuron.eager.adaptive",
         "the adaptive-eager region that records kernel calls instead of running them (None: plain eager)"),
    Seam("torchneuron.eager.kernel", "bucketer", "torchneuron.compile.eager_buckets",
         "config.shapes='bucketed': serve an eager call that missed the exact cache with its shape "
         "bucket's executable (None: one executable per shape)"),
    Seam("torchneuron.eager.storage_ops", "device_copy_kernel", "torchneuron.eager.registration",
         "the eager kernel of copy_ that copies between neuron tensors (set once its table is built)"),
    Seam("torchneuron.metrics:metrics", "tracer", "torchneuron.profiler",
         "the profiler/readiness-report tracer that records ranges, transfers and compiles (None: off)"),
)}


def seam(attribute: str) -> Seam:
    return SEAMS[attribute]


# Tracing of kernels and graphs swaps methods of the class that owns them; each owner does it
# itself (``eager.kernel.set_tracing``, ``compile.graph.set_tracing``), called by torchneuron.profiler.
TRACING_SWITCHES = ("torchneuron.eager.kernel.set_tracing", "torchneuron.compile.graph.set_tracing")


def traced(owner: str, plain: str, hook: str, with_kwargs: bool = False):
    """A method that hands each call to the installed tracer's ``hook`` together with the plain
    method, or runs the plain method when no tracer is installed. The plain method is looked up as
    ``owner.plain`` at each call: in a forked child runtime/fork.py has replaced it by a refusal."""
    module = sys.modules[owner]

    def method(self, *args, **kwargs):
        fn = getattr(module, plain)
        tracer = metrics.tracer
        if tracer is None:
            return fn(self, *args, **kwargs)
        if with_kwargs:
            return getattr(tracer, hook)(self, fn, args, kwargs)
        return getattr(tracer, hook)(self, fn, args)
    return method
