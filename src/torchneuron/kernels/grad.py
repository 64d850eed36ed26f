"""Autograd for custom kernels: ``jax.vjp`` of the body, or the user's ``backward=``.

The gradient is itself a custom kernel, ``<ns>::<name>_backward``, registered with the same
machinery: it runs through the eager executable cache on neuron and on the host for CPU tensors,
fuses in adaptive eager, and appears as one node of a torch.compile backward graph. Its arguments
are the output gradients, the (static) positions of the input tensors that need a gradient, so
only those are computed, and the forward's own arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .body import TENSOR, TENSOR_LIST, Body, KernelError


def backward_schema(forward_schema: str, names) -> tuple[str, str, str]:
    """(schema, grads name, wanted name) of the backward kernel, from the forward's schema text
    ``(args) -> returns`` (a functional op: no mutation annotations)."""
    grads, wanted = _fresh("grads", names), _fresh("wanted", names)
    fwd_args = forward_schema[1:forward_schema.rindex(") -> ")].strip()
    args = f"Tensor[] {grads}, int[] {wanted}" + (f", {fwd_args}" if fwd_args else "")
    return f"({args}) -> Tensor[]", grads, wanted


def _fresh(name, taken):
    while name in taken:
        name = "_" + name
    return name


class TensorLeaves:
    """Where the tensors sit among a call's arguments (a ``Tensor[]`` argument holds several)."""

    def __init__(self, body: Body, values):
        self.slots = []      # (argument index, list position or None)
        for i, (v, k) in enumerate(zip(values, body.kinds)):
            if k == TENSOR and v is not None:
                self.slots.append((i, None))
            elif k == TENSOR_LIST:
                self.slots.extend((i, j) for j, x in enumerate(v) if x is not None)

    def get(self, values):
        return [values[i] if j is None else values[i][j] for i, j in self.slots]

    def put(self, values, leaves):
        values = [list(v) if isinstance(v, list | tuple) else v for v in values]
        for (i, j), x in zip(self.slots, leaves):
            if j is None:
                values[i] = x
            else:
                values[i][j] = x
        return values


def make_backward_fn(forward: Body, backward_fn):
    """The JAX body of ``<name>_backward``: (grads, wanted, *forward arguments) -> gradients of
    the wanted input tensors."""
    fwd_kw_names = [n for n, k in zip(forward.names, forward.kwarg_only) if k]

    def vjp_body(grads, wanted, *pos, **kw):
        values = list(pos) + [kw[n] for n in fwd_kw_names]
        grads, wanted = list(grads), list(wanted)
        leaves = TensorLeaves(forward, values)
        primals = leaves.get(values)
        if backward_fn is not None:
            return _user_backward(forward, backward_fn, values, grads, wanted, leaves, primals)

        def f(*diff):
            full = list(primals)
            for w, x in zip(wanted, diff):
                full[w] = x
            vals = leaves.put(values, full)
            return forward.flatten(forward.run(vals), vals)

        try:
            outs, pullback = jax.vjp(f, *[primals[w] for w in wanted])
            cotangents = tuple(jnp.asarray(g, o.dtype).reshape(o.shape) for g, o in zip(grads, outs))
            return list(pullback(cotangents))
        except KernelError:
            raise
        except Exception as err:  # noqa: BLE001 - reported with the kernel and its inputs
            raise forward.trace_error(err, values, "differentiating the kernel with jax.vjp") from err

    return vjp_body


def _user_backward(forward, backward_fn, values, grads, wanted, leaves, primals):
    call_args = list(values)
    if forward.returns == "list":
        call_args.append(grads)
    else:
        call_args.extend(grads)
    try:
        result = backward_fn(*call_args)
    except KernelError:
        raise
    except Exception as err:  # noqa: BLE001
        raise forward.trace_error(err, values, "running backward=") from err
    names = forward.names
    if len(names) == 1 and not isinstance(result, list | tuple):
        result = (result,)
    if not isinstance(result, list | tuple) or len(result) != len(names):
        got = f"{len(result)} values" if isinstance(result, list | tuple) else type(result).__name__
        raise KernelError(
            f"torchneuron kernel {forward.qualname}: backward= returned {got}; it must return one "
            f"gradient per argument of the kernel ({', '.join(names)}), None where there is none. "
            f"Inputs: ({forward.describe(values)})")
    out = []
    for w in wanted:
        i, j = leaves.slots[w]
        g = result[i] if j is None or result[i] is None else result[i][j]
        x = primals[w]
        if g is None:
            out.append(jnp.zeros(x.shape, x.dtype))
            continue
        g = jnp.asarray(g)
        if tuple(g.shape) != tuple(x.shape):
            label = names[i] if j is None else f"{names[i]}[{j}]"
            raise KernelError(
                f"torchneuron kernel {forward.qualname}: backward= returned a gradient of shape "
                f"{list(g.shape)} for {label!r}, whose shape is {list(x.shape)}. "
                f"Inputs: ({forward.describe(values)})")
        out.append(g.astype(x.dtype))   # as PyTorch's autograd casts a gradient to its input's dtype
    return out


def install(opdef, backward_op) -> None:
    """Register autograd for ``opdef`` (a functional JaxKernel) through ``backward_op``."""
    body = opdef.body
    n_pos = sum(1 for k in body.kwarg_only if not k)
    kw_names = [n for n, k in zip(body.names, body.kwarg_only) if k]

    def save(ctx, values):
        leaves = TensorLeaves(body, values)
        tensors = leaves.get(values)
        ctx.save_for_backward(*tensors)
        ctx.values = leaves.put(values, [None] * len(tensors))
        ctx.leaves = leaves

    def backward(ctx, *grads):
        leaves = ctx.leaves
        tensors = list(ctx.saved_tensors)
        values = leaves.put(ctx.values, tensors)
        needs = ctx.needs_input_grad
        wanted = []
        for w, ((i, j), t) in enumerate(zip(leaves.slots, tensors)):
            need = needs[i] if j is None else needs[i][j]
            if need and (t.is_floating_point() or t.is_complex()):
                wanted.append(w)
        result = [None] * n_pos
        if wanted:
            grads = list(grads[0]) if body.returns == "list" else list(grads)
            computed = backward_op(grads, wanted, *values[:n_pos],
                                   **dict(zip(kw_names, values[n_pos:])))
            for w, g in zip(wanted, computed):
                i, j = leaves.slots[w]
                if j is None:
                    result[i] = g
                else:
                    if result[i] is None:
                        result[i] = [None] * len(values[i])
                    result[i][j] = g
        return tuple(result)

    if kw_names:
        def setup_context(ctx, inputs, keyword_only_inputs, output):
            save(ctx, list(inputs) + [keyword_only_inputs[n] for n in kw_names])
    else:
        def setup_context(ctx, inputs, output):
            save(ctx, list(inputs))
    opdef.register_autograd(backward, setup_context=setup_context)
