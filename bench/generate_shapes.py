"""Hugging Face ``generate()`` under variable prompt lengths, ``config.shapes`` "static" against
"bucketed".

A tiny random model (2 layers, hidden 32) generates 16 greedy tokens for each of 12 prompts of
lengths 5 to 120; every output is asserted equal to CPU's. Run each mode in a fresh process with
the persistent cache off:

    TORCHNEURON_CACHE_DIR= .venv/bin/python bench/generate_shapes.py bucketed llama   # or qwen2, gpt2

``static`` / ``bucketed``: eager mode with the default (growing) cache; printed: eager compiles,
compile seconds, the wall time of the neuron runs (CPU's runs are not timed).

``compiled-static-cache``: bucketed shapes, ``model.forward`` compiled with
``torch.compile(backend="neuron", dynamic=True)``, a ``StaticCache`` of a fixed length
(``cache_implementation="static"``, ``max_cache_len``), prompts passed from the host so that
generate's own bookkeeping (masks, the growing sequence) stays on the CPU. Printed: graphs
compiled (prefill and decode), executables in all, eager compiles, Dynamo recompiles, compile
seconds and wall. ``--device-ids`` passes the prompts on the device instead (generate's bookkeeping
then runs as bucketed eager ops).
"""

from __future__ import annotations

import copy
import sys
import time

import torch

import torchneuron

LENGTHS = [5, 9, 17, 23, 31, 40, 57, 77, 99, 120, 13, 45]


def model_config(kind, layers=2):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    common = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=256, **common)
    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, **common)


def compile_for_generate(model):
    """The recipe of docs/shapes.md ("generate() with the static cache and torch.compile")."""
    model.forward = torch.compile(model.forward, backend="neuron", dynamic=True)
    return model


def static_cache_kwargs(max_cache_len=256):
    # A fixed cache length: the decode graph's shapes never change, and the prefill's cache is
    # compiled at that length (without it, each longer prompt reallocates the cache).
    return dict(cache_implementation="static", max_cache_len=max_cache_len)


def generate_stream(kind, lens, new_tokens=16, *, compiled=False, device_ids=False, max_cache_len=256, layers=2):
    """Generate for every prompt length on CPU and on neuron, asserting equal tokens; returns the
    seconds spent in the neuron runs."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cpu = AutoModelForCausalLM.from_config(model_config(kind, layers)).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    dev_gen = dict(gen)
    if compiled:
        compile_for_generate(dev)
        dev_gen.update(static_cache_kwargs(max_cache_len))
    neuron_s = 0.0
    for i, n in enumerate(lens):
        ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            want = cpu.generate(ids, **gen)
            start = time.perf_counter()
            got = dev.generate(ids.to("neuron") if device_ids or not compiled else ids, **dev_gen).cpu()
            neuron_s += time.perf_counter() - start
        assert torch.equal(want, got), (kind, n, want, got)
    return neuron_s


def main():
    mode, kind = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "llama"
    device_ids = "--device-ids" in sys.argv
    compiled = mode == "compiled-static-cache"
    torchneuron.config.shapes = "bucketed" if compiled else mode
    torchneuron.metrics.reset()
    neuron_s = generate_stream(kind, LENGTHS, compiled=compiled, device_ids=device_ids)
    m = torchneuron.metrics()
    compiles = sum(m["eager_compiles"].values())
    fallbacks = {k: v for k, v in m["extra"].items() if "fallback" in k}
    if compiled:
        where = "device" if device_ids else "host"
        print(f"{kind} compiled-static-cache (prompts on the {where}): {len(LENGTHS)} prompts, tokens equal "
              f"to CPU's; {m['graphs_compiled']} graphs (prefill buckets "
              f"{_prefill_buckets(m)}), {m['executables_compiled']} executables, {compiles} eager compiles, "
              f"Dynamo recompiles {sum(n for r, n in m['recompiles'].items() if 'bucket' not in r)}, "
              f"compile {m['compile_seconds']:.1f} s (Dynamo tracing {_dynamo_seconds():.1f} s), neuron wall "
              f"{neuron_s:.1f} s; fallbacks {fallbacks or 'none'}")
        return
    print(f"{kind} {mode}: {len(LENGTHS)} prompts, tokens equal to CPU's; {compiles} eager compiles "
          f"({compiles / len(LENGTHS):.1f} per prompt), compile {m['compile_seconds']:.1f} s, "
          f"neuron wall {neuron_s:.1f} s; fallbacks {fallbacks or 'none'}")


def _dynamo_seconds():
    from torch._dynamo.utils import compilation_time_metrics
    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))


def _prefill_buckets(m):
    return sorted({b for per in m["bucket_compiles"].values() for b in per})


if __name__ == "__main__":
    main()
