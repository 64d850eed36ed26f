"""Eager mode with bucketed shapes (config.shapes="bucketed", compile/eager_buckets.py): an op whose
sizes vary compiles once per shape bucket, with results, sizes, strides and views as CPU's."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

import torchneuron
from torchneuron.eager import kernel
from torchneuron.runtime import memory

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_shapes_bucketed import TinyGPT  # noqa: E402


@pytest.fixture
def bucketed(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "")
    kernel.clear_cache()       # compile counts must not depend on which tests ran before
    torchneuron.config.shapes = "bucketed"
    torchneuron.metrics.reset()
    yield
    torchneuron.config.shapes = "static"


def _compiles():
    return sum(torchneuron.metrics()["eager_compiles"].values())


def _extra(name):
    return torchneuron.metrics()["extra"].get(name, 0)


def _ops(x, w, mask):
    h = torch.relu(x @ w) * 0.5 + x[..., :1]
    att = torch.softmax(h.masked_fill(mask, float("-inf")), dim=1)
    return att.sum(1), h.mean(1), h.var(1), torch.cumsum(h, 1), h.amax(1)


def test_new_lengths_in_a_seen_bucket_compile_nothing(bucketed):
    torch.manual_seed(0)
    w = torch.randn(6, 6)
    wd = w.to("neuron")

    def run(t):
        x = torch.randn(3, t, 6)
        mask = torch.rand(3, t, 1) > 0.7
        got = _ops(x.to("neuron"), wd, mask.to("neuron"))
        for g, want in zip(got, _ops(x, w, mask)):
            assert g.shape == want.shape and g.stride() == want.stride()
            torch.testing.assert_close(g.cpu(), want, rtol=1e-5, atol=1e-5, equal_nan=True)

    run(7)                    # exact executables, as always
    run(13)                   # sizes varied: one executable per op and bucket from now on
    for t in (5, 9):          # x @ w sees 3 * t rows: that size has buckets of its own
        run(t)
    before = _compiles()
    assert _extra("bucketed_eager_compiles") > 0
    for t in (6, 8, 10, 11, 12, 14, 15):   # more lengths in seen buckets: nothing compiles
        run(t)
    assert _compiles() == before
    run(29)                   # a new bucket: one compile per op whose sizes reach it
    per_bucket = _compiles() - before
    assert per_bucket > 0
    for t in (27, 31, 25):
        run(t)
    assert _compiles() - before == per_bucket
    assert _extra("bucketed_eager_fallbacks") == 0


def test_a_gpt_stream_compiles_a_quarter_of_what_static_compiles(bucketed):
    torch.manual_seed(0)
    cpu = TinyGPT(vocab=64, d=32, heads=2, layers=2).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    lengths = (7, 13, 29, 30, 61, 100, 37, 45, 19, 23, 55, 90, 11, 27, 41, 83, 71, 53, 9, 33)
    with torch.no_grad():
        for t in lengths:
            ids = torch.randint(0, 64, (2, t))
            torch.testing.assert_close(dev(ids.to("neuron")).cpu(), cpu(ids), rtol=1e-4, atol=1e-5)
    # Static compiles about 22 executables per new length here (one per op and shape): 440.
    compiles = _compiles()
    assert compiles <= 0.25 * 22 * len(lengths), torchneuron.metrics()["eager_compiles"]
    assert _extra("bucketed_eager_fallbacks") == 0


def test_training_with_varying_lengths_matches_cpu(bucketed):
    torch.manual_seed(0)
    cpu = TinyGPT(vocab=64, d=32, heads=2, layers=1)
    dev = copy.deepcopy(cpu).to("neuron")
    oc = torch.optim.SGD(cpu.parameters(), lr=0.1)
    od = torch.optim.SGD(dev.parameters(), lr=0.1)
    for t in (7, 13, 29, 30, 19):
        ids, tg = torch.randint(0, 64, (2, t)), torch.randint(0, 64, (2, t))
        lc = cpu(ids, tg)
        lc.backward()
        oc.step()
        oc.zero_grad()
        ld = dev(ids.to("neuron"), tg.to("neuron"))
        ld.backward()
        od.step()
        od.zero_grad()
        torch.testing.assert_close(ld.cpu(), lc, rtol=1e-4, atol=1e-5)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(pd.cpu(), pc, rtol=1e-4, atol=1e-5)
    assert _extra("bucketed_eager_compiles") > 0


def test_views_strides_and_in_place_updates_are_the_users(bucketed):
    for t in (7, 13, 21):
        a = torch.randn(2, t, 4)
        x = a.to("neuron")
        y = x * 2                       # bucketed from the second length on
        yt = y.transpose(1, 2)
        assert y.stride() == (a * 2).stride() and yt.stride() == (a * 2).transpose(1, 2).stride()
        part = y[:, 1:]
        part.add_(1.0)                  # in place on a view of a bucketed storage
        part.mul_(part)
        z = x.clone()
        z[:, :3].fill_(7.0)
        ref = a * 2
        ref[:, 1:].add_(1.0)
        ref[:, 1:].mul_(ref[:, 1:].clone())
        refz = a.clone()
        refz[:, :3].fill_(7.0)
        torch.testing.assert_close(y.cpu(), ref)
        torch.testing.assert_close(yt.contiguous().cpu(), ref.transpose(1, 2).contiguous())
        torch.testing.assert_close(z.cpu(), refz)
        m = torch.ones(t, t, dtype=torch.bool, device="neuron").triu(1)
        assert torch.equal(m.cpu(), torch.ones(t, t, dtype=torch.bool).triu(1))
        assert torch.equal(torch.arange(t, device="neuron").cpu(), torch.arange(t))
    assert _extra("bucketed_eager_compiles") > 0
    # The buffer of a bucketed result has its bucket's capacity; the tensor and PyTorch's storage
    # are the true ones, as on CPU.
    assert memory.record_of(y).nbytes >= y.numel() * y.element_size()
    assert y.untyped_storage().nbytes() == y.numel() * y.element_size()


def test_pad_never_leaks_into_reductions_or_softmax(bucketed):
    for t in (5, 11, 13):
        a = torch.randn(2, t) * 30 + 60          # exp overflows in float32 beyond ~88
        x = a.to("neuron")
        for fn in (lambda v: v.exp().sum(1), lambda v: v.mean(1), lambda v: torch.softmax(v, 1),
                   lambda v: torch.log_softmax(v, 1), lambda v: v.std(1), lambda v: v.argmax(1),
                   lambda v: v.sort(1).values, lambda v: torch.logsumexp(v, 1), lambda v: F.normalize(v, dim=0)):
            got, want = fn(x).cpu(), fn(a)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_switching_back_to_static_compiles_per_shape_again(bucketed):
    for t in (7, 9, 11, 13):   # one user line: its sizes vary from the second call on
        (torch.randn(3, t).to("neuron") + 1).cpu()
    assert _extra("bucketed_eager_compiles") == 1
    torchneuron.config.shapes = "static"
    for t in (7, 9, 11, 13, 15):
        (torch.randn(3, t).to("neuron") + 1).cpu()
    assert _extra("bucketed_eager_compiles") == 1
    assert torchneuron.metrics()["eager_compiles"]["new shape"] >= 1


def test_scalars_stay_runtime_values_of_a_bucketed_op(bucketed):
    # One line, one op and shape, three scalars: each call gets its own (a program with a scalar
    # compiled in would serve the others' calls with its value).
    for t in (5, 9, 11, 13, 17):
        a = torch.randn(1, t, 8)
        x = a.to("neuron")
        got = 0.5 * x * (1.0 + torch.tanh(0.79788 * (x + 0.044715 * torch.pow(x, 3.0))))
        want = 0.5 * a * (1.0 + torch.tanh(0.79788 * (a + 0.044715 * torch.pow(a, 3.0))))
        torch.testing.assert_close(got.cpu(), want)
        for c in (0, 1, 2):
            torch.testing.assert_close(x.var(1, correction=c).cpu(), a.var(1, correction=c))
    assert _extra("bucketed_eager_compiles") > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_with_the_default_cache_reuses_buckets(bucketed, family):
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=128)
    torch.manual_seed(0)
    cpu = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)

    def run(t):
        ids = torch.randint(3, 64, (1, t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            want = cpu.generate(ids, **gen)
            got = dev.generate(ids.to("neuron"), **gen)
        assert torch.equal(got.cpu(), want)

    for t in (5, 7, 9):        # prompts and key lengths 5..15: bucket 16
        run(t)
    before = _compiles()
    run(6)                     # a new prompt length, every key length already seen in its bucket
    run(8)
    assert _compiles() - before <= 4, torchneuron.metrics()["eager_compiles"]
    assert _extra("bucketed_eager_fallbacks") == 0


def test_elementwise_ops_on_storages_in_their_order(bucketed):
    # Elementwise ops over row-major views run on the storages as they are (no box read or
    # write): a view at an offset, a mask of the last sizes broadcast over the leading dims, a
    # static bias, a dtype change; a transposed view is read through its box.
    torch.manual_seed(0)
    bias = torch.randn(8)
    bn = bias.to("neuron")

    def ops(big, mask, t):
        x = big[1]                                      # [t, 8] at offset t * 8
        s = big.reshape(3, 1, t, 8) * 0.5               # [3, 1, t, 8] scores
        return (torch.nn.functional.gelu(x) + (bn if big.device.type == "neuron" else bias),
                s.masked_fill(mask, -1.0), (x > 0).to(torch.float16), big.transpose(0, 1).clone(),
                torch.where(mask, s, x))

    for t in (5, 9, 11, 13, 6):
        big = torch.randn(3, t, 8)
        mask = torch.rand(t, 8) > 0.5
        got = ops(big.to("neuron"), mask.to("neuron"), t)
        for g, want in zip(got, ops(big, mask, t)):
            assert g.shape == want.shape and g.stride() == want.stride() and g.dtype == want.dtype
            torch.testing.assert_close(g.cpu(), want)
    before = _compiles()
    for t in (7, 10, 12, 15):                           # bucket 16 again: nothing compiles
        big = torch.randn(3, t, 8)
        mask = torch.rand(t, 8) > 0.5
        for g, want in zip(ops(big.to("neuron"), mask.to("neuron"), t), ops(big, mask, t)):
            torch.testing.assert_close(g.cpu(), want)
    assert _compiles() == before
    assert _extra("bucketed_eager_fallbacks") == 0


def test_multi_head_attention_with_varying_lengths_matches_cpu(bucketed):
    """F.multi_head_attention_forward (unbatched, 2 heads of width 1, as the OpInfo sample the
    bucketed sweep runs eagerly after a graph break) at query/key lengths that vary at one line: its
    addmm/bmm/softmax run bucketed from the second length on, and the output and the averaged
    weights equal CPU's."""
    torch.manual_seed(0)
    e, heads = 2, 2
    weights = [torch.randn(3 * e, e), torch.randn(3 * e), torch.randn(e, e), torch.randn(e)]
    dev = [w.to("neuron") for w in weights]

    def run(q, k, v, w):
        return F.multi_head_attention_forward(q, k, v, e, heads, w[0], w[1], None, None, False, 0.0, w[2], w[3],
                                              training=False, need_weights=True)

    for q_len, k_len in [(3, 3), (3, 5), (7, 5), (9, 13), (3, 20), (17, 19)]:
        q, k, v = torch.randn(q_len, e), torch.randn(k_len, e), torch.randn(k_len, e)
        got = run(q.to("neuron"), k.to("neuron"), v.to("neuron"), dev)
        for g, want in zip(got, run(q, k, v, weights)):
            torch.testing.assert_close(g.cpu(), want, rtol=1e-5, atol=1e-5)
    assert _extra("bucketed_eager_compiles") > 0      # the later lengths ran bucketed


