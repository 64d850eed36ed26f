"""Hugging Face ``generate()`` in eager mode with the default (growing) cache: ``config.shapes``
"static" against "bucketed".

A tiny random model (2 layers, hidden 32) generates 16 greedy tokens for each of 12 prompts of
lengths 5 to 120; every output is asserted equal to CPU's. Printed: eager compiles, compile
seconds and the wall time of the neuron runs (CPU's runs are not timed). Run each mode in a fresh
process with the persistent cache off:

    TORCHNEURON_CACHE_DIR= .venv/bin/python bench/generate_shapes.py bucketed llama   # or qwen2, gpt2
"""

from __future__ import annotations

import copy
import sys
import time

import torch

import torchneuron


def model_config(kind):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    common = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, **common)


def main():
    shapes, kind = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "llama"
    from transformers import AutoModelForCausalLM
    torchneuron.config.shapes = shapes
    torch.manual_seed(0)
    cpu = AutoModelForCausalLM.from_config(model_config(kind)).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    lens = [5, 9, 17, 23, 31, 40, 57, 77, 99, 120, 13, 45]
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    torchneuron.metrics.reset()
    neuron_s = 0.0
    for i, n in enumerate(lens):
        ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            want = cpu.generate(ids, **gen)
            start = time.perf_counter()
            got = dev.generate(ids.to("neuron"), **gen).cpu()
            neuron_s += time.perf_counter() - start
        assert torch.equal(want, got), (n, want, got)
    m = torchneuron.metrics()
    compiles = sum(m["eager_compiles"].values())
    fallbacks = {k: v for k, v in m["extra"].items() if "fallback" in k}
    print(f"{kind} {shapes}: {len(lens)} prompts, tokens equal to CPU's; {compiles} eager compiles "
          f"({compiles / len(lens):.1f} per prompt), compile {m['compile_seconds']:.1f} s, "
          f"neuron wall {neuron_s:.1f} s; fallbacks {fallbacks or 'none'}")


if __name__ == "__main__":
    main()
