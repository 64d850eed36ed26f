"""config.shapes="bucketed": symbolic torch.compile graphs compiled once per shape bucket.

Two halves: the masking rules (``ops/dynamic.py``) run on padded arrays whose pad holds NaN, Inf
and garbage, and their exact region is compared with CPU PyTorch on the unpadded tensors; then
whole compiled programs (a GPT-style model's inference and training) against CPU, with the number
of compiled graphs pinned to the number of buckets.
"""

from __future__ import annotations

import copy
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from torchneuron.ops import dynamic as dyn
from torchneuron.runtime import memory


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def bucketed(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "shapes", "bucketed")
    monkeypatch.setattr(torchneuron.config, "shape_buckets", "pow2")


# -- the rules on padded arrays --------------------------------------------------------------------
_GARBAGE = (np.nan, np.inf, -np.inf, 1e30)


def padded(t: torch.Tensor, sizes, seed=0):
    """``t`` (CPU) padded to ``sizes`` with NaN/Inf/huge values in the pad."""
    rng = np.random.default_rng(seed)
    out = rng.choice(_GARBAGE, size=sizes).astype(np.float32)
    out[tuple(slice(0, s) for s in t.shape)] = t.numpy()
    return jnp.asarray(out)


def exact(value, shape):
    return torch.from_numpy(np.asarray(value)[tuple(slice(0, s) for s in shape)].copy())


def test_masked_reductions_ignore_the_pad():
    x = torch.randn(3, 5, 4)
    xp = padded(x, (3, 8, 4))
    lens = (None, 5, None)
    s = jnp.sum(dyn.masked(xp, lens, 0), axis=1)
    torch.testing.assert_close(exact(s, (3, 4)), x.sum(1))
    mean = dyn.rescale_mean(jnp.mean(dyn.masked(xp, lens, 0), axis=1), xp.shape, lens, (1,))
    torch.testing.assert_close(exact(mean, (3, 4)), x.mean(1))
    mx = jnp.max(dyn.masked(xp, lens, dyn.identity("max", xp.dtype)), axis=1)
    torch.testing.assert_close(exact(mx, (3, 4)), x.amax(1))
    arg = jnp.argmin(dyn.masked(xp, lens, dyn.identity("argmin", xp.dtype)), axis=1)
    assert torch.equal(exact(arg, (3, 4)).long(), x.argmin(1))
    v = dyn.var(xp, lens, (1,), 1, keepdim=False)
    torch.testing.assert_close(exact(v, (3, 4)), x.var(1))


def test_masked_softmax_over_a_padded_dim():
    x = torch.randn(2, 6, 6)
    x = x.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    xp = padded(x, (2, 8, 8))
    lens = (None, 6, 6)
    for log in (False, True):
        out = dyn.softmax(xp, lens, 2, log)
        ref = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
        torch.testing.assert_close(exact(out, (2, 6, 6)), ref)
        assert np.isfinite(np.asarray(out)[:, :6, :6][~np.isinf(ref.numpy())]).all()


def test_contraction_over_a_padded_dim_masks_both_operands():
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    ap, bp = padded(a, (4, 8)), padded(b, (8, 3), seed=1)
    am, bm = dyn.matmul_operands(ap, (None, 5), 1, bp, (5, None), 0)
    out = am @ bm
    assert np.isfinite(np.asarray(out)).all()
    torch.testing.assert_close(exact(out, (4, 3)), a @ b)
    # Masking one operand only leaks: 0 * inf is NaN.
    assert not np.isfinite(np.asarray(dyn.masked(ap, (None, 5), 0) @ bp)).all()


def test_cat_along_a_padded_dim_places_pieces_at_true_offsets():
    a, b, c = torch.randn(2, 3), torch.randn(2, 5), torch.randn(2, 4)
    pieces = [padded(a, (2, 4)), padded(b, (2, 8), 1), padded(c, (2, 4), 2)]
    lens = [(None, 3), (None, 5), (None, 4)]
    out = dyn.cat(pieces, lens, 1, 16)
    torch.testing.assert_close(exact(out, (2, 12)), torch.cat([a, b, c], 1))


