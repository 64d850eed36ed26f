"""Lowerings: pure JAX functions per ATen op family, all in one registry (``ops.registry``)."""

from . import (  # noqa: F401  (each module registers its lowerings)
    elementwise,
    factories,
    foreach,
    graph_ops,
    hf_ops,
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
    views,
)
