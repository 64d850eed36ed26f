"""Fused recurrent networks: nn.LSTM / nn.GRU / nn.RNN as one executable forward and one backward.

PyTorch's ``aten::lstm`` (``gru``, ``rnn_tanh``, ``rnn_relu``) is a composite: without cuDNN it
runs one matmul and a handful of pointwise ops per time step and layer, each a separate dispatch
(and, on this backend, a separate executable launch). Here the whole stack -- every layer, both
directions, inter-layer dropout -- is one pure JAX function: the input projections of all time
steps as one matmul per layer and direction, the recurrence as a ``lax.scan``.

* The ATen names (``lstm.input`` ...) are registered as lowerings for graphs (``graph_only``: they
  are CompositeImplicitAutograd, so eager mode never reaches a backend kernel for them).
* ``rnn_fused`` / ``rnn_fused_backward`` are the bodies of eager mode's custom ops (``eager/rnn.py``):
  the forward also returns its dropout PRNG key, and the backward is the VJP of the same function,
  replaying the same dropout masks -- so forward and gradient cannot disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .numerics import compute_dtype
from .precision import RNN, rnn_precision
from .registry import lowering

# Gates per cell of each recurrent mode.
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _matmul_t(x, w):
    """x @ w.T at the float32 precision cuDNN's RNN setting asks for (float32 on XLA:CPU)."""
    return jnp.matmul(x, w.T, precision=rnn_precision())


def _layer_params(params, has_biases, num_layers, bidirectional, proj):
    """Split the flat parameter list into [layer][direction] -> (w_ih, w_hh, b_ih, b_hh, w_hr)."""
    per = 2 + (2 if has_biases else 0) + (1 if proj else 0)
    dirs = 2 if bidirectional else 1
    out = []
    for layer in range(num_layers):
        row = []
        for d in range(dirs):
            p = list(params[(layer * dirs + d) * per:(layer * dirs + d + 1) * per])
            w_ih, w_hh = p[0], p[1]
            b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
            w_hr = p[-1] if proj else None
            row.append((w_ih, w_hh, b_ih, b_hh, w_hr))
        out.append(row)
    return out


def _cell(mode, gates_x, h, c, w_hh, b_hh, w_hr):
    """One time step given the precomputed input projection ``gates_x`` (bias b_ih included)."""
    gh = _matmul_t(h, w_hh)
    if b_hh is not None:
        gh = gh + b_hh
    if mode == "lstm":
        i, f, g, o = jnp.split(gates_x + gh, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        if w_hr is not None:
            h = _matmul_t(h, w_hr)
        return h, c
    if mode == "gru":
        xr, xz, xn = jnp.split(gates_x, 3, axis=-1)
        hr, hz, hn = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * hn)
        return (1 - z) * n + z * h, c
    pre = gates_x + gh
    return (jnp.tanh(pre) if mode == "rnn_tanh" else jnp.maximum(pre, 0)), c


