"""Adaptive eager: the same program, the same results, fewer executables launched.

Regions run op by op until their fused executable is compiled in the background; tests that need the
fused path wait for it with ``adaptive.wait_for_compiles()`` (counts, never timing).
"""

import contextlib
import gc
import subprocess
import sys
import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
from test_training_parity import CNN, MLP, assert_losses_match, train

import torchneuron
from torchneuron.eager import adaptive as adaptive_mode

from conftest import cpu_only


@pytest.fixture
def adaptive(monkeypatch):
    adaptive_mode.wait_for_compiles()   # nothing from an earlier test lands in this one's metrics
    adaptive_mode.clear_region_cache()
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)   # compile when repeated
    torchneuron.metrics.reset()
    torchneuron.set_eager_mode("adaptive")
    yield
    torchneuron.set_eager_mode("plain")
    adaptive_mode.wait_for_compiles()


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
def test_dtype_a_lowering_refuses_raises_at_the_users_line():
    x = torch.arange(256).reshape(4, 4, 4, 4).to("neuron")
    for _ in range(2):   # and again for the same call
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'") as err:
            torch.nn.functional.adaptive_avg_pool2d(x, 2)  # <- raised here, not at a later read
        frames = traceback.extract_tb(err.value.__traceback__)
        assert "adaptive_avg_pool2d(x, 2)" in [f for f in frames if f.filename == __file__][-1].line
    assert (x.float() + 1).sum().item() == 32896.0   # nothing half-recorded is left behind


def _mlp_loop(read_every, steps=12, after_step=None):
    """An MLP training loop with AdamW that reads the loss every ``read_every`` steps (0: only at the
    end). Waits for the background compiles after the third step, so later steps run fused. Returns
    the losses and the model; ``after_step()`` is called after each ``opt.step()``."""
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 50, (16, 4)), torch.randint(0, 5, (16,))
    torch.manual_seed(0)
    model = MLP().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    x, y = tokens.to("neuron"), labels.to("neuron")
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        losses.append(loss.detach())
        if read_every and step % read_every == 0:
            loss.item()
        if step == 2:
            adaptive_mode.wait_for_compiles()
    return [v.item() for v in losses], model


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("read_every", [1, 10, 0])
def test_training_loop_regions_repeat_whether_or_not_it_reads_the_loss(read_every):
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 50, (16, 4)), torch.randint(0, 5, (16,))
    make_opt = lambda p: torch.optim.AdamW(p, lr=2e-3)  # noqa: E731
    with torchneuron.eager_mode("plain"):
        cpu, _ = train(MLP, tokens, labels, F.cross_entropy, "cpu", make_opt, steps=12)
    torchneuron.metrics.reset()
    neu, _ = _mlp_loop(read_every)
    assert_losses_match(cpu, neu)
    # Two regions per step, cut where the step has boundaries, not where the loop reads a value.
    assert m("flush_reasons") == {"backward end": 12, "optimizer step": 12}
    # Forward and backward are the same region every step; the optimizer's first step differs (it
    # creates its state). So three region shapes, the two that repeat compiled once each.
    assert m("region_unfused")["first sighting"] == 3
    assert m("region_compiles") == 2
    # Steps 4..12 ran fused; every op of those steps was checked against the known region.
    assert m("region_cache_hits") >= 2 * 9
    assert m("region_replayed_ops") >= 9 * m("region_ops") / 12
    assert m("fallbacks") == {}


