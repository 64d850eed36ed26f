"""Fused nn.LSTM / nn.GRU / nn.RNN on neuron: one executable forward, one backward, no CPU fallback,
and the same outputs and gradients as CPU."""

from __future__ import annotations

import pytest
import torch

import torchneuron

CONFIGS = [
    (torch.nn.LSTM, dict()),
    (torch.nn.LSTM, dict(num_layers=2, bidirectional=True, batch_first=True)),
    (torch.nn.LSTM, dict(num_layers=3, bias=False)),
    (torch.nn.LSTM, dict(proj_size=3, bidirectional=True)),
    (torch.nn.LSTM, dict(proj_size=2, num_layers=2, bidirectional=True)),   # 20 parameters: 4 * 5
    (torch.nn.GRU, dict()),
    (torch.nn.GRU, dict(num_layers=2, bidirectional=True, batch_first=True)),
    (torch.nn.RNN, dict(nonlinearity="tanh", num_layers=2)),
    (torch.nn.RNN, dict(nonlinearity="relu", bidirectional=True)),
]


def _loss(out, h):
    hs = h if isinstance(h, tuple) else (h,)
    return out.pow(2).sum() + sum(t.sum() for t in hs)


def _run(cls, kw, x, h0, device):
    torch.manual_seed(0)
    m = cls(5, 7, **kw).to(device)
    xd = x.detach().to(device).requires_grad_()
    hd = None
    if h0 is not None:
        hd = tuple(t.detach().to(device).requires_grad_() for t in h0) if isinstance(h0, tuple) else \
            h0.detach().to(device).requires_grad_()
    out, h = m(xd, hd) if hd is not None else m(xd)
    _loss(out, h).backward()
    grads = [p.grad.cpu() for p in m.parameters()]
    hgrads = [] if hd is None else [t.grad.cpu() for t in (hd if isinstance(hd, tuple) else (hd,))]
    return out.detach().cpu(), h, xd.grad.cpu(), grads, hgrads


@pytest.mark.parametrize("cls,kw", CONFIGS, ids=lambda v: v.__name__ if isinstance(v, type) else
                         ",".join(f"{k}={w}" for k, w in v.items()) or "default")
def test_rnn_matches_cpu_without_fallback(cls, kw, strict_fallback):
    torch.manual_seed(1)
    batch_first = kw.get("batch_first", False)
    x = torch.randn((3, 6, 5) if batch_first else (6, 3, 5))
    out_c, h_c, gx_c, gp_c, _ = _run(cls, kw, x, None, "cpu")
    torchneuron.metrics.reset()
    out_n, h_n, gx_n, gp_n, _ = _run(cls, kw, x, None, "neuron")
    calls = torchneuron.metrics.op_calls
    # One fused forward and one fused backward, not a per-time-step decomposition.
    assert calls["rnn"] == 1 and calls["rnn_backward"] == 1, dict(calls)
    assert not torchneuron.metrics.fallbacks
    torch.testing.assert_close(out_n, out_c, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx_n, gx_c, atol=1e-5, rtol=1e-4)
    for a, b in zip(gp_n, gp_c):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lstm_initial_state_gradients(strict_fallback):
    torch.manual_seed(2)
    x = torch.randn(4, 2, 5)
    h0 = (torch.randn(2, 2, 7), torch.randn(2, 2, 7))
    kw = dict(num_layers=2)
    out_c, _, gx_c, _, gh_c = _run(torch.nn.LSTM, kw, x, h0, "cpu")
    out_n, _, gx_n, _, gh_n = _run(torch.nn.LSTM, kw, x, h0, "neuron")
    torch.testing.assert_close(out_n, out_c, atol=1e-5, rtol=1e-4)
    for a, b in zip(gh_n, gh_c):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_unbatched_gru(strict_fallback):
    torch.manual_seed(3)
    x = torch.randn(6, 5)
    out_c, _, gx_c, _, _ = _run(torch.nn.GRU, dict(num_layers=2), x, None, "cpu")
    out_n, _, gx_n, _, _ = _run(torch.nn.GRU, dict(num_layers=2), x, None, "neuron")
    torch.testing.assert_close(out_n, out_c, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx_n, gx_c, atol=1e-5, rtol=1e-4)


