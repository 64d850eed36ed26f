"""A stream of requests with a long tail of lengths, per mode, side by side: CPU eager, CPU Inductor
(``dynamic=True``), neuron eager (plain and adaptive) and ``torch.compile(backend="neuron")``, each with
``config.shapes`` "static" and "bucketed".

A GPT-style model (embedding, causal attention, LayerNorm, GELU MLP, tied head) serves a stream of
batches whose sequence lengths follow a long-tail (log-normal) distribution. Each mode runs in a
fresh process with an empty persistent cache, so every compile is a real one. Printed per mode:
distinct lengths, executables compiled (graphs, eager ops and the small programs a storage needs to
get a bucket's capacity), compile seconds, the stream's wall time including compiles, and the P50 /
P99 latency per request of a second pass over the same stream (everything compiled: warm; the modes
run one after another, so compare their latencies with ``bench/shapes_request.py --stream``, which
interleaves them in one process). Also printed: the padding waste
of several bucket ladders (padded tokens that carry no data, over all padded tokens).

    .venv/bin/python bench/shapes.py [--requests 200] [--max-len 256] [--train] [--modes ...]
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

MODES = ("cpu-eager", "cpu-inductor", "eager-static", "eager-bucketed", "adaptive-static", "adaptive-bucketed",
         "compiled-static", "compiled-bucketed")


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

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_shapes_bucketed import TinyGPT

    mode = args.mode
    on_neuron = not mode.startswith("cpu")
    if on_neuron:
        import torchneuron
        torchneuron.config.shapes = mode.split("-")[1]
        torchneuron.config.shape_buckets = args.buckets
        if mode.startswith("adaptive"):
            torchneuron.config.eager_mode = "adaptive"
    torch.manual_seed(0)
    device = "neuron" if on_neuron else "cpu"
    model = TinyGPT(vocab=256, d=args.d_model, heads=4, layers=2).to(device)
    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.recompile_limit = 1024
    if mode == "cpu-inductor":
        f = torch.compile(model, dynamic=True)
    elif mode.startswith("compiled"):
        # static: Dynamo specialises every shape (dynamic=False, as TorchNeuron compiles); bucketed:
        # one symbolic trace.
        f = torch.compile(model, backend="neuron", dynamic=mode == "compiled-bucketed")
    else:
        f = model
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if args.train else None
    lens = lengths(args.requests, args.max_len)

    def compiled_so_far():
        if not on_neuron:
            return 0
        m = torchneuron.metrics()
        return m["executables_compiled"] + m["extra"].get("bucketed_pad_compiles", 0)

    def request(t):
        ids = torch.randint(0, 256, (args.batch, t)).to(device)
        if args.train:
            loss = f(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
        else:
            with torch.no_grad():
                f(ids)[:, -1].sum().item()

    if on_neuron:
        torchneuron.metrics.reset()
    start = time.perf_counter()
    for t in lens:              # the stream as it comes: compiles included
        request(t)
    wall = time.perf_counter() - start
    compiled = compiled_so_far()
    warm = []
    for t in lens:              # the same stream again, everything compiled: warm latency
        t0 = time.perf_counter()
        request(t)
        warm.append(time.perf_counter() - t0)
    recompiled = compiled_so_far() - compiled
    row = {"mode": mode, "distinct": len(set(lens)), "wall_s": wall, "threads": torch.get_num_threads(),
           "p50_ms": 1e3 * float(np.percentile(warm, 50)) if warm else None,
           "p99_ms": 1e3 * float(np.percentile(warm, 99)) if warm else None, "warm": len(warm)}
    row["recompiled"] = recompiled
    if on_neuron:
        m = torchneuron.metrics()
        row.update(executables=compiled, compile_s=m["compile_seconds"],
                   fallbacks=m["extra"].get("bucketed_fallbacks", 0) + m["extra"].get("bucketed_eager_fallbacks", 0))
    print(json.dumps(row))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--train", action="store_true")
    p.add_argument("--buckets", default="pow2")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return run_mode(args)
    lens = lengths(args.requests, args.max_len)
    print(f"{args.requests} requests, {len(set(lens))} distinct lengths, median {int(np.median(lens))}, "
          f"max {max(lens)}, batch {args.batch}; {'train step' if args.train else 'inference'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    for ladder in ("pow2", "pow2:8", "16,24,32,48,64,96,128,192,256"):
        w, n = waste(lens, ladder)
        print(f"  ladder {ladder:<32} buckets used {n:2d}  padding waste {w:5.1%}")
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHNEURON_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
            cmd = [sys.executable, __file__, "--mode", mode, "--requests", str(args.requests),
                   "--max-len", str(args.max_len), "--batch", str(args.batch), "--d-model", str(args.d_model),
                   "--buckets", args.buckets] + (["--train"] if args.train else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{mode}: failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'mode':<19}{'executables':>12}{'per length':>11}{'compile s':>11}{'wall s':>9}"
          f"{'warm P50 ms':>12}{'warm P99 ms':>12}")
    for r in rows:
        ex = r.get("executables")
        print(f"{r['mode']:<19}{'-' if ex is None else ex:>12}"
              f"{'-' if ex is None else format(ex / r['distinct'], '.2f'):>11}"
              f"{'-' if ex is None else format(r['compile_s'], '.2f'):>11}{r['wall_s']:>9.2f}"
              f"{_ms(r['p50_ms']):>12}{_ms(r['p99_ms']):>12}")
    by = {r["mode"]: r for r in rows}
    for kind in ("eager", "adaptive", "compiled"):
        s, b = by.get(f"{kind}-static"), by.get(f"{kind}-bucketed")
        if s and b:
            print(f"{kind} bucketed / static: executables {b['executables'] / max(s['executables'], 1):.2f}, "
                  f"compile seconds {b['compile_s'] / max(s['compile_s'], 1e-9):.2f}, "
                  f"wall {b['wall_s'] / s['wall_s']:.2f}")
    # Each mode ran in its own process, one after another, so warm latencies of two modes were not
    # measured side by side: no ratio of them is printed here.
    print("warm latency of one mode against another, measured side by side: "
          "bench/shapes_request.py --stream N (the modes interleaved in one process)")
    print(f"(torch threads {rows[0]['threads'] if rows else '?'} in every mode)")


def _ms(v):
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
