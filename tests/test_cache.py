"""The executable cache: same shapes compile nothing new, new scalars compile nothing, new shapes one;
views share executables; a second process loads what the first compiled."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchneuron


def compiled():
    return torchneuron.metrics()["executables_compiled"]


def test_same_shapes_hit_the_cache():
    a = torch.randn(5, 7, device="neuron")
    b = torch.randn(5, 7, device="neuron")
    torch.add(a, b)
    before = compiled()
    hits = torchneuron.metrics()["cache_hits"]
    for _ in range(10):
        torch.add(a, b)
    assert compiled() == before
    assert torchneuron.metrics()["cache_hits"] == hits + 10


def test_new_scalar_value_compiles_nothing():
    p = torch.randn(4, 4, device="neuron")
    g = torch.randn(4, 4, device="neuron")
    p.add_(g, alpha=-0.1)
    before = compiled()
    for lr in (0.01, 0.02, 1e-5, 3.0):
        p.add_(g, alpha=-lr)
        p.mul_(1 - lr)
        p.clamp_(min=-lr)
    assert compiled() == before + 2  # mul_.Scalar and clamp_ once each, never per value


def test_runtime_scalar_cache_keeps_taking_values_once_full(monkeypatch):
    """A long run brings new scalar values every step (an optimizer's bias corrections, each used for
    every parameter): once the bounded cache is full, the oldest value leaves and the new one is
    cached, so the repeats within a step reuse one device array instead of each making its own."""
    from torchneuron.runtime import values

    monkeypatch.setattr(values, "_CACHED_VALUES", 8)
    monkeypatch.setitem(values._scalar_arrays, float, {})
    for i in range(20):
        values.scalar_array(0.5 + i)
    first = values.scalar_array(1234.25)
    assert values.scalar_array(1234.25) is first
    assert len(values._scalar_arrays[float]) == 8
    assert float(first) == 1234.25
    offsets_full = dict.fromkeys(range(values._CACHED_OFFSETS), None)
    monkeypatch.setattr(values, "_offset_arrays", offsets_full)
    assert values.offset_array(values._CACHED_OFFSETS + 7) is values.offset_array(values._CACHED_OFFSETS + 7)
    assert len(values._offset_arrays) == values._CACHED_OFFSETS


def test_new_shape_compiles_exactly_one():
    small, wide = torch.randn(3, 3, device="neuron"), torch.randn(6, 2, device="neuron")
    torch.relu(small)
    before = compiled()
    torch.relu(wide)
    assert compiled() == before + 1
    torch.relu(wide)
    assert compiled() == before + 1


def test_optimizer_learning_rate_schedule_compiles_nothing_new():
    model = torch.nn.Linear(8, 4).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(2, 8, device="neuron")

    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()

    step()
    step()
    before = compiled()
    for _ in range(4):
        step()
    assert compiled() == before


# -- views: a storage offset is a runtime input, so loops over rows and windows compile a bounded
# number of executables (a handful, not one per iteration), with values identical to CPU.
def _compiles_during(fn, *args):
    before = compiled()
    result = fn(*args)
    return compiled() - before, result


def test_loop_over_rows_compiles_a_bounded_number():
    x = torch.randn(64, 16)
    w = torch.randn(16)
    xn, wn = x.to("neuron"), w.to("neuron")

    def loop(a, b):
        total = torch.zeros(16, device=a.device)
        for i in range(64):
            total = total + a[i] * b
        return total

    n, got = _compiles_during(loop, xn, wn)
    assert n <= 3, n          # zeros, mul, add: never one per row
    torch.testing.assert_close(got.cpu(), loop(x, w))
    n, _ = _compiles_during(loop, xn, wn)
    assert n == 0


def test_sliding_windows_compile_once_per_op():
    x = torch.randn(64, 32)
    xn = x.to("neuron")

    def window_sum(t, r, c):
        return (t[r:r + 32, c:c + 8] * 2).sum()

    window_sum(xn, 0, 0)    # the first window compiles; every other one hits the cache
    n = 0
    for r in range(0, 33, 4):
        for c in range(0, 25, 3):
            k, got = _compiles_during(window_sum, xn, r, c)
            n += k
            torch.testing.assert_close(got.cpu(), window_sum(x, r, c))
    assert n <= 2, n


def test_select_narrow_slice_with_python_ints():
    x = torch.randn(12, 10, 6)
    xn = x.to("neuron")
    ops = [lambda t, i: torch.select(t, 1, i).exp(), lambda t, i: t.narrow(0, i, 4).neg(),
           lambda t, i: t[:, i:i + 3, 1::2].abs(), lambda t, i: t[i, :, i % 6].sin()]
    for op in ops:
        op(xn, 0)
        op(xn, 1)
        n = 0
        for i in range(2, 8):
            k, got = _compiles_during(op, xn, i)
            n += k
            torch.testing.assert_close(got.cpu(), op(x, i))
        assert n == 0, (op, n)


def test_writing_a_cache_row_by_row():
    torch.manual_seed(0)
    T, D = 64, 16
    h, w = torch.randn(T, D), torch.randn(D, D)
    cache = torch.zeros(T, D)
    hn, wn, cn = h.to("neuron"), w.to("neuron"), cache.to("neuron")

    def write_row(c, h, w, t):
        c[t].copy_(h[t] @ w)

    write_row(cn, hn, wn, 0)
    write_row(cn, hn, wn, 1)
    n = 0
    for t in range(2, T):
        k, _ = _compiles_during(write_row, cn, hn, wn, t)
        n += k
    assert n == 0, n
    for t in range(T):
        write_row(cache, h, w, t)
    torch.testing.assert_close(cn.cpu(), cache)


def test_in_place_updates_through_strided_views():
    x = torch.randn(8, 8)
    xn = x.to("neuron")

    def scale_column(t, i):
        return t[:, i].mul_(i + 1)   # a column: strided, offset i

    n = 0
    for i in range(8):
        k, _ = _compiles_during(scale_column, xn, i)
        n += k if i >= 2 else 0
        x[:, i].mul_(i + 1)
        xn[i, i:].add_(1.5)       # a row tail: a new length is a new shape, so this one compiles
        x[i, i:].add_(1.5)
    assert n == 0, n
    torch.testing.assert_close(xn.cpu(), x)


def test_compile_reasons_are_counted():
    a = torch.randn(4, 4, device="neuron")
    torch.special.erfcx(a)
    torch.special.erfcx(torch.randn(5, 4, device="neuron"))
    torch.special.erfcx(a.t())
    torch.special.erfcx(a.to(torch.bfloat16))
    reasons = torchneuron.metrics()["eager_compiles"]
    assert reasons.get("new op", 0) >= 1
    assert reasons.get("new shape", 0) >= 1
    assert reasons.get("new layout", 0) >= 1
    assert reasons.get("new dtype", 0) >= 1


def test_views_into_compiled_graphs_share_an_executable():
    x = torch.randn(16, 8)
    xn = x.to("neuron")
    fn = torch.compile(lambda t: (t * 2 + 1).sum(), backend="neuron")
    fn(xn[0])
    fn(xn[1])
    m = torchneuron.metrics()
    before = (m["graphs_compiled"], sum(m["recompiles"].values()))
    for i in range(2, 16):
        torch.testing.assert_close(fn(xn[i]).cpu(), (x[i] * 2 + 1).sum())
    m = torchneuron.metrics()
    assert (m["graphs_compiled"], sum(m["recompiles"].values())) == before


# -- persistence: a second process loads the eager executables the first one compiled -------------
_EAGER_RUN = textwrap.dedent("""
    import json, torch, torchneuron
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    model = model.to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xn, yn = x.to("neuron"), y.to("neuron")
    for i in range(0, 32, 8):          # row slices: offsets are runtime inputs
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xn[i:i + 8]), yn[i:i + 8])
        loss.backward()
        opt.step()
    drop = torch.nn.functional.dropout(torch.ones(64, device="neuron"), 0.5).sum()
    # LAPACK-backed ops (XLA custom calls): a loaded executable must find its LAPACK routines.
    a = torch.randn(6, 6)
    spd = a @ a.T + 6 * torch.eye(6)
    linalg = {"cholesky": lambda m: torch.linalg.cholesky(m), "qr": lambda m: torch.linalg.qr(m).R.abs(),
              "eigvalsh": torch.linalg.eigvalsh, "solve": lambda m: torch.linalg.solve(m, m[:, :2]),
              "svdvals": torch.linalg.svdvals}
    linalg_err = max((f(spd.to("neuron")).cpu() - f(spd)).abs().max().item() for f in linalg.values())
    m = torchneuron.metrics()
    print("RESULT" + json.dumps({"compiled": m["executables_compiled"], "loaded": m["eager_cache_loads"],
                                  "loss": loss.item(), "drop": drop.item(), "linalg_err": linalg_err,
                                  "bucketed": m["extra"].get("bucketed_eager_compiles", 0)}))