def test_dropout_between_layers_is_reproducible_and_consistent(strict_fallback):
    """Inter-layer dropout: same seed, same result; the backward replays the forward's masks."""
    x = torch.randn(5, 2, 4, device="neuron")

    def run():
        torch.manual_seed(7)
        m = torch.nn.LSTM(4, 6, num_layers=2, dropout=0.5).to("neuron").train()
        xi = x.clone().requires_grad_()
        out, _ = m(xi)
        out.sum().backward()
        return out.detach().cpu(), xi.grad.cpu(), [p.grad.cpu() for p in m.parameters()]

    a, b = run(), run()
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)
    # Eval mode ignores dropout and matches CPU.
    torch.manual_seed(7)
    m = torch.nn.LSTM(4, 6, num_layers=2, dropout=0.5).eval()
    ref, _ = m(x.cpu())
    out, _ = m.to("neuron")(x)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-4)


def test_inference_mode(strict_fallback):
    torch.manual_seed(4)
    m = torch.nn.GRU(5, 7)
    x = torch.randn(3, 2, 5)
    ref, _ = m(x)
    with torch.inference_mode():
        out, _ = m.to("neuron")(x.to("neuron"))
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=1e-5, rtol=1e-4)


# nn.LSTMCell / nn.GRUCell and packed-sequence RNNs reach ATen's fused cell kernels
# (_thnn_fused_lstm_cell, _thnn_fused_gru_cell) on PrivateUse1 devices; they had no lowering and
# failed ("Could not run 'aten::_thnn_fused_lstm_cell' with arguments from the 'CPU' backend").
@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell])
@pytest.mark.parametrize("bias", [True, False])
def test_cells_match_cpu_forward_and_backward(cell, bias):
    torch.manual_seed(0)
    ref = cell(4, 3, bias=bias)
    dev = cell(4, 3, bias=bias).to("neuron")
    dev.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, requires_grad=True)
    xd = x.detach().to("neuron").requires_grad_()
    h = (torch.randn(2, 3), torch.randn(2, 3)) if cell is torch.nn.LSTMCell else torch.randn(2, 3)
    hd = tuple(t.to("neuron") for t in h) if isinstance(h, tuple) else h.to("neuron")
    outs, outs_d = ref(x, h), dev(xd, hd)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs_d = outs_d if isinstance(outs_d, tuple) else (outs_d,)
    sum(o.pow(2).sum() * (k + 1) for k, o in enumerate(outs)).backward()
    sum(o.pow(2).sum() * (k + 1) for k, o in enumerate(outs_d)).backward()
    for a, b in zip(outs, outs_d):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xd.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)
    for p, q in zip(ref.parameters(), dev.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [torch.nn.LSTM, torch.nn.GRU])
def test_packed_sequences_match_cpu(mode):
    torch.manual_seed(0)
    ref = mode(4, 3)
    dev = mode(4, 3).to("neuron")
    dev.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, 4)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, [5, 3])
    packed_d = torch.nn.utils.rnn.pack_padded_sequence(x.to("neuron"), [5, 3])
    torch.testing.assert_close(dev(packed_d)[0].data.cpu(), ref(packed)[0].data, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls,kw", [(torch.nn.GRU, dict()), (torch.nn.LSTM, dict(num_layers=2)),
                                    (torch.nn.LSTM, dict(proj_size=2, bidirectional=True))],
                         ids=["GRU", "LSTM-2-layers", "LSTM-proj-bidirectional"])
def test_double_backward_matches_cpu(cls, kw, strict_fallback):
    # create_graph=True: the gradient is itself differentiated (gradgradcheck, gradient penalties).
    # The fused backward has no derivative; it used to give silently zero second derivatives.
    results = []
    for device in ("cpu", "neuron"):
        torch.manual_seed(0)
        m = cls(4, 5, **kw).to(device)
        x = torch.linspace(-1, 1, 2 * 3 * 4).reshape(2, 3, 4).to(device).requires_grad_()
        out, _ = m(x)
        gx, = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        results.append((gx.detach().cpu(), x.grad.cpu(), [p.grad.cpu() for p in m.parameters()]))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-4)


def test_double_backward_with_training_dropout_raises():
    m = torch.nn.GRU(4, 5, num_layers=2, dropout=0.5).to("neuron")
    x = torch.ones(2, 3, 4, device="neuron", requires_grad=True)
    out, _ = m(x)
    with pytest.raises(RuntimeError, match="double backward .* dropout"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
