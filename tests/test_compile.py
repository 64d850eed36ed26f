"""torch.compile(backend="neuron"): results match CPU PyTorch, graph semantics, caching, static shapes.

Models are small so the whole file stays quick on a 2-core machine; bench/compile.py runs the
full-size GPT.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from torchneuron.config import Config


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def close(neuron, cpu, rtol=1e-4, atol=1e-5):
    assert neuron.device.type == "neuron", neuron.device
    torch.testing.assert_close(neuron.detach().cpu(), cpu.detach(), rtol=rtol, atol=atol)


def graphs_built():
    """Graphs compiled, or loaded from the persistent or in-memory cache (the disk cache may be warm)."""
    m = torchneuron.metrics()
    return m["graphs_compiled"] + m["extra"].get("graph_persistent_cache_hits", 0) \
        + m["extra"].get("graph_memory_cache_hits", 0)


def twin(make, seed=0):
    """The same module on CPU and on neuron (built in place: Module.to() re-creates parameters)."""
    torch.manual_seed(seed)
    cpu = make()
    with torch.device("neuron"):
        dev = make()
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev


def train_steps(model, inputs, target, loss_fn, steps, compile_step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    run = torch.compile(step, backend="neuron") if compile_step else step
    return [run(inputs, target).detach() for _ in range(steps)], opt


# -- models -------------------------------------------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No conv bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # amplify into steps of size lr in arbitrary directions on either device.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 2 * 2, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 2).flatten(1))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias cannot change attention, so its gradient is zero up to rounding
        # and Adam would turn that noise into steps of size lr on either device.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=96, d=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight            # tied LM head

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- whole models against CPU eager ---------------------------------------------------------------
def test_entry_point_names_the_backend():
    ep = importlib.metadata.entry_points(group="torch_dynamo_backends")["neuron"]
    import torchneuron.compile
    assert ep.load() is torchneuron.compile.neuron_backend
    assert "neuron" in torch._dynamo.list_backends()


def test_mlp_forward_and_compiled_train_steps_match_cpu():
    cpu, dev = twin(mlp)
    x, y = torch.randn(16, 12), torch.randn(16, 5)
    with torch.no_grad():                     # an inference graph
        out = torch.compile(dev, backend="neuron")(x.to("neuron"))
    assert not out.requires_grad
    close(out, cpu(x))
    cpu_losses, _ = train_steps(cpu, x, y, F.mse_loss, 10, compile_step=False)
    dev_losses, opt = train_steps(dev, x.to("neuron"), y.to("neuron"), F.mse_loss, 10, compile_step=True)
    for a, b in zip(dev_losses, cpu_losses):
        close(a, b, rtol=1e-4, atol=1e-5)
    for p, q in zip(dev.parameters(), cpu.parameters()):
        close(p, q, rtol=1e-3, atol=1e-4)
    # AdamW's step counters are CPU tensors updated inside the optimizer graph.
    assert all(s["step"].item() == 10 for s in opt.state.values())
    assert torchneuron.metrics()["fallback_count"] == 0


def test_compiled_step_with_grad_clipping_and_single_tensor_adam():
    # Covers foreach norms (clip_grad_norm_), Dynamo's fma rewrite of addcmul_ (foreach=False)
    # and amsgrad's maximum, all inside the compiled step.
    cpu, dev = twin(mlp, seed=1)
    x, y = torch.randn(16, 12), torch.randn(16, 5)
    losses = []
    for model, xx, yy, compiled in ((cpu, x, y, False), (dev, x.to("neuron"), y.to("neuron"), True)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False, amsgrad=True)

        def step(a, b, model=model, opt=opt):
            opt.zero_grad()
            loss = F.mse_loss(model(a), b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss

        run = torch.compile(step, backend="neuron") if compiled else step
        losses.append([run(xx, yy).detach() for _ in range(4)])
    for a, b in zip(losses[1], losses[0]):
        close(a, b, rtol=1e-4, atol=1e-5)
    for p, q in zip(dev.parameters(), cpu.parameters()):
        close(p, q, rtol=1e-3, atol=1e-4)


def test_cnn_with_batchnorm_trains_like_cpu_and_updates_running_stats():
    cpu, dev = twin(CNN)
    x, y = torch.randn(6, 3, 12, 12), torch.randint(0, 4, (6,))
    cpu_losses, _ = train_steps(cpu, x, y, F.cross_entropy, 10, compile_step=False)
    compiled = torch.compile(dev, backend="neuron")
    dev_losses, _ = train_steps(compiled, x.to("neuron"), y.to("neuron"), F.cross_entropy, 10,
                                compile_step=False)
    for a, b in zip(dev_losses, cpu_losses):
        close(a, b, rtol=1e-4, atol=1e-5)
    for p, q in zip(dev.parameters(), cpu.parameters()):
        close(p, q, rtol=1e-3, atol=1e-4)
    # Running statistics are input mutations kept inside the graph and written back.
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(getattr(dev.bn1, name), getattr(cpu.bn1, name), rtol=1e-4, atol=1e-5)
        close(getattr(dev.bn2, name), getattr(cpu.bn2, name), rtol=1e-4, atol=1e-5)
    # Inference (eval, no_grad) is its own graph and uses the running stats.
    cpu.eval()
    dev.eval()
    with torch.no_grad():
        close(compiled(x.to("neuron")), cpu(x), rtol=1e-4, atol=1e-5)


def test_gpt_forward_and_compiled_train_steps_match_cpu():
    cpu, dev = twin(GPT)
    assert dev.head.weight is dev.tok.weight
    g = torch.Generator().manual_seed(3)
    idx, tgt = torch.randint(0, 96, (3, 16), generator=g), torch.randint(0, 96, (3, 16), generator=g)
    with torch.no_grad():
        close(torch.compile(dev, backend="neuron")(idx.to("neuron")), cpu(idx), rtol=1e-4, atol=1e-4)
    cpu_losses, _ = train_steps(cpu, idx, tgt, lm_loss, 10, compile_step=False)
    dev_losses, _ = train_steps(dev, idx.to("neuron"), tgt.to("neuron"), lm_loss, 10, compile_step=True)
    for a, b in zip(dev_losses, cpu_losses):
        close(a, b, rtol=2e-4, atol=1e-4)
    assert cpu_losses[-1] < cpu_losses[0] * 0.8            # it learns, so the comparison means something
    for p, q in zip(dev.parameters(), cpu.parameters()):
        close(p, q, rtol=1e-3, atol=2e-4)
    assert torchneuron.metrics()["fallback_count"] == 0


# -- graph semantics -------------------------------------------------------------------------------
def test_view_and_non_contiguous_inputs():
    def f(a, b, c, d):
        return a @ b + c.sum() + d

    at, base, c0, rows = torch.randn(4, 6), torch.randn(9, 10), torch.randn(5, 1), torch.randn(4, 5)
    nat, nbase, nc0, nrows = (t.to("neuron") for t in (at, base, c0, rows))
    out = torch.compile(f, backend="neuron")(
        nat.t(),                  # transposed
        nbase[1:5, ::2],          # storage offset and a stride of 2
        nc0.expand(5, 3),         # stride 0
        nrows[2])                 # offset view of one row
    close(out, f(at.t(), base[1:5, ::2], c0.expand(5, 3), rows[2]))


def test_input_mutations_through_views_reach_the_storage():
    def f(x, window):
        window.add_(x)             # writes into the middle of a bigger tensor
        x.mul_(2)
        return x + window

    big, x = torch.randn(10, 3), torch.randn(4, 3)
    nbig, nx = big.to("neuron"), x.to("neuron")
    out = torch.compile(f, backend="neuron")(nx, nbig[3:7])
    ref = f(x, big[3:7])
    close(out, ref)
    close(nbig, big)
    close(nx, x)


def test_outputs_aliasing_inputs_and_each_other():
    def f(x):
        y = x * 2
        return x.t(), x.view(-1)[2:5], y, y.view(-1)

    x = torch.randn(3, 4)
    nx = x.to("neuron")
    t, part, y, flat = torch.compile(f, backend="neuron")(nx)
    for got, want in zip((t, part, y, flat), f(x)):
        close(got, want)
    # Views of inputs are real aliases: writing through them changes the input, as on CPU.
    assert t.untyped_storage().data_ptr() == nx.untyped_storage().data_ptr()
    with torch.no_grad():
        part.fill_(7.0)
    expected = x.clone()
    expected.view(-1)[2:5] = 7.0
    close(nx, expected)
    assert flat.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_dropout_is_reproducible_under_manual_seed_and_backward_uses_its_mask():
    def f(x):
        return F.dropout(x, p=0.5, training=True) * 3

    g = torch.compile(f, backend="neuron")
    x = torch.randn(64, 64).to("neuron").requires_grad_()
    torch.manual_seed(123)
    a = g(x)
    b = g(x)
    torch.manual_seed(123)
    a2 = g(x)
    assert torch.equal(a.detach().cpu(), a2.detach().cpu())
    assert not torch.equal(a.detach().cpu(), b.detach().cpu())
    kept = a.detach().cpu() != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    close(a, torch.where(kept, x.detach().cpu() * 6, 0.0))
    a.sum().backward()
    close(x.grad, kept.float() * 6)


def test_random_ops_inside_graphs_follow_the_device_generator():
    def f(x):
        return x + torch.rand_like(x) + torch.randn(x.shape, device=x.device)

    g = torch.compile(f, backend="neuron")
    x = torch.zeros(1000, device="neuron")
    torch.manual_seed(7)
    a = g(x).cpu()
    torch.manual_seed(7)
    assert torch.equal(g(x).cpu(), a)
    assert abs(a.mean().item() - 0.5) < 0.15


# -- caching and dumps ----------------------------------------------------------------------------
def test_identical_graph_reuses_the_in_memory_executable():
    def f(x):
        return torch.sin(x) * 3 + 1

    x = torch.randn(7, 5).to("neuron")
    torch.compile(f, backend="neuron")(x)
    built = graphs_built()
    hits = torchneuron.metrics()["extra"].get("graph_memory_cache_hits", 0)
    torch._dynamo.reset()                          # Dynamo traces again: same graph, same inputs
    close(torch.compile(f, backend="neuron")(x), f(x.cpu()))
    assert torchneuron.metrics()["extra"]["graph_memory_cache_hits"] == hits + 1
    assert graphs_built() == built + 1           # the hit, not a new compile


_WARM_START = textwrap.dedent("""
    import json, torch            # no `import torchneuron`: the entry points bring it in
    def f(x, w):
        return torch.relu(x[torch.arange(8, device=x.device) % 5] @ w).sum(0).softmax(-1)
    x = torch.randn(8, 16, device="neuron")
    w = torch.randn(16, 4, device="neuron", requires_grad=True)
    out = torch.compile(f, backend="neuron")(x, w)
    out[1].backward()
    import torchneuron
    m = torchneuron.metrics()
    print("RESULT" + json.dumps({"compiled": m["graphs_compiled"],
                                  "disk": m["extra"].get("graph_persistent_cache_hits", 0),
                                  "sum": float(out.sum().item())}))
