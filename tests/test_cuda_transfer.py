"""CUDA scripts run unchanged on neuron: torchneuron.transfer_cuda() / TORCHNEURON_CUDA=neuron,
the mapping `torchneuron check --device-map cuda=neuron` also uses. The oracle is the same script's
CPU path (CUDA is absent on the test machines)."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torchneuron
from torchneuron.report import devmap

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script, *args, cuda=None):
    env = dict(os.environ)
    env.pop("TORCHNEURON_CUDA", None)
    # The torchneuron under test, wherever the script runs from.
    src = os.path.dirname(os.path.dirname(os.path.abspath(torchneuron.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if cuda:
        env["TORCHNEURON_CUDA"] = cuda
    out = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                         timeout=600, cwd=HERE)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_cuda_training_script_runs_unchanged_and_matches_cpu():
    cpu, _ = _run(os.path.join(HERE, "scripts", "cuda_train.py"))
    neuron, stderr = _run(os.path.join(HERE, "scripts", "cuda_train.py"), cuda="neuron")
    assert cpu["info"]["param_device"] == "cpu" and neuron["info"]["param_device"] == "neuron"
    assert len(neuron["losses"]) == len(cpu["losses"]) == 8
    assert neuron["losses"] == pytest.approx(cpu["losses"], rel=1e-4, abs=1e-5)
    assert neuron["info"]["amp_dtype"] == cpu["info"]["amp_dtype"] == "torch.bfloat16"
    assert torch.allclose(torch.tensor(neuron["info"]["amp_out"]), torch.tensor(cpu["info"]["amp_out"]),
                          atol=3e-2, rtol=3e-2)
    for key in ("elapsed_ms_positive", "allocated", "peak_ge", "stats", "summary", "rng_state", "pinned"):
        assert neuron["info"][key] is True, key
    assert neuron["info"]["zeros_device"] == "neuron"
    # One warning, naming what was mapped.
    assert stderr.count("CUDA is mapped onto neuron") == 1 and ".cuda()" in stderr


def test_transfer_cuda_in_process_maps_and_unmaps():
    assert not torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = torchneuron.transfer_cuda()
        assert torchneuron.transfer_cuda() is dm   # installed once, warned once
    try:
        assert sum("CUDA is mapped onto neuron" in str(w.message) for w in caught) == 1
        assert torch.cuda.is_available() and torch.cuda.device_count() == torch.neuron.device_count()
        assert torch.ones(2, device="cuda:0").device == torch.device("neuron", 0)
        assert torch.cuda.memory.memory_allocated() == torch.neuron.memory.memory_allocated()
        assert torch.cuda.memory_summary is torch.neuron.memory.memory_summary
        assert isinstance(torch.cuda.Event(enable_timing=True), torch.neuron.Event)
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
        torch.cuda.manual_seed(3)
        a = torch.randn(4, device="cuda")
        torch.cuda.manual_seed(3)
        assert torch.equal(a.cpu(), torch.randn(4, device="neuron").cpu())
        with torch.autocast("cuda"):
            out = torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")
        assert out.dtype == torch.float16 == torch.get_autocast_dtype("neuron")
        assert torch.amp.GradScaler("cuda")._device == "neuron"
    finally:
        dm.uninstall()
    assert not torch.cuda.is_available()
    assert torch.cuda.memory.memory_allocated is not torch.neuron.memory.memory_allocated
    # The readiness report's --device-map is the same mapping.
    assert devmap.DeviceMap is type(dm)
    # torch.compile still knows PyTorch's factories (a neuron op's first run under the mapping used
    # to fill Dynamo's table of torch functions with the mapping's wrappers).
    compiled = torch.compile(lambda v: v + torch.arange(4, device=v.device), backend="neuron", fullgraph=True)
    assert torch.equal(compiled(torch.ones(4, device="neuron")).cpu(), torch.arange(4) + 1.0)


HF_SCRIPT = r"""
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging
logging.set_verbosity_error()
device = sys.argv[1]
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).eval().to(device)
ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
with torch.no_grad():
    logits = model(input_ids=ids).logits
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                         min_new_tokens=4, do_sample=False)
print(json.dumps({"device": str(logits.device.type), "logits": logits[:, -1].float().cpu().tolist(),
                  "tokens": out.cpu().tolist()}))
"""


def test_hugging_face_script_with_device_cuda_runs_on_neuron(tmp_path):
    pytest.importorskip("transformers")
    script = tmp_path / "hf_cuda.py"
    script.write_text(HF_SCRIPT)
    cpu, _ = _run(str(script), "cpu")
    neuron, _ = _run(str(script), "cuda", cuda="neuron")
    assert neuron["device"] == "neuron"
    assert neuron["tokens"] == cpu["tokens"]
    assert torch.allclose(torch.tensor(neuron["logits"]), torch.tensor(cpu["logits"]), atol=1e-4)
