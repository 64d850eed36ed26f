"""torchneuron.warmup: shape buckets compiled ahead of traffic into the persistent cache, so that a
second process serving the same traffic compiles nothing (config.shapes="bucketed")."""

import json
import os
import subprocess
import sys

import pytest
import torch

import torchneuron
from torchneuron import shape_warmup

_SERVE = r"""
import json, sys, torch, torchneuron
sys.path.insert(0, {tests!r})
from test_shapes_bucketed import TinyGPT
torchneuron.config.shapes = "bucketed"
torch.manual_seed(0)
cpu = TinyGPT(vocab=50, d=32, heads=2, layers=1).eval()
dev = TinyGPT(vocab=50, d=32, heads=2, layers=1).eval()
dev.load_state_dict(cpu.state_dict())
dev = dev.to("neuron")
f = torch.compile(dev, backend="neuron", dynamic=True) if {mode!r} == "compiled" else dev
ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
w = torchneuron.warmup(lambda x: f(x).sum().item(), ids.to("neuron"), [16, 32, 64])
before = torchneuron.metrics()["executables_compiled"]
with torch.no_grad():
    for t in (11, 20, 27, 40, 50, 63):
        x = torch.randint(0, 50, (2, t), generator=torch.Generator().manual_seed(t))
        torch.testing.assert_close(f(x.to("neuron")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
print(json.dumps({{"warmup": w["executables_compiled"], "serving": torchneuron.metrics()["executables_compiled"] - before,
                  "sizes": w["sizes"]}}))
"""


def _serve(mode, cache_dir):
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(cache_dir))
    code = _SERVE.format(tests=os.path.dirname(__file__), mode=mode)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_second_process_serving_after_warmup_compiles_nothing(tmp_path, mode):
    first = _serve(mode, tmp_path)
    assert first["warmup"] > 0 and first["sizes"] == [16, 32, 64]
    if mode == "compiled":
        assert first["serving"] == 0        # every bucket compiled by the warm-up
    second = _serve(mode, tmp_path)
    assert second == {"warmup": 0, "serving": 0, "sizes": [16, 32, 64]}


def test_resized_inputs_and_the_errors(monkeypatch):
    t = torch.arange(6).reshape(2, 3)
    assert shape_warmup.resized(t, 1, 7).tolist() == [[0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 3, 4, 5, 3]]
    assert shape_warmup.resized(t, 1, 2).tolist() == [[0, 1], [3, 4]]
    assert shape_warmup._lengths([16, 32, 64]) == [15, 31, 63]
    assert shape_warmup._lengths([2, 3, 8]) == [2, 3, 7]
    monkeypatch.setattr(torchneuron.config, "shapes", "static")
    with pytest.raises(RuntimeError, match="config.shapes = 'bucketed'"):
        torchneuron.warmup(lambda x: x, t, [16])
    monkeypatch.setattr(torchneuron.config, "shapes", "bucketed")
    with pytest.raises(ValueError, match="at least 2"):
        torchneuron.warmup(lambda x: x, t, [1])