def _direction(mode, x, h0, c0, weights, reverse):
    """Run one direction of one layer over time-major x (T, B, F)."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    gates_x = _matmul_t(x, w_ih)
    if b_ih is not None:
        gates_x = gates_x + b_ih

    def step(carry, gx):
        h, c = carry
        h, c = _cell(mode, gx, h, c, w_hh, b_hh, w_hr)
        return (h, c), h

    (h, c), ys = lax.scan(step, (h0, c0), gates_x, reverse=reverse)
    return ys, h, c


def rnn_stack(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
              key=None):
    """(output, h_n, c_n) of a whole multi-layer (bi)directional RNN; c_n is None except for LSTM."""
    dtype = input.dtype
    compute = compute_dtype(dtype)
    unbatched = input.ndim == 2
    x = input[:, None] if unbatched else (jnp.swapaxes(input, 0, 1) if batch_first else input)
    x = x.astype(compute)
    h0 = hx[0].astype(compute)
    c0 = hx[1].astype(compute) if mode == "lstm" else None
    if unbatched:
        h0 = h0[:, None]
        c0 = c0[:, None] if c0 is not None else None
    # Projections as ATen tells them: h is proj_size wide, c hidden_size (counting parameters cannot:
    # 4 directions x 5 tensors is a multiple of 4).
    proj = mode == "lstm" and hx[0].shape[-1] != hx[1].shape[-1]
    layers = _layer_params([p.astype(compute) for p in params], has_biases, num_layers, bidirectional, proj)
    dirs = 2 if bidirectional else 1
    hs, cs = [], []
    for li, row in enumerate(layers):
        outs = []
        for d, weights in enumerate(row):
            k = li * dirs + d
            c_init = c0[k] if c0 is not None else jnp.zeros((), compute)
            ys, h, c = _direction(mode, x, h0[k], c_init, weights, reverse=(d == 1))
            outs.append(ys)
            hs.append(h)
            cs.append(c)
        x = jnp.concatenate(outs, axis=-1) if dirs == 2 else outs[0]
        if dropout > 0 and train and li < num_layers - 1:
            keep = jax.random.bernoulli(jax.random.fold_in(key, li), 1.0 - dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - dropout), 0).astype(compute)
    out = x[:, 0] if unbatched else (jnp.swapaxes(x, 0, 1) if batch_first else x)
    h_n = jnp.stack(hs)
    c_n = jnp.stack(cs) if mode == "lstm" else None
    if unbatched:
        h_n = h_n[:, 0]
        c_n = c_n[:, 0] if c_n is not None else None
    cast = (lambda a: a.astype(dtype)) if compute != dtype else (lambda a: a)
    return cast(out), cast(h_n), (cast(c_n) if c_n is not None else None)


# -- ATen forms (used by torch.compile graphs; eager goes through eager/rnn.py) --------------------
@lowering("lstm.input", random=True, graph_only=True, precision=RNN)
def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, *, key):
    return rnn_stack("lstm", input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first, key)


def _single_hidden(mode):
    def fn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, *, key):
        out, h, _ = rnn_stack(mode, input, [hx], params, has_biases, num_layers, dropout, train,
                              bidirectional, batch_first, key)
        return out, h
    fn.__name__ = mode
    return fn


for _mode in ("gru", "rnn_tanh", "rnn_relu"):
    lowering(f"{_mode}.input", random=True, graph_only=True, precision=RNN)(_single_hidden(_mode))


# -- the fused forward and backward (eager mode's torchneuron::rnn / rnn_backward, see eager/rnn.py)
def _key_from(key_data):
    return jax.random.wrap_key_data(key_data.astype(jnp.uint32))


def rnn_fused(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, *,
              key):
    """[output, h_n, (c_n,) key_data]: the key replays the same dropout masks in the backward."""
    out, h, c = rnn_stack(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                          batch_first, key)
    outs = [out, h] + ([c] if c is not None else [])
    return outs + [jax.random.key_data(key)]


def rnn_fused_backward(grads, key_data, mode, input, hx, params, has_biases, num_layers, dropout, train,
                       bidirectional, batch_first):
    """Gradients w.r.t. [input, *hx, *params] (the VJP of rnn_stack with the forward's key)."""
    key = _key_from(key_data)

    def f(x, h, p):
        out, hn, cn = rnn_stack(mode, x, h, p, has_biases, num_layers, dropout, train, bidirectional,
                                batch_first, key)
        return (out, hn, cn) if cn is not None else (out, hn)

    primal, vjp = jax.vjp(f, input, list(hx), list(params))
    cots = tuple(g.astype(p.dtype) for g, p in zip(grads, primal))
    gx, gh, gp = vjp(cots)
    return [gx, *gh, *gp]


# -- single cells: ATen's fused pointwise kernels ---------------------------------------------------
# nn.LSTMCell / nn.GRUCell (and packed-sequence RNNs, which ATen runs cell by cell) call these on
# CUDA, XPU and PrivateUse1 devices: the gate matmuls happen outside, the cell's pointwise part here.
# The workspace holds what the backward needs, laid out as ATen's kernels lay it out.
def _gate_sum(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    return gates


@lowering("_thnn_fused_lstm_cell.default", shape_from_lowering=True)   # the meta kernel fails without biases
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    i, f, g, o = jnp.split(_gate_sum(input_gates, hidden_gates, input_bias, hidden_bias), 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=1)


@lowering("_thnn_fused_lstm_cell_backward_impl.default")
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + (0 if grad_cy is None else grad_cy)
    grad_gates = jnp.concatenate([grad_c * g * (1 - i) * i, grad_c * cx * (1 - f) * f,
                                  grad_c * i * (1 - g * g), grad_hy * tanh_cy * (1 - o) * o], axis=1)
    return grad_gates, grad_c * f, jnp.sum(grad_gates, axis=0) if has_bias else None


@lowering("_thnn_fused_gru_cell.default", shape_from_lowering=True)   # no meta kernel
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, in_ = jnp.split(input_gates, 3, axis=1)
    hr, hz, hn = jnp.split(hidden_gates, 3, axis=1)
    r, z = jax.nn.sigmoid(ir + hr), jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(in_ + r * hn)
    return n + z * (hx - n), jnp.concatenate([r, z, n, hx, hn], axis=1)


@lowering("_thnn_fused_gru_cell_backward.default", shape_from_lowering=True)   # no meta kernel
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * (1 - r) * r
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    biases = (jnp.sum(grad_input, axis=0), jnp.sum(grad_hidden, axis=0)) if has_bias else (None, None)
    return grad_input, grad_hidden, grad_hy * z, *biases
