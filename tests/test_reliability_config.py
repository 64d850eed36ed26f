"""Settings and on-disk caches: unusable folders are a warning (the caches are optional), invalid
values name their setting and variable whether they come from the environment or an assignment,
the platform cannot silently change under a running runtime, and the size of XLA's CPU thread pool
follows its setting without leaking NPROC into the environment."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torchneuron
from torchneuron.config import Config


@pytest.fixture
def blocker(tmp_path):
    """A regular file: any folder below it can never be created."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def _compile_and_run(scale):
    f = torch.compile(lambda x: x * scale + 1, backend="neuron")
    x = torch.arange(4.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x.to("neuron")).cpu()
    torch.testing.assert_close(out, x * scale + 1)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("setting, variable, scale", [("cache_dir", "TORCHNEURON_CACHE_DIR", 3.0),
                                                      ("dump_dir", "TORCHNEURON_DUMP_DIR", 7.0)])
def test_unusable_cache_or_dump_folder_warns_and_compiles(blocker, setting, variable, scale):
    old = getattr(torchneuron.config, setting)
    setattr(torchneuron.config, setting, str(blocker / "sub"))
    try:
        torch._dynamo.reset()
        messages = _compile_and_run(scale)   # a graph this process has not compiled yet
        assert any(f"{blocker / 'sub'}' cannot be used" in m and variable in m for m in messages), messages
        torch._dynamo.reset()
        # Warned once per folder, not at every compile.
        assert not any("cannot be used" in m for m in _compile_and_run(scale + 2))
    finally:
        setattr(torchneuron.config, setting, old)
        torch._dynamo.reset()


def test_invalid_environment_values_name_the_variable():
    with pytest.raises(ValueError, match=r"TORCHNEURON_ADAPTIVE_MAX_OPS='abc' is not an integer"):
        Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": "abc"})
    with pytest.raises(ValueError, match=r"TORCHNEURON_ADAPTIVE_MAX_OPS.*at least 1"):
        Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": "0"})
    with pytest.raises(ValueError, match=r"TORCHNEURON_FLOAT64.*one of"):
        Config.from_env({"TORCHNEURON_FLOAT64": "double"})
    with pytest.raises(ValueError, match=r"TORCHNEURON_CPU_INTRA_OP_THREADS='many' is not an integer or 'auto'"):
        Config.from_env({"TORCHNEURON_CPU_INTRA_OP_THREADS": "many"})
    with pytest.raises(ValueError, match=r"cpu_intra_op_threads \(environment variable "
                                         r"TORCHNEURON_CPU_INTRA_OP_THREADS\) must be at least 1, got 0"):
        Config.from_env({"TORCHNEURON_CPU_INTRA_OP_THREADS": "0"})
    cfg = Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": " 64 ", "TORCHNEURON_FALLBACK": " Error",
                           "TORCHNEURON_PLATFORM": "CPU", "TORCHNEURON_CPU_INTRA_OP_THREADS": " 3 "})
    assert (cfg.adaptive_max_ops, cfg.fallback, cfg.platform, cfg.cpu_intra_op_threads) == (64, "error", "cpu", 3)
    assert Config.from_env({"TORCHNEURON_CPU_INTRA_OP_THREADS": " Auto "}).cpu_intra_op_threads == "auto"
    assert Config.from_env({}).cpu_intra_op_threads == "auto"


@pytest.mark.parametrize("name, value, error, message", [
    ("adaptive_max_ops", "abc", TypeError, "must be an integer"),
    ("adaptive_max_ops", 0, ValueError, "must be at least 1"),
    ("adaptive_max_ops", True, TypeError, "must be an integer"),
    ("cache_dir", 5, TypeError, "must be a string"),
    ("dump_dir", None, TypeError, "must be a string"),
    ("float64", "double", ValueError, "must be one of"),
    ("platform", "", ValueError, "must name a PJRT platform"),
    ("fallbak", "error", AttributeError, "did you mean 'fallback'"),
    ("cpu_intra_op_threads", 0, ValueError, "must be at least 1, got 0"),
    ("cpu_intra_op_threads", "two", TypeError, "must be an integer or 'auto', got 'two'"),
    ("cpu_intra_op_threads", 2.0, TypeError, "must be an integer or 'auto'"),
    ("cpu_intra_op_threads", True, TypeError, "must be an integer or 'auto'"),
], ids=["int-text", "int-zero", "int-bool", "str-int", "str-none", "choice", "platform", "typo",
        "threads-zero", "threads-text", "threads-float", "threads-bool"])
