"""Lowerings: pure JAX functions per ATen op family, all in one registry (``ops.registry``).

``ops.signature`` is the one convention for calling them (schema facts, binding, promotion, casts),
shared by eager kernels and torch.compile graphs.
"""

from . import (  # noqa: F401  (each module registers its lowerings)
    amp,
    elementwise,
    factories,
    foreach,
    graph_ops,
    indexing,
    linalg,
    losses,
    nn,
    pooling,
    reductions,
    rnn,
    sampling,
    shape,
    special,
    spectral,
    transformer,
    views,
)