def test_reshape_across_padded_dims_and_back():
    x = torch.randn(3, 5, 4)
    xp = padded(x, (4, 8, 4))
    merged = dyn.reshape(xp, [3, 5, 4], [15, 4], (32, 4))
    torch.testing.assert_close(exact(merged, (15, 4)), x.reshape(15, 4))
    back = dyn.reshape(merged, [15, 4], [3, 5, 4], (4, 8, 4))
    torch.testing.assert_close(exact(back, (3, 5, 4)), x)


def test_a_merged_dim_masks_through_its_factors():
    # [3, 5] padded to [4, 8] and merged into one dim of 32: its exact elements are not a prefix.
    x = torch.randn(3, 5, 2)
    xp = padded(x, (4, 8, 2)).reshape(32, 2)
    lens = (dyn.Factors(((3, 4), (5, 8))), None)
    assert dyn.true_count(xp.shape, lens, (0,)) == 15
    s = jnp.sum(dyn.masked(xp, lens, 0), axis=0)
    torch.testing.assert_close(torch.from_numpy(np.array(s)), x.reshape(15, 2).sum(0))
    compact = dyn.reshape(xp.reshape(4, 8, 2), [3, 5, 2], [15, 2], (32, 2))
    torch.testing.assert_close(exact(compact, (15, 2)), x.reshape(15, 2))


def test_select_and_slice_count_from_the_true_end():
    x = torch.randn(2, 5, 3)
    xp = padded(x, (2, 8, 3))
    torch.testing.assert_close(exact(dyn.select(xp, 1, -1, jnp.int32(5)), (2, 3)), x[:, -1])
    torch.testing.assert_close(exact(dyn.select(xp, 1, jnp.int32(-2), jnp.int32(5)), (2, 3)), x[:, -2])
    s = dyn.slice_from(xp, 1, jnp.int32(5) - 2, 2)
    torch.testing.assert_close(exact(s, (2, 2, 3)), x[:, -2:])