def test_run_time_assignments_are_validated(name, value, error, message):
    before = dict(vars(torchneuron.config))
    with pytest.raises(error, match=message):
        setattr(torchneuron.config, name, value)
    assert dict(vars(torchneuron.config)) == before
    if name in before:
        assert f"TORCHNEURON_{name.upper()}" in str(_raised(name, value))


def _raised(name, value):
    try:
        setattr(torchneuron.config, name, value)
    except Exception as err:   # noqa: BLE001
        return err


def test_assignments_are_normalised_like_the_environment(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "fallback", " Silent ")
    assert torchneuron.config.fallback == "silent"


def test_platform_cannot_change_under_a_running_runtime():
    (torch.ones(2, device="neuron") + 1).cpu()
    current = torchneuron.config.platform
    with pytest.raises(RuntimeError, match=r"cannot change to 'tpu'.*already runs on 'cpu'.*TORCHNEURON_PLATFORM=tpu"):
        torchneuron.config.platform = "tpu"
    assert torchneuron.config.platform == current
    assert "platform" not in torchneuron.config.non_defaults()
    torchneuron.config.platform = current.upper()   # the same platform: accepted
    assert (torch.ones(2, device="neuron") * 3).cpu().tolist() == [3.0, 3.0]


_POOL = "tf_XLAEigen"   # the name XLA gives the threads of its CPU intra-op (Eigen) pool


def _pool_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:   # the thread ended
            pass
    return names.count(_POOL)


_POOL_CHILD = """
import json, os, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    if {jax_first}:
        import jax
        jax.devices()
    import torch
    import torchneuron
    x = torch.ones(256, 256, device="neuron")
    (x @ x).cpu()
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({{"threads": names.count({pool!r}), "nproc": os.environ.get("NPROC"),
                  "warnings": [str(w.message) for w in caught if "cpu_intra_op_threads" in str(w.message)]}}))
"""


def _pool_child(setting, nproc, jax_first=False):
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "TORCHNEURON_CPU_INTRA_OP_THREADS")}
    env["TORCHNEURON_CPU_INTRA_OP_THREADS"] = setting
    if nproc is not None:
        env["NPROC"] = nproc
    code = _POOL_CHILD.format(jax_first=jax_first, pool=_POOL)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("setting, nproc, threads", [
    ("1", None, 1),      # fewer threads than cores
    ("3", None, 3),      # more threads than cores: the setting, not the machine, decides
    ("3", "2", 3),       # an explicit setting wins over the user's NPROC, which is restored
    ("auto", "2", 2),    # under "auto" the user's NPROC wins
])
def test_cpu_pool_follows_the_setting_and_leaves_nproc_alone(setting, nproc, threads):
    out = _pool_child(setting, nproc)
    assert out == {"threads": threads, "nproc": nproc, "warnings": []}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_auto_keeps_xla_pool_of_one_thread_per_core():
    from torchneuron.runtime import pjrt
    (torch.ones(64, 64, device="neuron") @ torch.ones(64, 64, device="neuron")).cpu()
    if pjrt._pool_started_with != "auto" or os.environ.get("NPROC"):
        pytest.skip("the pool size of this process was chosen by its environment or an earlier test")
    assert _pool_threads() == len(os.sched_getaffinity(0))
    assert "NPROC" not in os.environ


def test_pool_setting_after_the_client_started_warns_once(monkeypatch):
    from torchneuron.runtime import pjrt
    (torch.ones(2, device="neuron") + 1).cpu()
    monkeypatch.setattr(pjrt, "_pool_warned", False)
    other = 7 if pjrt._pool_started_with != 7 else 5
    with pytest.warns(UserWarning, match=rf"cpu_intra_op_threads={other} has no effect.*started already.*"
                                         r"TORCHNEURON_CPU_INTRA_OP_THREADS"):
        monkeypatch.setattr(torchneuron.config, "cpu_intra_op_threads", other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchneuron.config.cpu_intra_op_threads = other + 1   # said once is enough


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_pool_setting_after_jax_started_its_client_warns():
    out = _pool_child("1", None, jax_first=True)
    assert out["nproc"] is None
    assert len(out["warnings"]) == 1, out
    assert "JAX created its CPU client before torchneuron" in out["warnings"][0] and "NPROC=1" in out["warnings"][0]
    assert out["threads"] == len(os.sched_getaffinity(0))   # XLA's own choice: one per core