@pytest.mark.usefixtures("adaptive")
def test_first_occurrence_runs_op_by_op_then_fused_once_compiled():
    a = torch.arange(6.0).to("neuron")
    expected = ((torch.arange(6.0) * 2 + 1).relu() * 3).sum().item()
    per_op_runs = []

    def per_op_executables_run():
        # Compiled now, loaded from this process's persistent cache (an earlier test in the same
        # worker compiled the same op and layout, then cleared the in-memory cache), or a hit.
        return m("executables_compiled") + m("eager_cache_loads") + m("cache_hits")

    for i in range(4):
        before = per_op_executables_run()
        assert ((a * 2 + 1).relu() * 3).sum().item() == expected
        per_op_runs.append(per_op_executables_run() - before)
        if i == 1:
            adaptive_mode.wait_for_compiles()
    # Until the fused executable is ready, each occurrence runs the per-op executables plain eager
    # uses (compiling those it lacks, as plain eager would).
    assert per_op_runs == [5, 5, 0, 0]
    assert m("region_unfused") == {"first sighting": 1, "compiling": 1}
    assert m("region_compiles") == 1 and m("region_cache_hits") == 2
    assert m("region_compile_seconds") > 0


@pytest.mark.usefixtures("adaptive")
def test_user_thread_never_waits_for_a_region_compile(monkeypatch):
    release, started = threading.Event(), threading.Event()
    build = adaptive_mode.compiler._fused

    def slow_fused(seg, device, donated=()):
        started.set()
        release.wait(60)
        return build(seg, device, donated)

    monkeypatch.setattr(adaptive_mode.compiler, "_fused", slow_fused)
    x = torch.ones(4).to("neuron")
    try:
        for i in range(6):
            assert (x * i + 1).sum().item() == 4 * (i + 1)
            if i == 1:
                assert started.wait(60)   # the second occurrence queued the compile; it is blocked...
        assert m("region_unfused") == {"first sighting": 1, "compiling": 5}  # ...the user's ran on
        assert m("region_compiles") == 0
    finally:
        release.set()
    adaptive_mode.wait_for_compiles()
    assert (x * 7 + 1).sum().item() == 32
    assert m("region_compiles") == 1 and m("region_cache_hits") == 1


@pytest.mark.usefixtures("adaptive")
def test_compile_failure_keeps_the_region_running_op_by_op(monkeypatch):
    def broken(seg, device, donated=()):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(adaptive_mode.compiler, "_fused", broken)
    x = torch.arange(4.0).to("neuron")
    for _ in range(4):
        assert (x + 1).mul(2).tolist() == [2.0, 4.0, 6.0, 8.0]
        adaptive_mode.wait_for_compiles()
    assert m("region_unfused") == {"first sighting": 1, "compiling": 1, "compile failed": 2}
    assert m("region_compiles") == 0


@pytest.mark.usefixtures("adaptive")
def test_a_region_that_fails_to_run_leaves_its_results_unreadable_with_a_clear_error(monkeypatch):
    def failing(exe, bufs, runtime):
        raise RuntimeError("simulated device failure")

    x = torch.arange(3.0).to("neuron")
    y = x * 2
    with monkeypatch.context() as patch:
        patch.setattr(adaptive_mode.run, "run_op", failing)
        with pytest.raises(RuntimeError, match="simulated device failure"):
            y.cpu()
    with pytest.raises(RuntimeError, match="never computed.*simulated device failure"):
        y.cpu()
    assert (x * 2).tolist() == [0.0, 2.0, 4.0]   # the mode goes on working


@pytest.mark.usefixtures("adaptive")
def test_regions_that_keep_changing_stop_being_compiled():
    # Four new region shapes for each one that repeats: most regions are new, so compiling them
    # would cost more than it returns.
    sizes = []
    for block in range(10):
        sizes += [5 * block + 1, 5 * block + 2, 5 * block + 3, 5 * block + 4, 5 * block + 1]
    for n in sizes:
        t = torch.ones(n, device="neuron")
        assert (t * 2 + 1).sum().item() == 3 * n
    reasons = m("region_unfused")
    assert reasons["regions keep changing"] >= 3
    assert reasons["first sighting"] == 40
    assert "regions keep changing" in torchneuron.metrics.summary()