""")


def _eager_run(env):
    proc = subprocess.run([sys.executable, "-c", _EAGER_RUN], env=env, capture_output=True, text=True,
                          timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT"):])


def test_second_process_loads_eager_executables_and_runs_them_correctly(tmp_path):
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"))
    cold = _eager_run(env)
    warm = _eager_run(env)
    assert cold["compiled"] > 20 and cold["loaded"] == 0
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"]
    assert warm["loss"] == cold["loss"] and warm["drop"] == cold["drop"]   # same RNG stream too
    assert cold["linalg_err"] < 1e-3 and warm["linalg_err"] == cold["linalg_err"]
    stored = list((tmp_path / "cache" / "eager").glob("*.tnexe"))
    # Bucketed eager programs (config.shapes="bucketed") are kept by JAX's persistent cache instead.
    assert len(stored) == cold["compiled"] - cold["bucketed"]


@pytest.mark.parametrize("name", ["view out", "mutate and view", "as_strided, own offset", "as_strided, offset 5"])
def test_graphs_on_views_with_runtime_offsets_match_eager(name):
    fn = {"view out": lambda t: t[1:],
          "mutate and view": lambda t: t.add_(1)[1:],
          # as_strided indexes the storage: from the input's own offset when none is given (this
          # call's, a runtime input), from an absolute offset when one is.
          "as_strided, own offset": lambda t: torch.as_strided(t, (2,), (1,)) * 2,
          "as_strided, offset 5": lambda t: torch.as_strided(t, (2,), (1,), 5) * 2}[name]
    base = torch.arange(40.).reshape(8, 5)
    nbase = base.to("neuron")
    compiled_fn = torch.compile(fn, backend="neuron")
    for i in range(1, 6):
        torch.testing.assert_close(compiled_fn(nbase[i]).cpu(), fn(base[i]).clone())
        torch.testing.assert_close(nbase.cpu(), base)
    assert torchneuron.metrics()["graphs_compiled"] <= 1


# -- what the fingerprint of stored executables covers -------------------------------------------
_PACKAGE = os.path.dirname(os.path.abspath(torchneuron.__file__))


def test_fingerprint_hashes_the_code_that_decides_executables():
    from torchneuron.runtime import executable_store
    hashed = {os.path.relpath(p, _PACKAGE) for p in executable_store.fingerprint_sources()}
    assert "config.py" in hashed and "runtime/executable_store.py" in hashed
    assert os.path.join("ops", "data", "cpu_dtype_refusals.json") in hashed
    for part in ("runtime", "ops", "eager", "compile", "kernels"):
        for directory, _, files in os.walk(os.path.join(_PACKAGE, part)):
            for f in files:
                if f.endswith((".py", ".json")):
                    assert os.path.relpath(os.path.join(directory, f), _PACKAGE) in hashed
    outside = [p for p in hashed if p.split(os.sep)[0] in ("report", "distributed", "integrations", "tools")
               or p in ("cli.py", "profiler.py", "metrics.py", "__init__.py", "__main__.py")]
    assert not outside
    assert not os.path.exists(os.path.join(_PACKAGE, "tools"))   # developer tools are not installed


_SMALL_RUN = textwrap.dedent("""
    import json
    import torch
    import torchneuron
    x = torch.arange(6.0, device="neuron")
    y = ((x * 3 + 1).sin().sum()).item()
    m = torchneuron.metrics()
    print("RESULT" + json.dumps({"compiled": m["executables_compiled"], "loaded": m["eager_cache_loads"],
                                  "y": y, "package": torchneuron.__file__}))
""")


def test_editing_report_or_tool_code_leaves_a_warm_cache_warm(tmp_path):
    """A fresh process on a copy of the package: editing the report, the CLI or the profiler keeps
    the executables an earlier process stored; editing a lowering module invalidates them."""
    import shutil
    copy = tmp_path / "site" / "torchneuron"
    shutil.copytree(_PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))

    def run():
        proc = subprocess.run([sys.executable, "-c", _SMALL_RUN], env=env, capture_output=True, text=True,
                              timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
        assert line is not None, proc.stderr[-3000:]
        result = json.loads(line[len("RESULT"):])
        assert result["package"].startswith(str(copy))
        return result

    def edit(relpath):
        with open(copy / relpath, "a") as f:
            f.write("\n# edited\n")

    cold = run()
    assert cold["compiled"] > 0 and cold["loaded"] == 0
    for relpath in ("report/render.py", "cli.py", "profiler.py", "metrics.py"):
        edit(relpath)
    warm = run()
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"] and warm["y"] == cold["y"]
    edit("ops/elementwise.py")
    invalidated = run()
    assert invalidated["loaded"] == 0 and invalidated["compiled"] == cold["compiled"]
