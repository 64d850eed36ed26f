"""A stream of requests with a long tail of lengths: config.shapes "static" vs "bucketed", side by side.

A GPT-style model (embedding, causal attention, LayerNorm, GELU MLP, tied head) compiled with
``torch.compile(backend="neuron")`` (``dynamic=True`` for the bucketed mode) serves a stream of batches whose sequence lengths
follow a long-tail distribution (most short, a few long). Each mode runs in a fresh process with
no persistent cache, so every compile is a real one; printed per mode: distinct lengths, graphs
compiled, small pad/cut executables, compile seconds, wall seconds, and for the bucket ladders the
padding waste (padded tokens that carry no data, over all padded tokens).

    .venv/bin/python bench/shapes.py [--requests 40] [--max-len 256] [--train] [--d-model 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def lengths(n, max_len, seed=0):
    rng = np.random.default_rng(seed)
    # Log-normal: most requests short, a long tail up to max_len.
    out = np.clip(np.round(rng.lognormal(mean=3.0, sigma=0.8, size=n)), 2, max_len).astype(int)
    return [int(x) for x in out]


def waste(lens, ladder):
    from torchneuron.compile.dynamic import bucket_for, parse_buckets
    b = parse_buckets(ladder)
    padded = [bucket_for(n, b) for n in lens]
    return 1 - sum(lens) / sum(padded), len(set(padded))


def run_mode(args):
    import torch

    import torchneuron
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_shapes_bucketed import TinyGPT

    torchneuron.config.shapes = args.mode
    torchneuron.config.shape_buckets = args.buckets
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=args.d_model, heads=4, layers=2).to("neuron")
    # static: Dynamo specialises every shape (dynamic=False, as TorchNeuron compiles); bucketed: one
    # symbolic trace. (torch.compile(module, dynamic=True) with the static setting retraces the
    # module graph per shape and fails on nn.Embedding's norm_type constant on this stack.)
    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.recompile_limit = 1024
    f = torch.compile(model, backend="neuron", dynamic=args.mode == "bucketed")
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if args.train else None
    lens = lengths(args.requests, args.max_len)
    torchneuron.metrics.reset()
    start = time.perf_counter()
    for t in lens:
        ids = torch.randint(0, 256, (args.batch, t)).to("neuron")
        if args.train:
            loss = f(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
        else:
            with torch.no_grad():
                f(ids)[:, -1].sum().item()
    wall = time.perf_counter() - start
    m = torchneuron.metrics()
    extra = m["extra"]
    print(json.dumps({
        "mode": args.mode, "distinct": len(set(lens)), "graphs": m["graphs_compiled"],
        "pad_cut": extra.get("bucketed_pad_compiles", 0) + extra.get("bucketed_cut_compiles", 0),
        "compile_s": extra.get("graph_compile_seconds", 0.0), "wall_s": wall,
        "fallbacks": extra.get("bucketed_fallbacks", 0)}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--train", action="store_true")
    p.add_argument("--buckets", default="pow2")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return run_mode(args)
    lens = lengths(args.requests, args.max_len)
    print(f"{args.requests} requests, {len(set(lens))} distinct lengths, median {int(np.median(lens))}, "
          f"max {max(lens)}; {'train step' if args.train else 'inference'}")
    for ladder in ("pow2", "pow2:8", "16,24,32,48,64,96,128,192,256"):
        w, n = waste(lens, ladder)
        print(f"  ladder {ladder:<32} buckets used {n:2d}  padding waste {w:5.1%}")
    rows = []
    for mode in ("static", "bucketed"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHNEURON_CACHE_DIR=cache)
            cmd = [sys.executable, __file__, "--mode", mode, "--requests", str(args.requests),
                   "--max-len", str(args.max_len), "--batch", str(args.batch), "--d-model", str(args.d_model),
                   "--buckets", args.buckets] + (["--train"] if args.train else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'mode':<10}{'graphs':>8}{'pad/cut':>9}{'compile s':>11}{'wall s':>9}")
    for r in rows:
        print(f"{r['mode']:<10}{r['graphs']:>8}{r['pad_cut']:>9}{r['compile_s']:>11.2f}{r['wall_s']:>9.2f}")
    s, b = rows
    print(f"bucketed / static: graphs {b['graphs'] / max(s['graphs'], 1):.2f}, compile seconds "
          f"{b['compile_s'] / max(s['compile_s'], 1e-9):.2f}, wall {b['wall_s'] / s['wall_s']:.2f}")


if __name__ == "__main__":
    main()