def test_an_op_refused_after_its_storages_grew_keeps_exact_keys(bucketed, monkeypatch):
    # A bucketed program that fails to build (NoRule) after the call's storages got a bucket's
    # capacity falls back to the exact executable: it reads the grown storages, so it must be keyed
    # by them. Keyed by the sizes before, a later fresh storage of the old size took it: jax
    # retraced it silently (an XLA compile no metric counted), or an executable loaded from the
    # disk cache refused the buffer ("Argument types differ from the types ... compiled").
    import jax.monitoring

    from torchneuron.compile import dynamic, eager_buckets

    def refuse(self, *args, **kwargs):
        raise dynamic.NoRule("aten.exp.default", "refused by the test")

    monkeypatch.setattr(eager_buckets._EagerProgram, "executable", refuse)
    xla_compiles = []

    def on_duration(event, _secs, **_kw):
        if event == "/jax/core/compile/backend_compile_duration":
            xla_compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)

    def line(x):   # one user line: its sizes vary, so the op is learnt dynamic here
        return torch.exp(x)

    try:
        for n in (5, 7, 9, 5, 7, 9, 6):
            cpu = torch.randn(n, 3)
            x = cpu.to("neuron")
            before = len(xla_compiles), _compiles()
            out = line(x)
            torch.testing.assert_close(out.cpu(), torch.exp(cpu))
            # every XLA compile of the op is an eager compile torchneuron counted
            assert len(xla_compiles) - before[0] <= _compiles() - before[1], n
    finally:
        from jax._src import monitoring
        monitoring.unregister_event_duration_listener(on_duration)


def test_bucketed_in_place_ops_update_their_storage_where_it_is(bucketed):
    # A bucketed executable that writes a storage donates its buffer, as exact ones do: a loop of
    # in-place updates on a bucketed storage keeps one buffer (no copy of the storage per op).
    for t in (7, 13, 21, 27):
        a = torch.randn(2, t, 4)
        y = a.to("neuron") * 2          # bucketed from the second length on: a boxed storage
        rec = memory.record_of(y)
        ref = a * 2
        y.add_(1.0)
        ref.add_(1.0)
        address = rec.buf.unsafe_buffer_pointer()
        copies = _extra("donation_copies")
        for _ in range(3):
            y.mul_(1.5)
            ref.mul_(1.5)
            y.add_(0.25)
            ref.add_(0.25)
        torch.testing.assert_close(y.cpu(), ref)
        if rec.boxed:
            assert rec.buf.unsafe_buffer_pointer() == address, t
            assert _extra("donation_copies") == copies, t
    assert _extra("bucketed_eager_compiles") > 0
