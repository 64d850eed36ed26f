"""Adaptive eager: the same program, the same results, fewer executables launched."""

import gc
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from test_training_parity import CNN, MLP, assert_losses_match, train

import torchneuron

from conftest import cpu_only


@pytest.fixture
def adaptive():
    torchneuron.set_eager_mode("adaptive")
    yield
    torchneuron.set_eager_mode("plain")


def m(name):
    return torchneuron.metrics()[name]


def test_mode_switches():
    assert torchneuron.config.eager_mode == "plain"
    with torchneuron.eager_mode("adaptive"):
        assert torchneuron.config.eager_mode == "adaptive"
        x = torch.ones(3, device="neuron") + 1
    assert torchneuron.config.eager_mode == "plain"
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="eager_mode"):
        torchneuron.set_eager_mode("fast")


@pytest.mark.usefixtures("adaptive")
def test_region_runs_at_host_read_as_one_executable():
    a = torch.arange(6.0).to("neuron")
    torchneuron.metrics.reset()
    b = (a * 2 + 1).relu().sum()
    assert m("regions_flushed") == 0 and m("executables_compiled") == 0  # recorded, not run
    assert b.item() == ((torch.arange(6.0) * 2 + 1).relu().sum()).item()
    assert m("regions_flushed") == 1 and m("region_ops") == 4 and m("flush_reasons") == {"host read": 1}


SYNC_POINTS = {
    "cpu": lambda t: t.cpu(),
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "print": lambda t: repr(t),
    "synchronize": lambda t: torch.neuron.synchronize(),
    "host write": lambda t: t.copy_(torch.zeros(3)),
}


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("name", sorted(SYNC_POINTS))
def test_each_sync_point_flushes(name):
    t = torch.ones(3, device="neuron")
    torchneuron.metrics.reset()
    t.mul_(3)
    SYNC_POINTS[name](t)
    assert m("regions_flushed") >= 1
    if name != "host write":
        assert t.cpu().tolist() == [3.0, 3.0, 3.0]


@pytest.mark.usefixtures("adaptive")
def test_fallback_and_size_limit_flush(monkeypatch):
    x = torch.tensor([0.5, 1.5, 2.5], device="neuron")
    torchneuron.metrics.reset()
    y = x * 2
    torchneuron.config.fallback = "silent"
    try:
        h = cpu_only(y, 6)
    finally:
        torchneuron.config.fallback = "warn"
    assert "fallback" in m("flush_reasons") and h.cpu().tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    monkeypatch.setattr(torchneuron.config, "adaptive_max_ops", 4)
    torchneuron.metrics.reset()
    z = x
    for _ in range(9):
        z = z + 1
    assert m("flush_reasons") == {"size limit": 2}
    assert z.cpu().tolist() == [9.5, 10.5, 11.5]


def test_exit_flushes_pending_work(tmp_path):
    out = tmp_path / "saved.txt"
    # atexit runs handlers last-in first-out: register the observer before torchneuron loads.
    code = (f"import atexit\n"
            f"atexit.register(lambda: open({str(out)!r}, 'w').write(str(torchneuron.metrics()['flush_reasons'])))\n"
            f"import torch, torchneuron\ntorchneuron.set_eager_mode('adaptive')\n"
            f"t = torch.ones(2, device='neuron') * 5\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "exit" in out.read_text()


@pytest.mark.usefixtures("adaptive")
def test_inplace_through_views_inside_one_region():
    c = torch.arange(24.0).reshape(4, 6)
    n = c.to("neuron")
    torchneuron.metrics.reset()
    for t in (c, n):
        t[:, 1].add_(1)
        t.t().mul_(2)
        t[1:3, ::2] = 5
        v = t.view(2, 12)
        v[0].sub_(t[3, 0])
        t.diagonal().fill_(0)
    assert m("regions_flushed") == 0
    torch.testing.assert_close(n.cpu(), c)
    assert m("regions_flushed") == 1


@pytest.mark.usefixtures("adaptive")
def test_errors_surface_at_the_users_line():
    a = torch.ones(2, 3, device="neuron")
    b = torch.ones(4, device="neuron")
    with pytest.raises(RuntimeError) as err:
        _ = a + 1
        bad = a + b  # noqa: F841  <- the error belongs here, not at a later sync point
    frames = traceback.extract_tb(err.value.__traceback__)
    user = [f for f in frames if f.filename == __file__][-1]
    assert "bad = a + b" in user.line


@pytest.mark.usefixtures("adaptive")
def test_training_matches_cpu_and_compiles_the_step_once():
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 50, (16, 4)), torch.randint(0, 5, (16,))
    make_opt = lambda p: torch.optim.AdamW(p, lr=2e-3)  # noqa: E731
    with torchneuron.eager_mode("plain"):
        cpu, _ = train(MLP, tokens, labels, F.cross_entropy, "cpu", make_opt)
    torchneuron.metrics.reset()
    neu, _ = train(MLP, tokens, labels, F.cross_entropy, "neuron", make_opt)
    assert_losses_match(cpu, neu)
    # The first steps differ (optimizer state is created); after that every step hits the cache.
    assert m("region_compiles") <= 3
    assert m("region_cache_hits") >= 17
    assert m("fallbacks") == {}


@pytest.mark.usefixtures("adaptive")
def test_cnn_with_batchnorm_matches_cpu():
    torch.manual_seed(2)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    with torchneuron.eager_mode("plain"):
        cpu, _ = train(CNN, images, labels, F.cross_entropy, "cpu", make_opt, steps=8)
    neu, _ = train(CNN, images, labels, F.cross_entropy, "neuron", make_opt, steps=8)
    assert_losses_match(cpu, neu)


def _dropout_stream():
    torch.manual_seed(123)
    x = torch.ones(64, device="neuron", requires_grad=True)
    y = F.dropout(x, 0.5) * torch.rand(64, device="neuron")
    y.sum().backward()
    return y.detach().cpu(), x.grad.cpu()


def test_rng_streams_and_autograd_identical_to_plain():
    plain = _dropout_stream()
    with torchneuron.eager_mode("adaptive"):
        fused = _dropout_stream()
    assert torch.equal(plain[0], fused[0]) and torch.equal(plain[1], fused[1])


def _memory_trace():
    gc.collect()
    base = torch.neuron.memory_allocated()
    trace = []
    a = torch.ones(1000, device="neuron")
    trace.append(torch.neuron.memory_allocated() - base)
    b = a * 2
    trace.append(torch.neuron.memory_allocated() - base)
    del a
    trace.append(torch.neuron.memory_allocated() - base)
    c = b.sum()
    trace.append(torch.neuron.memory_allocated() - base)
    c.item()
    del b, c
    gc.collect()
    trace.append(torch.neuron.memory_allocated() - base)
    return trace


def test_memory_statistics_identical_to_plain():
    plain = _memory_trace()
    with torchneuron.eager_mode("adaptive"):
        fused = _memory_trace()
    assert plain == fused == [4000, 8000, 4000, 4004, 0]
