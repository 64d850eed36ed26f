"""`torchneuron doctor` and `torchneuron check --preflight`: each planted fault is a named FAIL with its
way out and exit status 1 (2 for check); a healthy environment passes every check."""

import json
import os
import socket
import subprocess
import sys

import pytest

import torchneuron
from torchneuron.report import doctor

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(torchneuron.__file__)))
_LAUNCHER = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "XLA_FLAGS")


def _env(cache_dir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_") and k not in _LAUNCHER}
    env["PYTHONPATH"] = _SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TORCHNEURON_CACHE_DIR"] = str(cache_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _doctor(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "torchneuron", "doctor", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _checks(proc) -> dict:
    return {c["check"]: c for c in json.loads(proc.stdout)["checks"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_healthy_run_passes_every_check(tmp_path):
    proc = _doctor(_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[6:].split("  ")[0].strip(): line[:5].strip() for line in proc.stdout.splitlines()[:-1]
            if not line.startswith(" ")}
    assert set(rows) == set(doctor.CHECKS)
    assert rows["collective"] == "skip" and "FAIL" not in rows.values()
    assert "0 failed" in proc.stdout.splitlines()[-1]


def test_json_parses_and_names_a_mistyped_setting(tmp_path):
    (tmp_path / "cache").mkdir()
    proc = _doctor(_env(tmp_path / "cache", TORCHNEURON_FLOAT64="keep", TORCHNEURON_CAHCE_DIR="x"), "--json")
    assert proc.returncode == 0, proc.stderr   # a warning is not a failure
    data = json.loads(proc.stdout)
    assert data["ok"] is True and [c["check"] for c in data["checks"]] == list(doctor.CHECKS)
    checks = _checks(proc)
    assert checks["platform"]["device_count"] == 1
    assert checks["versions"]["versions"]["torchneuron"] == torchneuron.__version__
    settings = checks["settings"]
    assert settings["status"] == "warn" and settings["settings"]["float64"] == "keep"
    assert "TORCHNEURON_CAHCE_DIR (did you mean TORCHNEURON_CACHE_DIR?)" in settings["detail"]
    cache = checks["cache folder"]
    assert cache["status"] == "ok" and cache["entries"] == 0 and "cold" in cache["detail"]


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unwritable_cache_folder_fails_naming_it(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    folder = blocker if where == "a file" else blocker / "cache"
    proc = _doctor(_env(folder))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAIL  cache folder"))
    assert str(folder) in line
    assert "way out: make " + str(folder) in proc.stdout
    assert sum(x.startswith("FAIL") for x in proc.stdout.splitlines()) == 1


def test_a_rank_without_its_device_fails_naming_rank_and_count(tmp_path):
    proc = _doctor(_env(tmp_path / "cache", LOCAL_RANK=3, RANK=0, WORLD_SIZE=1), "--json")
    assert proc.returncode == 1, proc.stderr
    checks = _checks(proc)
    bad = checks["rank device"]
    assert bad["status"] == "FAIL"
    assert "rank 0 (LOCAL_RANK=3, WORLD_SIZE=1): neuron:3 does not exist, this process sees 1 device(s)" in bad["detail"]
    assert "--nproc-per-node 1" in bad["fix"]
    assert checks["collective"]["status"] == "skip"
    assert [c["check"] for c in checks.values() if c["status"] == "FAIL"] == ["rank device"]


def test_two_ranks_all_reduce_on_their_own_devices(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torchneuron", "doctor", "--json", "--timeout", "60"],
                              env=_env(tmp_path / "cache", LOCAL_RANK=r, RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out + err
        checks = {c["check"]: c for c in json.loads(out)["checks"]}
        assert checks["rank device"]["device"] == f"neuron:{r}"
        assert checks["collective"]["status"] == "ok"
        assert f"neuron:{r} tensor across 2 ranks" in checks["collective"]["detail"]


def test_a_rank_whose_peers_never_come_fails_the_collective_with_the_way_out(tmp_path):
    port = _free_port()
    proc = _doctor(_env(tmp_path / "cache", LOCAL_RANK=0, RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port), "--json", "--timeout", "2")
    assert proc.returncode == 1, proc.stderr
    coll = _checks(proc)["collective"]
    assert coll["status"] == "FAIL"
    assert f"all_reduce across 2 ranks (MASTER_ADDR=127.0.0.1, MASTER_PORT={port}) failed" in coll["detail"]
    assert "MASTER_ADDR/MASTER_PORT" in coll["fix"] and "'neuron'" in coll["fix"] and "--timeout" in coll["fix"]


def test_the_collective_names_missing_rendezvous_variables():
    out = doctor.collective("neuron:0", 0, 2, 5.0, environ={"MASTER_PORT": "1"})
    assert out["status"] == "FAIL" and out["detail"] == "MASTER_ADDR not set for a 2-rank group"


def test_a_single_rank_collective_runs_in_process(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    out = doctor.collective("neuron:0", 0, 1, 30.0)
    assert out["status"] == "ok", out
    import torch.distributed as dist
    assert not dist.is_initialized()   # the check's own group is gone again


def test_a_restricted_rank_sees_its_device_as_neuron_0():
    env = {"LOCAL_RANK": "2", "RANK": "2", "WORLD_SIZE": "4"}
    out = doctor.rank_device(env, 1, "auto", "cuda")
    assert out["status"] == "ok" and out["device"] == "neuron:0" and out["physical_device"] == 2
    assert doctor.rank_device(env, 0, "auto", "cuda")["status"] == "FAIL"
    bad = doctor.rank_device({"LOCAL_RANK": "x"}, 1, "auto", "cpu")
    assert bad["status"] == "FAIL" and "LOCAL_RANK='x' is not an integer" in bad["detail"]


def test_the_cache_check_leaves_no_trace(tmp_path):
    folder = tmp_path / "a" / "b"
    out = doctor.check_cache(str(folder))
    assert out["status"] == "ok" and "created at first use" in out["detail"]
    assert list(tmp_path.iterdir()) == []
    assert doctor.check_cache("")["status"] == "warn"


def test_check_preflight_lets_a_healthy_environment_run_the_script(tmp_path):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run([sys.executable, "-m", "torchneuron", "check", "--preflight", "-q", "-o", str(tmp_path / "r"),
                           "--", sys.executable, str(script)], env=_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torchneuron doctor: 0 failed" in proc.stdout and marker.exists()


def test_check_preflight_stops_before_the_script(tmp_path):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "-m", "torchneuron", "check", "--preflight", "-o", str(tmp_path / "r"),
                           "--", sys.executable, str(script)], env=_env(blocker), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"FAIL  cache folder     {blocker} is a file, not a folder" in proc.stdout
    assert "the preflight failed" in proc.stderr and not marker.exists()


def test_versions_warn_off_the_pinned_stack_naming_what_differs():
    pinned = {"python": "3.11.9", "torch": "2.13.0+cpu", "jax": "0.10.2", "jaxlib": "0.10.2",
              "numpy": "2.0", "torchneuron": "0"}
    assert doctor.check_versions(pinned)["status"] == "ok"
    older = dict(pinned, python="3.12.1", torch="2.11.0+cu130")
    result = doctor.check_versions(older, ["_foreach_mm.default"])
    assert result["status"] == "warn" and result["absent_lowerings"] == ["_foreach_mm.default"]
    assert "python 3.12.1 (pinned 3.11)" in result["detail"] and "torch 2.11.0+cu130 (pinned 2.13.0)" in result["detail"]
    assert "jax 0.10.2 (pinned" not in result["detail"] and "Tested combinations" in result["fix"]
