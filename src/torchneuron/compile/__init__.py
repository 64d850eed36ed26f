"""torch.compile(backend="neuron"): Dynamo and AOTAutograd graphs compiled into one PJRT executable.

The backend is registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="neuron")`` works without importing torchneuron. Importing this
package is cheap; Dynamo, AOTAutograd and the graph compiler load on the first compile.
"""

from __future__ import annotations

from . import dynamo_hooks


def neuron_backend(gm, example_inputs, **kwargs):
    """The Dynamo backend (see ``torchneuron.compile.backend``)."""
    from .backend import neuron_backend as compile_graph  # Dynamo and AOTAutograd load here
    return compile_graph(gm, example_inputs, **kwargs)


# The entry point loads this module when torch.compile(backend="neuron") is called, before Dynamo
# runs any frame: keep Dynamo out of torchneuron's own code from then on, and count graph breaks
# from Dynamo's first frame on (now, or as soon as Dynamo loads).
dynamo_hooks.install(neuron_backend)

__all__ = ["neuron_backend"]