""")


def test_second_process_starts_warm_from_the_disk_cache(tmp_path):
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for dump in (True, False):          # the cold run also dumps FX code and StableHLO
        run_env = dict(env, TORCHNEURON_DUMP_DIR=str(tmp_path / "dump")) if dump else env
        proc = subprocess.run([sys.executable, "-c", _WARM_START], env=run_env, capture_output=True, text=True,
                              timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
        assert line is not None, proc.stderr[-3000:]
        runs.append(json.loads(line[len("RESULT"):]))
    cold, warm = runs
    assert cold["compiled"] == 2 and cold["disk"] == 0           # forward and backward graphs
    assert warm["compiled"] == 0 and warm["disk"] == 2
    assert len(list((tmp_path / "cache" / "graphs").glob("*.tnexe"))) == 2
    assert abs(cold["sum"] - 1.0) < 1e-5 and abs(warm["sum"] - 1.0) < 1e-5
    dumped = sorted(p.name for p in (tmp_path / "dump").iterdir())
    fx = [p for p in dumped if p.endswith(".fx.py")]
    hlo = [p for p in dumped if p.endswith(".stablehlo.mlir")]
    assert any("forward" in p for p in fx) and any("backward" in p for p in fx) and len(hlo) == len(fx)
    assert "torch.ops.aten.mm" in (tmp_path / "dump" / next(p for p in fx if "forward" in p)).read_text()
    assert "stablehlo.dot_general" in (tmp_path / "dump" / hlo[0]).read_text() or \
        "stablehlo" in (tmp_path / "dump" / hlo[0]).read_text()

    # Without the graph index, a process compiles through JAX's persistent cache (a deserialized
    # executable). That executable must not be written back to the index: re-serializing it loses
    # its fused kernels, and the next process failed with "Function ... not found".
    for entry in (tmp_path / "cache" / "graphs").glob("*.tnexe"):
        entry.unlink()
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _WARM_START], env=env, capture_output=True, text=True,
                              timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
        assert line is not None, proc.stderr[-3000:]
        assert abs(json.loads(line[len("RESULT"):])["sum"] - 1.0) < 1e-5


# -- static shapes, recompiles, graph breaks ------------------------------------------------------
def test_dynamic_true_warns_and_compiles_each_shape_statically(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "shapes", "static")   # the default these tests pin

    def f(x):
        return x.softmax(-1) * x.shape[0]

    g = torch.compile(f, backend="neuron", dynamic=True)
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="dynamic=True.*static shapes"):
        close(g(x.to("neuron")), f(x))
    for rows in (4, 6, 5):
        x = torch.randn(rows, 8)
        close(g(x.to("neuron")), f(x))
    assert torchneuron.metrics()["recompiles"]["new input shapes (the neuron backend compiles static shapes)"] == 2


def test_dynamic_true_with_unspecialized_floats_compiles_each_shape_statically(monkeypatch):
    """Dynamo passes Python floats (nn.Embedding's norm_type, a scale) as 0-dim CPU tensors read with
    .item() under dynamic=True; the static retrace failed with DataDependentOutputException."""
    monkeypatch.setattr(torchneuron.config, "shapes", "static")   # the default these tests pin
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head, self.scale = emb, head, 0.5

        def forward(self, ids):
            return self.head(self.emb(ids)) * self.scale

    cpu = M()
    g = torch.compile(copy.deepcopy(cpu).to("neuron"), backend="neuron", dynamic=True)
    for n in (5, 9, 12):
        ids = torch.randint(0, 50, (2, n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            close(g(ids.to("neuron")), cpu(ids))
    assert torchneuron.metrics()["recompiles"]["new input shapes (the neuron backend compiles static shapes)"] == 2


def test_new_shape_recompile_is_counted_with_its_reason():
    def f(x):
        return torch.cos(x) + 1

    g = torch.compile(f, backend="neuron")
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        close(g(x.to("neuron")), f(x))
    recompiles = torchneuron.metrics()["recompiles"]
    assert sum(recompiles.values()) >= 1
    assert any("size" in reason or "shape" in reason for reason in recompiles), recompiles


def test_graph_breaks_are_counted_with_their_reason():
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    x = torch.randn(4).to("neuron")
    close(torch.compile(f, backend="neuron")(x), f(x.cpu()))
    breaks = torchneuron.metrics()["graph_breaks"]
    assert sum(breaks.values()) == 1
    assert any("graph_break" in reason for reason in breaks), breaks


def test_pad_and_bucket_helpers_keep_shapes_stable():
    t = torch.arange(6).view(2, 3)
    padded = torchneuron.pad_to_multiple(t, multiple=4, value=-1)
    assert padded.tolist() == [[0, 1, 2, -1], [3, 4, 5, -1]]
    assert torchneuron.pad_to_multiple(t, multiple=2, dim=0) is t
    assert torchneuron.pad_to_multiple(torch.ones(5, 2), multiple=8, dim=0).shape == (8, 2)
    assert [torchneuron.bucket_length(n) for n in (1, 128, 129, 300, 1000)] == [128, 128, 256, 512, 1024]
    assert torchneuron.bucket_length(70, buckets=[64, 96, 128]) == 96
    with pytest.raises(ValueError, match="largest bucket"):
        torchneuron.bucket_length(200, buckets=[64, 128])

    def f(x):
        return torchneuron.pad_to_multiple(x, multiple=8).sum(-1)

    g = torch.compile(f, backend="neuron")
    for n in (5, 7):      # both pad to 8: one graph, one shape
        x = torch.randn(3, n)
        close(g(x.to("neuron")), x.sum(-1))
    assert sum(torchneuron.metrics()["graph_breaks"].values()) == 0


# -- ops without a lowering ------------------------------------------------------------------------
def needs_fallback(x):
    return torch.special.bessel_j0(x) + 1      # aten::special_bessel_j0 has no neuron lowering


def test_unlowerable_op_fails_naming_the_op_and_the_source_line():
    x = torch.rand(5).to("neuron")
    with pytest.raises(Exception, match="special_bessel_j0") as info:
        torch.compile(needs_fallback, backend="neuron")(x)
    message = str(info.value)
    assert "test_compile.py" in message and "bessel_j0(x) + 1" in message
    assert "fallback" in message and "TORCHNEURON_COMPILE_FALLBACK" in message


@pytest.mark.parametrize("how", ["option", "config"])
def test_fallback_eager_runs_the_graph_eagerly_and_counts_it(how):
    x = torch.rand(5)
    old = torchneuron.config.compile_fallback
    try:
        if how == "option":
            g = torch.compile(needs_fallback, backend="neuron", options={"fallback": "eager"})
        else:
            torchneuron.config.compile_fallback = "eager"
            g = torch.compile(needs_fallback, backend="neuron")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = g(x.to("neuron"))
    finally:
        torchneuron.config.compile_fallback = old
    close(out, needs_fallback(x))
    assert torchneuron.metrics()["graph_fallbacks"] == {"special_bessel_j0": 1}


def test_compile_fallback_setting_reads_the_environment():
    assert Config.from_env({"TORCHNEURON_COMPILE_FALLBACK": "eager"}).compile_fallback == "eager"
    assert Config.from_env({}).compile_fallback == "error"
    with pytest.raises(Exception, match="unknown torch.compile option"):
        torch.compile(needs_fallback, backend="neuron", options={"fallbak": "eager"})(torch.rand(2).to("neuron"))


@pytest.mark.parametrize("offset", [5, None])
def test_as_strided_of_a_view_input_indexes_the_whole_storage(offset):
    # as_strided's sizes, strides and offset index the input's storage, including elements outside
    # the view the graph received (offset None keeps the view's own storage offset).
    def f(x):
        if offset is None:
            return torch.as_strided(x, (2, 3), (1, 4)) * 2
        return torch.as_strided(x, (2, 3), (1, 4), offset) * 2

    base = torch.arange(24.).reshape(4, 6)
    expected = f(base[1:, 2:])
    nbase = base.to("neuron")
    got = torch.compile(f, backend="neuron", fullgraph=True)(nbase[1:, 2:])
    torch.testing.assert_close(got.cpu(), expected)


_OTHER_BACKENDS = """
import torch, torchneuron
from torchneuron.report import drift   # a torchneuron module loaded after registration
def f(x, y):
    z = x @ y + 1
    if z.sum() > 0:   # a graph break: Dynamo runs the code between graphs eagerly, frame by frame
        z = z * 2
    return z.relu().mean()
x, y = torch.randn(4, 4), torch.randn(4, 4)
for backend in ("eager", "aot_eager"):
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend)(x.to("neuron"), y.to("neuron")).cpu()
    torch.testing.assert_close(got, f(x, y), msg=backend)   # XLA's matmul rounds unlike CPU's
    model = torch.nn.Linear(4, 2).to("neuron")
    assert drift.locate_drift(model, (x.to("neuron"),)) is not None
