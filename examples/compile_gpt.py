"""Train a small GPT with torch.compile(backend="neuron"), on variable-length batches.

Shapes are static on neuron (every new shape is a new executable), so sequences are padded to a
few bucket lengths first. The whole train step -- forward, backward and AdamW -- is compiled.

    .venv/bin/python examples/compile_gpt.py
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron

PAD = 0


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, layers=2, max_len=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(steps, batch=8, vocab=256, seed=0):
    """Token batches of random lengths (a repeating pattern the model can learn)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        length = int(torch.randint(20, 200, (1,), generator=g))
        start = torch.randint(1, vocab, (batch, 1), generator=g)
        yield (start + torch.arange(length + 1)) % (vocab - 1) + 1


def main():
    with torch.device("neuron"):          # built on the device: keeps the tied head tied
        model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    @torch.compile(backend="neuron")
    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD)
        loss.backward()
        opt.step()
        return loss

    start = time.perf_counter()
    for step, tokens in enumerate(batches(60)):
        # Lengths 20..200 map onto 3 shapes (128, 256 and their padding), not 180.
        length = torchneuron.bucket_length(tokens.shape[1] - 1, buckets=(64, 128, 256))
        tokens = torchneuron.pad_to_multiple(tokens, multiple=length + 1, value=PAD)
        tokens = tokens.to("neuron")
        loss = train_step(tokens[:, :-1], tokens[:, 1:])
        if step % 10 == 0:
            print(f"step {step:3d}  length {length:3d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    m = torchneuron.metrics()
    print(f"\n{elapsed:.1f} s; graphs compiled {m['graphs_compiled']} (+{m['extra'].get('graph_persistent_cache_hits', 0)} "
          f"loaded from {torchneuron.config.cache_dir}), recompiles {dict(m['recompiles'])}, "
          f"graph breaks {sum(m['graph_breaks'].values())}, CPU fallbacks {m['fallback_count']}")


if __name__ == "__main__":
    main()
