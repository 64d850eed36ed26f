"""CPU platform: freed device memory stays with the process (config.cpu_retain_freed_memory), so a
loop's large buffers are not page-faulted in again every iteration; empty_cache gives it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchneuron.runtime import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None or not sys.platform.startswith("linux"),
                                reason="glibc's malloc only")

_CHILD = textwrap.dedent("""
    import json, resource, torch, torchneuron
    from torchneuron.runtime import host_memory

    def step():   # two 64 MiB device buffers made and freed, as a training step's activations
        t = torch.ones(16 * 2**20, device="neuron")
        return (t * 2).sum().item()

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    values = [step() for _ in range(4)]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
    kept = rss()
    torch.neuron.empty_cache()
    print(json.dumps({"retained": host_memory.retained(), "faults": faults, "values": values,
                      "rss_kept": kept, "rss_after_empty_cache": rss()}))
""")


def _run(retain: str) -> dict:
    env = dict(os.environ, TORCHNEURON_CPU_RETAIN_FREED_MEMORY=retain, TORCHNEURON_PLATFORM="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_device_memory_is_reused_without_page_faults_and_empty_cache_returns_it():
    on, off = _run("1"), _run("0")
    assert on["retained"] and not off["retained"]
    assert on["values"] == off["values"] == [2.0 * 16 * 2**20] * 4
    pages = 2 * 64 * 2**20 // 4096   # the two buffers, in 4 KiB pages
    assert off["faults"] > 0.9 * pages, off   # glibc maps and unmaps each buffer
    assert on["faults"] < off["faults"] / 3, (on, off)   # the heap keeps them
    # empty_cache hands the kept memory back (at least one of the two 64 MiB buffers).
    assert on["rss_kept"] - on["rss_after_empty_cache"] > 64 * 2**20, on


def test_off_platforms_and_off_switch_leave_glibc_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_retained", False)
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append("retain"))
    host_memory.follow(False)
    assert calls == [] and not host_memory.retained()
    host_memory.follow(True)
    assert calls == ["retain"]
