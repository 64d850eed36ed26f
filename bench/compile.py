"""torch.compile(backend="neuron") on a GPT-style model, side by side in one run.

Forward and train-step (forward + backward + AdamW step, the whole step compiled) throughput for
neuron-compiled, neuron-eager, CPU eager and CPU torch.compile (Inductor), printed as ratios to
Inductor; then cold vs warm compile time, each measured in a fresh process against one new
persistent-cache directory (cold: empty cache; warm: the cache the cold process filled).

    .venv/bin/python bench/compile.py [--layers 4 --d-model 256 --heads 4 --seq 128 --batch 8]
                                      [--repeats 5] [--iters 5] [--skip-eager] [--skip-cold-warm]

The machine is shared and noisy: every configuration is timed in interleaved rounds and the
median round is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from torchneuron.runtime import pjrt


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight          # tied LM head

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make(args, device):
    torch.manual_seed(0)
    with torch.device(device):    # built in place: .to() of a module would untie the head
        model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    return model, opt, idx, tgt


def train_step_fn(model, opt):
    def step(idx, tgt):
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))
        loss.backward()
        opt.step()
        return loss
    return step


def sync(device, out=None):
    """Wait for the device: JAX dispatch is asynchronous, and an output nobody holds any more is
    invisible to torch.neuron.synchronize(), so block on the last result too."""
    if device == "neuron":
        if isinstance(out, torch.Tensor):
            from torchneuron.runtime import memory
            memory.record_of(out).buf.block_until_ready()
        torch.neuron.synchronize()


def configs(args):
    """name -> (forward thunk, train-step thunk, device)."""
    out = {}
    plans = [("neuron-compiled", "neuron", "neuron"), ("CPU Inductor", "cpu", "inductor"),
             ("CPU eager", "cpu", None)]
    if not args.skip_eager:
        plans.insert(1, ("neuron-eager", "neuron", None))
    for name, device, backend in plans:
        model, opt, idx, tgt = make(args, device)
        step = train_step_fn(model, opt)
        fwd_model = model
        if backend is not None:
            fwd_model = torch.compile(model, backend=backend)
            step = torch.compile(step, backend=backend)

        def fwd(m=fwd_model, i=idx):
            with torch.no_grad():
                return m(i)

        def train(s=step, i=idx, t=tgt):
            return s(i, t)
        out[name] = (fwd, train, device)
    return out


def measure(cfgs, which, args):
    """Median seconds per call for each config, timed in interleaved rounds."""
    index = 0 if which == "forward" else 1
    for name, thunks in cfgs.items():          # warm up (compiles happen here)
        start = time.perf_counter()
        for _ in range(2):
            out = thunks[index]()
        sync(thunks[2], out)
        print(f"  warm-up {which:8s} {name:16s} {time.perf_counter() - start:7.1f} s", flush=True)
    samples = {name: [] for name in cfgs}
    for _ in range(args.repeats):
        for name, thunks in cfgs.items():
            sync(thunks[2])
            # Let the previous config's worker threads (OpenMP, XLA's pool) stop spinning first:
            # otherwise they take cores from whichever config is timed next.
            time.sleep(0.5)
            start = time.perf_counter()
            for _ in range(args.iters):
                out = thunks[index]()
            sync(thunks[2], out)
            samples[name].append((time.perf_counter() - start) / args.iters)
    return {name: statistics.median(s) for name, s in samples.items()}


_COLD_WARM_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, torchneuron
sys.path.insert(0, {bench_dir!r})
import compile as bench
args = bench.parse({argv!r})
model, opt, idx, tgt = bench.make(args, "neuron")
step = torch.compile(bench.train_step_fn(model, opt), backend="neuron")
torchneuron.metrics.reset()
start = time.perf_counter()
step(idx, tgt).item()
first = time.perf_counter() - start
m = torchneuron.metrics()
print("RESULT" + json.dumps({{"first_step_s": first, "graph_compile_s": m["extra"].get("graph_compile_seconds", 0.0),
      "graphs_compiled": m["graphs_compiled"], "disk_hits": m["extra"].get("graph_persistent_cache_hits", 0),
      "index_hits": m["extra"].get("graph_index_hits", 0)}}))
"""


def cold_warm(argv):
    """First train step in two fresh processes sharing one new cache directory."""
    results = []
    with tempfile.TemporaryDirectory(prefix="tn-compile-cache-") as cache_dir:
        env = dict(os.environ, TORCHNEURON_CACHE_DIR=cache_dir)
        code = _COLD_WARM_CHILD.format(bench_dir=os.path.dirname(os.path.abspath(__file__)), argv=argv)
        for label in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                raise RuntimeError(f"{label} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            results.append(json.loads(line[len("RESULT"):]))
    return results


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-eager", action="store_true", help="leave neuron-eager out (it is slow)")
    p.add_argument("--skip-cold-warm", action="store_true")
    p.add_argument("--only-cold-warm", action="store_true", help="just the cold vs warm compile times")
    return p.parse_args(argv)


def main():
    argv = sys.argv[1:]
    args = parse(argv)
    # XLA:CPU flushes subnormals to zero (docs/reliability.md); CPU PyTorch keeps them, and this
    # loop trains on one fixed batch, whose gradients go subnormal after ~10 steps: CPU's backward
    # matmuls then slow 16x (both CPU configs' train steps, 13x their forward). Flushed on both
    # sides, the CPU configs time the arithmetic, as neuron's do.
    torch.set_flush_denormal(True)
    tokens = args.batch * args.seq
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}; torch {torch.__version__}, torchneuron "
          f"{torchneuron.__version__}, jax {__import__('jax').__version__}, torch threads "
          f"{torch.get_num_threads()}, XLA CPU pool threads {pjrt.describe_intra_op_pool()}; subnormals "
          f"flushed to zero on both sides")
    if not args.only_cold_warm:
        cfgs = configs(args)
        results = {}
        for which in ("forward", "train step"):
            results[which] = measure(cfgs, which, args)
        print()
        print(f"{'':18s}{'forward tok/s':>15s}{'vs Inductor':>13s}{'train tok/s':>15s}{'vs Inductor':>13s}")
        for name in cfgs:
            f, t = results["forward"][name], results["train step"][name]
            fi, ti = results["forward"]["CPU Inductor"], results["train step"]["CPU Inductor"]
            print(f"{name:18s}{tokens / f:15.0f}{fi / f:12.2f}x{tokens / t:15.0f}{ti / t:12.2f}x")
    if not args.skip_cold_warm:
        cold, warm = cold_warm(argv)
        print()
        print("first compiled train step in a fresh process (forward+backward+AdamW graphs):")
        for label, r in (("cold", cold), ("warm", warm)):
            print(f"  {label}: first step {r['first_step_s']:6.1f} s, of which graph compile "
                  f"{r['graph_compile_s']:6.2f} s; graphs compiled {r['graphs_compiled']}, loaded from "
                  f"the persistent cache {r['disk_hits']} ({r['index_hits']} straight from the graph index)")
        print(f"  warm vs cold: graph compile {cold['graph_compile_s'] / max(warm['graph_compile_s'], 1e-9):.1f}x "
              f"faster, first step {cold['first_step_s'] / warm['first_step_s']:.1f}x faster")
    print()
    print(torchneuron.metrics.summary())


if __name__ == "__main__":
    main()
