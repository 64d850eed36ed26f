"""Greedy generation with a Hugging Face causal LM on the neuron device.

    python examples/hf_generate.py                 # a tiny random Llama built from a config
    python examples/hf_generate.py /path/to/model  # a model folder written by save_pretrained

The model is loaded straight onto neuron (``device_map="neuron"``) and generates with the static
KV cache, which transformers compiles with ``torch.compile(backend="neuron")``: one graph serves
every decoding step. The CPU run of the same model is printed alongside as the reference.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # nothing is downloaded

import torch  # noqa: E402  (loads torchneuron through the torch.backends entry point)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import torchneuron  # noqa: E402


def model_folder() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    folder = tempfile.mkdtemp(prefix="tiny-llama-")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def main() -> None:
    folder = model_folder()
    cpu = AutoModelForCausalLM.from_pretrained(folder).eval()
    neuron = AutoModelForCausalLM.from_pretrained(folder, device_map="neuron").eval()
    ids = torch.randint(3, cpu.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=16, do_sample=False, cache_implementation="static")

    want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    for attempt in ("first call (compiles)", "second call (cached)"):
        start = time.perf_counter()
        got = neuron.generate(ids.to("neuron"), attention_mask=torch.ones_like(ids).to("neuron"), **kwargs)
        print(f"neuron generate, {attempt}: {time.perf_counter() - start:.2f} s")
    print("tokens:", got[0, ids.shape[1]:].tolist())
    print("same tokens as CPU:", torch.equal(got.cpu(), want))
    print(torchneuron.metrics.summary())


if __name__ == "__main__":
    main()
