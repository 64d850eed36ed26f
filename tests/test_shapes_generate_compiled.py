"""Hugging Face generate() with the static cache and torch.compile(backend="neuron", dynamic=True)
under config.shapes="bucketed": one prefill graph per prompt-length bucket (plus the exact graph
of the first prompt) and one decode graph, tokens equal to CPU's (docs/shapes.md, "generate() with
the static cache and torch.compile")."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import torchneuron

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import generate_shapes  # noqa: E402


@pytest.fixture
def bucketed(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "")     # counts must not be served from disk
    monkeypatch.setattr(torchneuron.config, "shapes", "bucketed")
    monkeypatch.setattr(torchneuron.config, "shape_buckets", "pow2")
    torch._dynamo.reset()
    torchneuron.metrics.reset()
    yield
    torch._dynamo.reset()


def test_index_copy_with_dynamic_positions_drops_the_pad(bucketed):
    # A StaticCache update: keys.index_copy_(2, positions, new) with as many positions as the
    # prompt is long. The pad positions must write nothing (a pad index 0 would clobber row 0).
    def update(cache, positions, new):
        return cache.index_copy(1, positions, new) * 2

    f = torch.compile(update, backend="neuron", dynamic=True)
    cache = torch.randn(2, 32, 4)
    for n in (3, 5, 7, 11):
        positions = torch.randperm(30, generator=torch.Generator().manual_seed(n))[:n] + 2
        new = torch.randn(2, n, 4)
        got = f(cache.to("neuron"), positions.to("neuron"), new.to("neuron"))
        torch.testing.assert_close(got.cpu(), update(cache, positions, new))
    m = torchneuron.metrics()
    assert m["graphs_compiled"] == 2        # 3 exactly, then the bucket 16 for 5, 7 and 11
    assert not any("index_copy" in k for k in m["extra"])
    # A true position out of range is still reported, as on CPU (the pad is not what is checked).
    with pytest.raises(IndexError, match="index 40 is out of bounds for dimension 1 with size 32"):
        f(cache.to("neuron"), torch.tensor([1, 2, 40, 3, 4, 5]).to("neuron"), torch.randn(2, 6, 4).to("neuron")).cpu()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_compiles_one_prefill_graph_per_bucket_and_one_decode_graph(bucketed, kind):
    lengths = [5, 9, 13, 17, 23, 29]
    generate_shapes.generate_stream(kind, lengths, new_tokens=3, compiled=True, max_cache_len=64, layers=1)
    m = torchneuron.metrics()
    # Six lengths: the first prompt's exact prefill (5), the buckets 16 (9, 13) and 32 (17, 23,
    # 29), and one decode graph; generate's own bookkeeping stays on the host (no eager compile).
    assert m["graphs_compiled"] == 4, m["recompiles"]
    assert m["executables_compiled"] == 4
    assert sum(m["eager_compiles"].values()) == 0
    prefill = [per for per in m["bucket_compiles"].values()]
    assert prefill == [{16: 1, 32: 1}]
    assert not any("index_copy" in k for k in m["extra"])