def test_buckets_parse_and_refuse_a_size_above_the_largest():
    from torchneuron.compile.dynamic import bucket_for, parse_buckets
    assert [bucket_for(n, parse_buckets("pow2")) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket_for(5, parse_buckets("pow2:4")) == 8
    assert bucket_for(65, parse_buckets("64,96,128")) == 96
    with pytest.raises(ValueError, match="s0 has size 200.*largest shape bucket 128.*shape_buckets"):
        bucket_for(200, parse_buckets("64,128"), "the dynamic dim s0")
    with pytest.raises(ValueError, match="TORCHNEURON_SHAPE_BUCKETS"):
        torchneuron.config.shape_buckets = "128,64"
    with pytest.raises(ValueError, match="TORCHNEURON_SHAPES"):
        torchneuron.config.shapes = "dynamic"
    from torchneuron.config import Config
    cfg = Config.from_env({"TORCHNEURON_SHAPES": "Bucketed", "TORCHNEURON_SHAPE_BUCKETS": "32, 64"})
    assert (cfg.shapes, cfg.shape_buckets) == ("bucketed", "32,64")
    assert Config().shapes == "static"


# -- whole programs --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d, heads, sdpa):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.sdpa = heads, sdpa

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
            y = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Embedding + positions from arange, causal attention, LayerNorm, GELU MLP, tied head."""

    def __init__(self, vocab=50, d=32, heads=2, layers=1, sdpa=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(128, d)
        self.blocks = nn.ModuleList([Block(d, heads, sdpa) for _ in range(layers)])
        self.lnf = nn.LayerNorm(d)

    def forward(self, ids, targets=None):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


LENGTHS = (7, 13, 29, 30, 61, 100)   # buckets 16, 16, 32, 32, 64, 128


def _twin(**kw):
    torch.manual_seed(0)
    cpu = TinyGPT(**kw)
    dev = copy.deepcopy(cpu).to("neuron")
    return cpu, dev


def _counts():
    extra = torchneuron.metrics()["extra"]
    return extra.get("bucketed_graph_compiles", 0), extra.get("bucketed_fallbacks", 0)


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul_softmax", "sdpa_causal"])
def test_gpt_inference_compiles_once_per_bucket(bucketed, sdpa):
    cpu, dev = _twin(sdpa=sdpa)
    cpu.eval()
    dev.eval()
    f = torch.compile(dev, backend="neuron", dynamic=True)
    torchneuron.metrics.reset()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in LENGTHS:
            ids = torch.randint(0, 50, (2, t), generator=gen)
            out = f(ids.to("neuron"))
            assert out.shape == (2, t, 50)
            torch.testing.assert_close(out.cpu(), cpu(ids), rtol=1e-4, atol=1e-5)
            if t != LENGTHS[0]:
                # The batch of 2 is symbolic too (dynamic=True) but never varies: it is not padded.
                bucket = 16 if t <= 16 else 1 << (t - 1).bit_length()
                # The buffer has the bucket's capacity; PyTorch's storage is the true one, as on CPU.
                assert memory.record_of(out).nbytes == 2 * bucket * 50 * 4
                assert out.untyped_storage().nbytes() == 2 * t * 50 * 4
    graphs, fallbacks = _counts()
    assert fallbacks == 0
    # dynamic=True: the first call compiles its exact sizes; the length, once it varies, its buckets.
    assert graphs == 1 + 4
    assert torchneuron.metrics()["graphs_compiled"] == 1 + 4


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul_softmax", "sdpa_causal"])
def test_gpt_training_steps_match_cpu_with_one_graph_pair_per_bucket(bucketed, sdpa):
    cpu, dev = _twin(layers=1 if sdpa else 2, sdpa=sdpa)
    f = torch.compile(dev, backend="neuron", dynamic=True)
    # SGD: Adam's normalisation would turn the rounding noise of gradients that are zero in exact
    # arithmetic (the key bias) into full-size updates on both devices alike.
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    torchneuron.metrics.reset()
    gen = torch.Generator().manual_seed(2)
    for t in (*LENGTHS, 9):
        ids, tgt = torch.randint(0, 50, (2, t), generator=gen), torch.randint(0, 50, (2, t), generator=gen)
        loss_c = cpu(ids, tgt)
        loss_c.backward()
        loss_d = f(ids.to("neuron"), tgt.to("neuron"))
        loss_d.backward()
        torch.testing.assert_close(loss_d.cpu(), loss_c, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5, msg=name)
        opt_c.step()
        opt_d.step()
        opt_c.zero_grad()
        opt_d.zero_grad()
    for p, q in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-4)
    graphs, fallbacks = _counts()
    assert fallbacks == 0
    assert graphs == 2 * (1 + 4)    # a forward and a backward graph: the first sizes, then per bucket
    recompiles = torchneuron.metrics()["recompiles"]
    assert recompiles["forward graph: a new shape bucket (config.shapes='bucketed')"] == 4


def test_masked_ops_on_the_dynamic_dim_match_cpu(bucketed):
    def f(x, y):
        # Inputs are padded with zeros: make the pad of what the ops see non-zero.
        x, y = x * 1.5 + 1, y - 2
        s = torch.softmax(x, 1)
        red = (x.sum(1) + x.mean(1) + x.amax(1) - x.amin(1) + x.var(1) + torch.logsumexp(x, 1)
               + x.argmax(1).float() + x.prod(1).clamp(-1, 1) + (x > 0).any(1).float()
               + (x > -5).all(1).float())
        cat = torch.cat([x, y], 1)
        last = x[:, -1] + cat[:, -1] + x[:, 1:].sum(1) + cat[:, 2:-1].sum(1)
        # Merged dynamic dims: positional ops (cumsum, select, argmax, cat) see them compacted.
        flat = x.reshape(-1).cumsum(0)[-1] + x.reshape(-1).argmax().float() \
            + torch.cat([x.reshape(-1), y.reshape(-1)])[-3:].sum()
        return s, red, cat * 2, last, flat + (x @ y.transpose(0, 1)).sum() + x.t().matmul(y).sum()

    g = torch.compile(f, backend="neuron", dynamic=True)
    gen = torch.Generator().manual_seed(3)
    torchneuron.metrics.reset()
    for rows, t in ((3, 5), (4, 9), (3, 12), (5, 20)):
        x, y = torch.randn(rows, t, generator=gen), torch.randn(rows, t, generator=gen)
        for a, b in zip(g(x.to("neuron"), y.to("neuron")), f(x, y)):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
    graphs, fallbacks = _counts()
    assert fallbacks == 0
    assert graphs == 1 + 2          # (3, 5) exactly, then t in bucket 16 (9, 12) and 32 (20)


def test_sort_and_topk_along_the_dynamic_dim(bucketed):
    def f(x):
        x = x * 2 + 1      # a non-zero pad
        v, i = torch.sort(x, 1)
        dv, di = torch.sort(x, 1, descending=True)
        tv, ti = torch.topk(x, 3, dim=1)
        sv, si = torch.topk(x, 2, dim=1, largest=False)
        return v, i, dv, di, tv, ti, sv, si

    g = torch.compile(f, backend="neuron", dynamic=True)
    gen = torch.Generator().manual_seed(5)
    torchneuron.metrics.reset()
    for t in (5, 9, 13):
        x = torch.randn(3, t, generator=gen)
        x[0, 1] = float("nan")       # PyTorch sorts NaN last ascending, first descending
        x[1, 2] = float("-inf")
        for a, b in zip(g(x.to("neuron")), f(x)):
            torch.testing.assert_close(a.cpu(), b, equal_nan=True)
    assert _counts() == (1 + 1, 0)   # t=5 exactly, then bucket 16


def test_an_op_without_a_rule_compiles_per_shape_and_says_which(bucketed):
    def f(x):
        return x * 2 + torch.randperm(x.shape[1], device=x.device).float().sum() * 0

    g = torch.compile(f, backend="neuron", dynamic=True)
    torchneuron.metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (5, 6, 7):
            x = torch.randn(3, t)
            torch.testing.assert_close(g(x.to("neuron")).cpu(), f(x))
    assert any("randperm.default has no dynamic-shape rule" in str(w.message) for w in caught)
    m = torchneuron.metrics()
    assert m["extra"]["bucketed_fallbacks"] == 1
    assert any(k.startswith("bucketed_fallback: randperm.default") for k in m["extra"])
    assert m["recompiles"]["new input shapes (a bucketed graph without dynamic rules)"] == 2


def test_listed_buckets_per_compile_and_the_error_above_the_largest(bucketed):
    def f(x):
        return torch.softmax(x, -1).sum(-1)

    g = torch.compile(f, backend="neuron", dynamic=True, options={"buckets": [8, 24]})
    torchneuron.metrics.reset()
    for t in (3, 8, 9, 24):
        x = torch.randn(2, t)
        torch.testing.assert_close(g(x.to("neuron")).cpu(), f(x))
    assert _counts() == (1 + 2, 0)   # t=3 exactly, then buckets 8 and 24
    with pytest.raises(ValueError, match="above the largest shape bucket 24"):
        g(torch.randn(2, 30).to("neuron"))


def test_static_setting_and_static_graphs_are_unchanged(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "shapes", "static")

    def f(x):
        return x.softmax(-1)

    g = torch.compile(f, backend="neuron", dynamic=True)
    with pytest.warns(UserWarning, match="static shapes"):
        g(torch.randn(2, 5).to("neuron"))
    g(torch.randn(2, 6).to("neuron"))
    assert _counts() == (0, 0)
    monkeypatch.setattr(torchneuron.config, "shapes", "bucketed")
    torch._dynamo.reset()
    h = torch.compile(f, backend="neuron", dynamic=False)
    torchneuron.metrics.reset()
    for t in (5, 6):
        x = torch.randn(2, t)
        torch.testing.assert_close(h(x.to("neuron")).cpu(), f(x))
    assert _counts() == (0, 0)


def test_sizes_as_numbers_and_outputs_that_view_inputs(bucketed):
    def f(x):
        return x[:, 1:], x.t(), x[:, 1:] * x.shape[1] - x.shape[0], torch.arange(x.shape[1], device=x.device) * 1.0

    g = torch.compile(f, backend="neuron", dynamic=True)
    for t in (5, 9, 17):
        x = torch.randn(3, t)
        xn = x.to("neuron")
        outs = g(xn)
        for a, b in zip(outs, f(x)):
            assert a.shape == b.shape and a.stride() == b.stride()
            torch.testing.assert_close(a.cpu(), b)
        # Views of the input come back as real aliases of it, as with static graphs.
        assert outs[0].untyped_storage().data_ptr() == xn.untyped_storage().data_ptr()
        assert outs[0].storage_offset() == 1
    assert _counts() == (1 + 2, 0)   # t=5 exactly, then buckets 16 and 32


def test_mark_dynamic_and_automatic_dynamic_graphs_are_bucketed(bucketed):
    cpu, dev = _twin()
    cpu.eval()
    dev.eval()
    f = torch.compile(dev, backend="neuron")          # dynamic=None: automatic dynamic shapes
    torchneuron.metrics.reset()
    with torch.no_grad():
        for t in (5, 6, 9, 12, 20):
            ids = torch.randint(0, 50, (2, t))
            torch.testing.assert_close(f(ids.to("neuron")).cpu(), cpu(ids), rtol=1e-4, atol=1e-5)
    # 5: a static graph; from 6 on Dynamo traces the length symbolically: buckets 16 and 32.
    assert _counts() == (2, 0)
    assert torchneuron.metrics()["graphs_compiled"] == 3
    torch._dynamo.reset()
    g = torch.compile(dev, backend="neuron")
    torchneuron.metrics.reset()
    with torch.no_grad():
        for t in (3, 7, 17):
            ids = torch.randint(0, 50, (2, t))
            dyn_ids = ids.to("neuron")
            torch._dynamo.mark_dynamic(dyn_ids, 1)
            torch.testing.assert_close(g(dyn_ids).cpu(), cpu(ids), rtol=1e-4, atol=1e-5)
    assert _counts() == (2, 0)


def test_dropout_in_a_bucketed_training_graph(bucketed):
    def f(x, w):
        return (F.dropout(x @ w, p=0.5, training=True) ** 2).sum(1)

    g = torch.compile(f, backend="neuron", dynamic=True)
    w = torch.randn(6, 6, requires_grad=True)
    torchneuron.metrics.reset()
    for t in (5, 9, 12):
        x = torch.randn(t, 6)
        wn = w.detach().to("neuron").requires_grad_()
        torch.manual_seed(7)
        out = g(x.to("neuron"), wn)
        out.sum().backward()
        torch.manual_seed(7)
        again = g(x.to("neuron"), wn)
        # Reproducible under the seed; about half the units dropped, the rest scaled by 2.
        torch.testing.assert_close(again, out)
        y = (x @ w.detach()).pow(2).sum(1)
        assert (out.cpu() <= 4 * y * (1 + 1e-4) + 1e-5).all()
        assert wn.grad is not None and torch.isfinite(wn.grad.cpu()).all()
    assert _counts() == (2 * 2, 0)   # forward and backward graphs: t=5 exactly, then bucket 16


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_causal_lm_forward_is_bucketed(bucketed, arch):
    transformers = pytest.importorskip("transformers")
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                       max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    cpu = cls(cfg).eval()
    dev = cls(cfg).eval()
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("neuron")
    f = torch.compile(dev, backend="neuron", dynamic=True)
    torchneuron.metrics.reset()
    with torch.no_grad():
        for t in (7, 13, 29):
            ids = torch.randint(0, 100, (2, t))
            out = f(input_ids=ids.to("neuron"), use_cache=False).logits
            torch.testing.assert_close(out.cpu(), cpu(input_ids=ids, use_cache=False).logits,
                                       rtol=1e-4, atol=1e-5)
    assert _counts() == (1 + 2, 0)   # t=7 exactly, then buckets 16 and 32


def test_box_reads_and_writes_of_views_with_row_major_tails(bucketed):
    # Rows of static trailing dims move whole (ops/dynamic.py box_read/box_write with a tail);
    # views whose tail is not row-major, offsets and transposed results take the element-wise path.
    def f(x, y, z):
        return x * 2, (x + y).transpose(0, 1), z.sum(-1), (z * 1).transpose(1, 2).contiguous()

    g = torch.compile(f, backend="neuron")
    gen = torch.Generator().manual_seed(11)
    torchneuron.metrics.reset()
    for t in (5, 7, 11, 21):     # the storage of `big` stays within the box's capacity
        big = torch.randn(3, t, 10, generator=gen)
        x = big[:, :, 1:9]                              # an offset view: only its last dim row-major
        y = torch.randn(3, t, 8, generator=gen)
        z = torch.randn(3, 8, t, generator=gen).transpose(1, 2)     # a tail that is not row-major
        bign, yn = big.to("neuron"), y.to("neuron")
        zn = z.transpose(1, 2).contiguous().to("neuron").transpose(1, 2)
        xn = bign[:, :, 1:9]
        for v in (xn, yn, zn):
            torch._dynamo.mark_dynamic(v, 1)
        for a, b in zip(g(xn, yn, zn), f(x, y, z)):
            assert a.shape == b.shape and a.stride() == b.stride()
            torch.testing.assert_close(a.cpu(), b)
    graphs, fallbacks = _counts()
    assert fallbacks == 0
    assert graphs == 2                  # mark_dynamic: buckets 16 and 32 from the start


def test_float64_results_follow_the_float64_policy(bucketed):
    # TORCHNEURON_FLOAT64=downcast (the default): a float64 result is float32 on the device, as in
    # static graphs, so autograd sees the dtype it expects.
    def f(x):
        return (x.double() * 2).softmax(-1)

    g = torch.compile(f, backend="neuron", dynamic=True)
    for t in (5, 9, 13):
        x = torch.randn(3, t, requires_grad=True)
        xn = x.detach().to("neuron").requires_grad_()
        out = g(xn)
        assert out.dtype == torch.float32
        out.sum().backward()
        torch.testing.assert_close(out.detach().cpu(), f(x).float(), rtol=1e-5, atol=1e-6)
        assert xn.grad.dtype == torch.float32


def test_adaptive_eager_with_bucketed_shapes_says_it_compiles_per_shape(bucketed, monkeypatch):
    """Adaptive eager records exact executables: with config.shapes='bucketed' a new shape still
    compiles its ops. That is counted and warned about, never silent; results stay CPU's."""
    import torchneuron.eager.kernel as kernel
    monkeypatch.setattr(kernel, "_warned_adaptive", [])
    kernel.clear_cache()
    torchneuron.metrics.reset()
    with torchneuron.eager_mode("adaptive"), pytest.warns(UserWarning, match="does not apply to adaptive eager"):
        for t in (5, 9, 13):
            x = torch.randn(2, t)
            got = (x.to("neuron") * 2 + 1).sum(1).cpu()
            torch.testing.assert_close(got, (x * 2 + 1).sum(1))
    extra = torchneuron.metrics()["extra"]
    assert extra["bucketed_eager_fallback: adaptive eager (recorded regions compile per shape)"] >= 3