@pytest.mark.usefixtures("adaptive")
def test_background_compiles_wait_for_their_share_of_the_run_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(adaptive_mode.compiler, "_now", lambda: clock[0])
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 0.1)
    budget = adaptive_mode.budget
    budget.stop()
    budget.reset()
    budget.start()
    x = torch.arange(4.0).to("neuron")
    cost = budget.estimate(3)

    def occurrence():
        assert (x * 2 + 1).sum().item() == 16.0

    occurrence()
    occurrence()                       # repeated, but no time has passed: nothing to spend
    assert m("region_unfused") == {"first sighting": 1, "waiting for compile budget": 1}
    clock[0] += 0.9 * cost / 0.1       # 90% of the run time the compile needs at a 10% share
    occurrence()
    assert m("region_unfused")["waiting for compile budget"] == 2 and m("region_compiles") == 0
    clock[0] += 0.1 * cost / 0.1
    occurrence()                       # now affordable: queued
    adaptive_mode.wait_for_compiles()
    occurrence()
    assert m("region_unfused")["compiling"] == 1
    assert m("region_compiles") == 1 and m("region_cache_hits") == 1
    # Time spent in plain mode earns nothing.
    budget.stop()
    tokens = budget.tokens
    budget.start()
    torchneuron.set_eager_mode("plain")
    clock[0] += 100.0
    torchneuron.set_eager_mode("adaptive")
    budget.stop()
    assert budget.tokens == tokens
    budget.start()


def test_the_first_compile_is_charged_as_on_a_busy_machine_until_one_is_measured(monkeypatch):
    """A program's first seconds run no background compile on the quiet fit's optimistic estimate:
    until a compile has been measured the estimate is pessimistic, then measured times replace it."""
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 0.1)
    budget = adaptive_mode.CompileBudget()
    quiet = 0.3 + 0.01 * 8                 # the fit, in seconds, for an 8-op region
    assert budget.estimate(8) >= 3 * quiet
    budget.settle(8, 2 * quiet)            # the first measurement replaces the guess
    assert budget.estimate(8) == pytest.approx(2 * quiet)
    budget.settle(8, quiet)                # later ones are averaged in
    assert 1.0 * quiet < budget.estimate(8) < 2 * quiet


