"""A custom kernel on CPU tensors: the same JAX body, jitted on the host's CPU device.

One op then serves both devices, and CPU PyTorch tensors are the test oracle for the neuron path.
Tensors and Scalars are traced arguments (new values compile nothing); static arguments select a
jitted function, as on neuron.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch
from torch._library.utils import fill_defaults

from ..metrics import metrics
from ..runtime import transfers
from .body import SCALAR, SCALAR_LIST, TENSOR, TENSOR_LIST, Body, KernelError

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_COPY = torch.ops.aten.copy_.default.redispatch


@functools.cache
def host_device():
    return jax.devices("cpu")[0]


def schema_values(schema, args, kwargs) -> list:
    """The op's arguments in schema order, defaults filled in."""
    args, kwargs = fill_defaults(schema, args, kwargs)
    values = list(args)
    values.extend(kwargs[a.name] for a in schema.arguments if a.kwarg_only)
    return values


def freeze(v):
    if isinstance(v, list | tuple):
        return tuple(freeze(x) for x in v)
    return v


class HostKernel:
    """The CPU dispatch key's kernel of a custom op."""

    def __init__(self, body: Body, schema):
        self.body = body
        self.schema = schema
        self.dynamic = [i for i, k in enumerate(body.kinds) if k in (TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST)]
        self._jitted: dict = {}

    def __call__(self, *args, **kwargs):
        body = self.body
        metrics.custom_kernel_calls[body.qualname] += 1
        values = schema_values(self.schema, args, kwargs)
        dynamic = set(self.dynamic)
        key = tuple(freeze(v) if i not in dynamic else None for i, v in enumerate(values))
        try:
            fn = self._jitted.get(key)
        except TypeError:   # an unhashable static argument
            raise KernelError(f"torchneuron kernel {body.qualname}: static arguments must be hashable; got "
                              f"({body.describe(values)})") from None
        if fn is None:
            fn = self._jitted[key] = self._build(values)
        dyn = [_to_host(values[i]) for i in self.dynamic]
        results = [np.asarray(r) for r in fn(*dyn)]
        del dyn
        k = 0
        for i in body.mutated:
            targets = values[i] if body.kinds[i] == TENSOR_LIST else [values[i]]
            for t in targets:
                if t is None:
                    continue
                # Below ADInplaceOrView: the op's own dispatch already bumped the version once.
                _COPY(_CPU, t, transfers.torch_from_host(results[k]))
                k += 1
        outs = [transfers.torch_from_host(r) for r in results[k:]]
        return returned(body, outs)

    def _build(self, values):
        body, dynamic = self.body, self.dynamic
        template = [None if i in dynamic else v for i, v in enumerate(values)]

        def run(*dyn):
            # Runs while jax.jit traces: once per executable it compiles.
            metrics.custom_kernel_compiles[body.qualname] += 1
            vals = list(template)
            for i, v in zip(dynamic, dyn):
                vals[i] = v
            return body.flatten(body.run(vals, interpret=True), vals)

        run.__name__ = body.qualname.replace("::", "_")
        return jax.jit(run)


def returned(body: Body, outs: list):
    """What the op returns, from its new outputs (mutated arguments are never returned)."""
    if body.returns == "none":
        return None
    if body.returns == "list":
        return outs
    return outs[0] if body.returns == "tensor" else tuple(outs)


def _to_host(v):
    if isinstance(v, torch.Tensor):
        return jax.device_put(transfers.host_array(v), host_device())
    if isinstance(v, list | tuple):
        return [_to_host(x) for x in v]
    return v