print("ok")
"""


def test_other_backends_never_trace_torchneuron_frames():
    # In a fresh process the neuron backend never ran: torchneuron's frames are skipped from
    # registration on (Dynamo tracing into them failed with "Expected np.nditer base").
    proc = subprocess.run([sys.executable, "-c", _OTHER_BACKENDS], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"], proc.stdout


@pytest.mark.parametrize("shapes", ["static", "bucketed"])
def test_parameters_rewritten_or_replaced_between_compiled_calls(shapes):
    """A graph keeps its parameters' input specs between calls (runtime/inputs.py, StableStorages):
    an in-place write, a new tensor assigned with ``.data`` and a freed-and-reallocated weight must
    all be read as they are at the call."""
    torchneuron.config.shapes = shapes
    try:
        torch.manual_seed(0)
        cpu = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        dev = copy.deepcopy(cpu).to("neuron")
        f = torch.compile(dev, backend="neuron", dynamic=shapes == "bucketed")
        for step, rows in enumerate([5, 7, 5, 9, 7]):
            x = torch.randn(rows, 8)
            with torch.no_grad():
                if step == 1:      # in place: same storage, new buffer
                    cpu[0].weight.mul_(-2.0)
                    dev[0].weight.mul_(-2.0)
                elif step == 2:    # a new storage through .data
                    w = torch.randn(4, 16)
                    cpu[2].weight.data = w.clone()
                    dev[2].weight.data = w.to("neuron")
                elif step == 3:    # the old storage freed, a new one (maybe at its address) assigned
                    b = torch.randn(16)
                    cpu[0].bias.data = b.clone()
                    dev[0].bias.data = b.to("neuron")
                    del b
                got = f(x.to("neuron")).cpu()
            torch.testing.assert_close(got, cpu(x), rtol=1e-5, atol=1e-5)
    finally:
        torchneuron.config.shapes = "static"