@pytest.mark.usefixtures("adaptive")
def test_a_region_too_long_for_one_executable_is_split(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_segment_ops", 3)
    x = torch.arange(5.0).to("neuron")
    c = torch.arange(5.0)
    expected = (((c + 1) * 2 - 3) / 4 + c).exp().sum()
    for i in range(3):
        y = (((x + 1) * 2 - 3) / 4 + x).exp().sum()   # 7 ops: segments of 3, 3 and 1
        torch.testing.assert_close(y.cpu(), expected)
        if i == 1:
            adaptive_mode.wait_for_compiles()
    assert m("region_splits") == 1
    assert m("region_compiles") == 3 and m("region_cache_hits") == 3


def _replay_case(pairs):
    """add_ through pairs of arguments; returns every result as a list."""
    out = []
    for a, b in pairs:
        a.add_(b)
        out.append(a.mul(2).tolist())
    return out


@pytest.mark.usefixtures("adaptive")
def test_replay_notices_a_call_that_differs_from_the_known_region():
    # The same op sequence with different argument wiring, views and dtypes: each must take the
    # full path (and give plain eager's result), never the replayed executable of another shape.
    def run(device):
        base = torch.arange(12.0, device=device).reshape(3, 4)
        other = torch.ones(3, 4, device=device)
        pairs = [(base, other)] * 3 + [(base, base), (base.t(), other.t()), (base[1], other[0]),
                                       (base, other.double().float()), (base, other)] * 2
        return _replay_case(pairs)

    with torchneuron.eager_mode("plain"):
        want = run("cpu")
    got = run("neuron")
    adaptive_mode.wait_for_compiles()
    got += run("neuron")
    assert got == want + want
    assert 0 < m("region_replayed_ops") < m("region_ops")


def _rows_loop(device, steps):
    """Rows read and written at offsets that change every step (runtime inputs of one program), a
    whole-storage read, and an integer division whose result dtype the default dtype decides."""
    rows = torch.arange(24.0, device=device).reshape(6, 4)
    cache = torch.zeros(6, 4, device=device)
    ints = torch.arange(1, 5, device=device)
    out = []
    for step in range(steps):
        if step == steps // 2:
            torch.set_default_dtype(torch.bfloat16)
        i = step % 6
        cache[i].copy_(rows[i] * 2)
        q = ints / 4
        out.append(((cache[i] + rows[(i + 1) % 6]).sum() + rows.sum()).item())
        out.append((q.dtype, q.tolist()))
        if step in (2, steps // 2 + 2) and device == "neuron":
            adaptive_mode.wait_for_compiles()   # each structure compiled once it repeated
    out.append(cache.tolist())
    return out


@pytest.mark.usefixtures("adaptive")
def test_replay_takes_view_offsets_at_run_time_and_checks_the_default_dtype():
    saved = torch.get_default_dtype()
    try:
        with torchneuron.eager_mode("plain"):
            want = _rows_loop("cpu", 12)
        torch.set_default_dtype(saved)
        got = _rows_loop("neuron", 12)
    finally:
        torch.set_default_dtype(saved)
    assert got == want
    # One structure per default dtype (the first step's also holds the setup): rows at new offsets
    # replay the known region, and run fused in the three steps after each compile.
    assert m("region_replayed_ops") >= 8 * m("region_ops") // 12
    assert m("region_compiles") == 2 and m("region_cache_hits") == 6


@pytest.mark.usefixtures("adaptive")
def test_replay_matches_compiled_in_floats_and_lists():
    # layer_norm's eps and shape, view's sizes, softmax's dim: compiled-in arguments the key holds
    # frozen (floats by their bits, lists as tuples); a replayed call must match them as the key does.
    x = torch.randn(3, 8).to("neuron")
    ref = x.cpu()
    for _ in range(6):
        f = lambda t: torch.softmax(F.layer_norm(t * 2, (8,), eps=1e-3).view(6, 4), dim=-1).sum()  # noqa: E731
        torchneuron.metrics.reset()
        assert f(x).item() == pytest.approx(f(ref).item())
    # The last step: every op replayed (the loop's step repeats the previous one).
    assert m("region_replayed_ops") == m("region_ops") > 0


@pytest.mark.usefixtures("adaptive")
def test_replay_sees_a_parameter_whose_data_was_replaced():
    lin = torch.nn.Linear(4, 3, bias=False).to("neuron")
    ref = torch.nn.Linear(4, 3, bias=False)
    ref.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    x = torch.randn(2, 4)
    for i in range(5):
        if i == 3:   # same shape, new storage; then a new shape (PyTorch allows it through .data)
            for mod in (lin, ref):
                mod.weight.data = mod.weight.data * 0.5
        if i == 4:
            for mod in (lin, ref):
                mod.weight.data = mod.weight.data[:2].clone()
        torch.testing.assert_close(lin(x.to("neuron")).cpu(), ref(x))
        if i == 1:
            adaptive_mode.wait_for_compiles()


@pytest.mark.usefixtures("adaptive")
def test_errors_surface_at_the_users_line_while_a_known_region_replays():
    a = torch.ones(2, 3, device="neuron")
    b = torch.ones(4, device="neuron")
    for _ in range(3):
        (a + 1).sum().item()
        adaptive_mode.wait_for_compiles()
    with pytest.raises(RuntimeError) as err:
        c = a + 1
        bad = c + b  # noqa: F841  <- replay predicts `c + a`-like ops; this one must fail here
    frames = traceback.extract_tb(err.value.__traceback__)
    assert "bad = c + b" in [f for f in frames if f.filename == __file__][-1].line
    assert c.sum().item() == 12.0   # what was recorded before the error still runs


@pytest.mark.usefixtures("adaptive")
def test_cnn_with_batchnorm_matches_cpu():
    torch.manual_seed(2)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    with torchneuron.eager_mode("plain"):
        cpu, _ = train(CNN, images, labels, F.cross_entropy, "cpu", make_opt, steps=8)
    neu, _ = train(CNN, images, labels, F.cross_entropy, "neuron", make_opt, steps=8)
    assert_losses_match(cpu, neu)


@contextlib.contextmanager
def _adaptive_from_scratch(monkeypatch):
    """Adaptive mode with no known region and fresh metrics; regions compile as soon as they repeat."""
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)
    with torchneuron.eager_mode("adaptive"):
        adaptive_mode.wait_for_compiles()
        adaptive_mode.clear_region_cache()
        torchneuron.metrics.reset()
        yield


def _dropout_stream():
    torch.manual_seed(123)
    x = torch.ones(64, device="neuron", requires_grad=True)
    y = F.dropout(x, 0.5) * torch.rand(64, device="neuron")
    y.sum().backward()
    return y.detach().cpu(), x.grad.cpu()


def test_rng_streams_and_autograd_identical_to_plain(monkeypatch):
    plain = _dropout_stream()
    with _adaptive_from_scratch(monkeypatch):
        runs = [_dropout_stream()]                 # op by op
        runs.append(_dropout_stream())
        adaptive_mode.wait_for_compiles()
        runs.append(_dropout_stream())             # fused, replayed
    for fused in runs:
        assert torch.equal(plain[0], fused[0]) and torch.equal(plain[1], fused[1])
    assert m("region_cache_hits") == 1 and m("region_replayed_ops") >= 8


def _generator_stream():
    g = torch.Generator(device="neuron").manual_seed(7)
    torch.manual_seed(3)
    out = []
    for i in range(4):
        x = torch.ones(16, device="neuron")
        out.append((torch.rand(16, device="neuron", generator=g) + x.normal_() * x.bernoulli_(0.5)).cpu())
        if i == 1:
            adaptive_mode.wait_for_compiles()
    return out


def test_replayed_random_ops_draw_from_their_generator_argument(monkeypatch):
    plain = _generator_stream()
    with _adaptive_from_scratch(monkeypatch):
        fused = _generator_stream()
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert m("region_cache_hits") >= 1 and m("region_replayed_ops") > 0


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


def test_memory_statistics_identical_to_plain(monkeypatch):
    plain = _memory_trace()
    with _adaptive_from_scratch(monkeypatch):
        runs = [_memory_trace(), _memory_trace()]
        adaptive_mode.wait_for_compiles()
        runs.append(_memory_trace())
    assert m("region_cache_hits") >= 1
    for fused in runs:
        assert plain == fused == [4000, 8000, 4000, 4004, 0]


# -- device checks (index bounds, integer division by zero) -----------------------------------------
_GX = torch.arange(12.0).reshape(3, 4)
_GOOD = torch.tensor([[1], [2], [0]])
_BAD = torch.tensor([[1], [7], [0]])
_OUT_OF_RANGE = "index 7 is out of bounds for dimension 1 with size 4"


def _gather_step(x, i):
    return ((x * 2).gather(1, i) + 1).sum()


def _compile_gather_region(x):
    """Run the gather region until its fused executable is ready (or its compile failed)."""
    for _ in range(3):
        assert _gather_step(x, _GOOD.to("neuron")).item() == _gather_step(_GX, _GOOD).item()
        adaptive_mode.wait_for_compiles()


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "op-by-op"])
def test_device_check_errors_of_a_replayed_region_name_the_line_of_that_occurrence(fused, monkeypatch):
    if not fused:   # the region replays but its segment keeps running op by op
        monkeypatch.setattr(adaptive_mode.compiler, "_fused", lambda seg, device, donated=(): 1 / 0)
    x = _GX.to("neuron")
    _compile_gather_region(x)
    hits, replayed = m("region_cache_hits"), m("region_replayed_ops")
    bad = _BAD.to("neuron")
    with pytest.raises(RuntimeError, match=_OUT_OF_RANGE) as err:
        ((x * 2).gather(1, bad) + 1).sum().item()   # the same region, called from this line
    assert m("region_replayed_ops") == replayed + 4
    assert m("region_cache_hits") == hits + fused
    assert "gather" in str(err.value) and "((x * 2).gather(1, bad) + 1).sum().item()" in str(err.value)
    assert _gather_step(x, _GOOD.to("neuron")).item() == _gather_step(_GX, _GOOD).item()   # goes on


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("first", ["gather", "div"])
def test_device_checks_of_a_fused_region_are_reported_in_op_order(first):
    x, a = _GX.to("neuron"), torch.tensor([7, 8, 9]).to("neuron")

    def step(i, d):
        if first == "gather":
            g = x.gather(1, i)
            q = a // d
        else:
            q = a // d
            g = x.gather(1, i)
        return g.sum() + q.sum()

    ones = torch.ones(3, dtype=torch.int64)
    for _ in range(3):
        step(_GOOD.to("neuron"), ones.to("neuron")).item()
        adaptive_mode.wait_for_compiles()
    hits = m("region_cache_hits")
    with pytest.raises(RuntimeError) as err:
        step(_BAD.to("neuron"), (ones * 0).to("neuron")).item()
    assert m("region_cache_hits") == hits + 1
    if first == "gather":
        assert _OUT_OF_RANGE in str(err.value)
    else:
        assert isinstance(err.value, ZeroDivisionError) and str(err.value).startswith("ZeroDivisionError")


@pytest.mark.usefixtures("adaptive")
def test_device_checks_sync_raises_when_a_fused_region_runs(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "device_checks", "sync")
    x = _GX.to("neuron")
    _compile_gather_region(x)
    hits = m("region_cache_hits")
    with pytest.raises(RuntimeError, match=_OUT_OF_RANGE):
        _gather_step(x, _BAD.to("neuron")).item()
    assert m("region_cache_hits") == hits + 1


@pytest.mark.usefixtures("adaptive")
def test_turning_device_checks_off_forgets_regions_compiled_with_them(monkeypatch):
    x = _GX.to("neuron")
    _compile_gather_region(x)
    assert adaptive_mode.region_cache_size() == 1
    monkeypatch.setattr(torchneuron.config, "device_checks", "off")
    assert adaptive_mode.region_cache_size() == 0
    _compile_gather_region(x)
    _gather_step(x, _BAD.to("neuron")).item()   # unchecked: no error, now or later
    torch.neuron.synchronize()


def _mlp_params_after(steps, overlap, monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", overlap)
    in_flight = []
    losses, model = _mlp_loop(0, steps, lambda: in_flight.append(adaptive_mode.region.inflight is not None))
    return losses, [p.detach().cpu() for p in model.parameters()], sum(in_flight)


@pytest.mark.usefixtures("adaptive")
def test_fused_runs_overlapping_the_next_region_give_the_same_values(monkeypatch):
    loss, params, in_flight = _mlp_params_after(8, True, monkeypatch)
    assert in_flight >= 4   # the optimizer's fused run was still in flight after opt.step()
    adaptive_mode.clear_region_cache()
    ref_loss, ref_params, ref_in_flight = _mlp_params_after(8, False, monkeypatch)
    assert ref_in_flight == 0
    assert loss == ref_loss
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


@pytest.mark.usefixtures("adaptive")
@pytest.mark.parametrize("read", ["cpu", "item"])
def test_a_host_read_reports_the_device_checks_of_the_fused_run_in_flight(read, monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", True)
    x = _GX.to("neuron").requires_grad_()
    host_read = {"cpu": torch.Tensor.cpu, "item": torch.Tensor.item}[read]
    other = torch.ones(3 if read == "cpu" else 1).to("neuron")   # .item(): later reads use a host copy

    def step(i):
        x.grad = None
        y = (x * 2).gather(1, i).sum()
        y.backward()   # cut at the end of backward: the fused run may overlap what follows
        return y

    for _ in range(3):
        step(_GOOD.to("neuron"))
        host_read(other)
        adaptive_mode.wait_for_compiles()
    hits = m("region_cache_hits")
    step(_BAD.to("neuron"))
    assert adaptive_mode.region.inflight is not None
    with pytest.raises(RuntimeError, match=_OUT_OF_RANGE):
        host_read(other)   # reads nothing the run produces, but waits for the device: reports its checks
    assert m("region_cache_hits") == hits + 1
    step(_GOOD.to("neuron"))
    assert x.grad.cpu().tolist() == [[0, 2, 0, 0], [0, 0, 2, 0], [2, 0, 0, 0]]


@pytest.mark.usefixtures("adaptive")
def test_joining_a_run_in_flight_keeps_storages_the_next_region_writes_pending(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", True)
    x = _GX.to("neuron").requires_grad_()
    other = torch.ones(3).to("neuron")

    def step():
        x.grad = None
        (x * 2).gather(1, _GOOD.to("neuron")).sum().backward()

    for _ in range(3):
        step()
        other.cpu()
        adaptive_mode.wait_for_compiles()
    step()
    assert adaptive_mode.region.inflight is not None   # it produces x.grad
    x.grad.mul_(3)     # recorded: the next region writes x.grad's storage
    other.cpu()        # joins the run in flight (it has device checks to report)
    assert x.grad.cpu().tolist() == [[0, 6, 0, 0], [0, 0, 6, 0], [6, 0, 0, 0]]


@pytest.mark.usefixtures("adaptive")
def test_an_overlapping_run_keeps_no_buffers_once_joined(monkeypatch):
    import weakref

    monkeypatch.setattr(torchneuron.config, "adaptive_overlap", True)
    from torchneuron.runtime import memory

    torch.manual_seed(0)
    model = MLP().to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.zeros(2, 4, dtype=torch.int64).to("neuron")
    weight = next(iter(model.parameters()))
    for i in range(5):   # fused from the third step: forward + backward, then SGD, each overlapping
        if i == 4:
            torch.neuron.synchronize()
            old = weakref.ref(memory.allocator.records[weight.data_ptr()].buf)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert adaptive_mode.region.inflight is not None or i < 3
        if i == 1:
            adaptive_mode.wait_for_compiles()
    torch.neuron.synchronize()
    gc.collect()
    # The weight's buffer from before the last step (an input of its SGD run) went with the step:
    # neither the worker thread nor the joined run holds it.
    assert old() is None


@pytest.mark.usefixtures("adaptive")
def test_a_fused_region_updates_the_storages_it_writes_in_place():
    """A compiled region donates the buffers of the storages it writes (an optimizer-like update):
    they keep their place step after step, no copy is made once it runs fused, the values are
    CPU's, and a storage that shared a written buffer keeps its own values."""
    from torchneuron.runtime import memory

    def address(t):
        return memory.record_of(t).buf.unsafe_buffer_pointer()

    w_cpu = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    m_cpu = torch.zeros(64, 48)
    w, m_ = w_cpu.to("neuron"), m_cpu.to("neuron")
    shared = torch.empty(64, 48, device="neuron")
    shared.copy_(w)                                # may share w's buffer: it must not be donated
    places, copies = [], None
    for step in range(10):
        m_.mul_(0.9).add_(w * 0.01 + 1)
        w.sub_(m_, alpha=0.1)
        torch.neuron.synchronize()
        m_cpu.mul_(0.9).add_(w_cpu * 0.01 + 1)
        w_cpu.sub_(m_cpu, alpha=0.1)
        if step == 3:
            adaptive_mode.wait_for_compiles()
        if step == 5:
            copies = m("extra").get("donation_copies", 0)
        if step >= 5:
            places.append((address(w), address(m_)))
    assert m("region_cache_hits") >= 5
    assert len(set(places)) == 1                   # written where they were
    assert m("extra").get("donation_copies", 0) == copies
    torch.testing.assert_close(w.cpu(), w_cpu)
    torch.testing.assert_close(m_.cpu(), m_cpu)
    assert torch.equal(shared.cpu(), torch.randn(64, 48, generator=torch.Generator().manual_seed(3)))
