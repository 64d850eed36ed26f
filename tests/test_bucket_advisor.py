"""The bucket advisor of the readiness report (report/buckets.py): exact least-padding bucket sets,
the cost of a ladder on a histogram, the proposal's trade-off, and the report section."""

from __future__ import annotations

import itertools
import random

from torchneuron.report import analyze, buckets, render


def _padding(hist, ladder):
    c = buckets.ladder_cost(hist, ladder)
    return c["padded"] - c["real"]


def test_best_ladders_are_the_least_padding_sets_of_each_size():
    rng = random.Random(0)
    for _ in range(30):
        sizes = sorted(rng.sample(range(5, 120), rng.randint(1, 7)))
        hist = [(s, rng.randint(1, 9)) for s in sizes]
        best = buckets.best_ladders(hist)
        assert sorted(best) == list(range(1, len(sizes) + 1))
        for k, ladder in best.items():
            assert len(ladder) == k and ladder[-1] == sizes[-1]
            brute = min(_padding(hist, (*combo, sizes[-1]))
                        for combo in itertools.combinations(sizes[:-1], k - 1))
            assert _padding(hist, ladder) == brute


def test_ladder_cost_counts_compiles_padding_and_calls_above_the_largest():
    hist = [(7, 2), (13, 1), (30, 3), (61, 1), (300, 1)]
    c = buckets.ladder_cost(hist, [16, 32, 64, 128])
    assert c["compiles"] == 4                # 16, 32, 64 and 300's own shape
    assert c["over_largest"] == 1
    assert c["real"] == 7 * 2 + 13 + 30 * 3 + 61 + 300
    assert c["padded"] == 16 * 2 + 16 + 32 * 3 + 64 + 300
    assert abs(c["waste"] - (c["padded"] - c["real"]) / c["padded"]) < 1e-12


def test_proposal_trades_compiles_against_padding():
    hist = [(s, 10) for s in (7, 9, 12, 17, 25, 31, 44, 63, 87, 120)]
    cheap_compiles = buckets.propose(hist, compile_seconds=0.01, element_seconds=1e-3)
    costly_compiles = buckets.propose(hist, compile_seconds=60.0, element_seconds=1e-6)
    assert len(cheap_compiles["ladder"]) > len(costly_compiles["ladder"])
    assert costly_compiles["ladder"] == [120]
    untimed = buckets.propose(hist)
    assert untimed["model"] == "compiles x padded/real"
    k, chosen = len(untimed["ladder"]), untimed["cost"]
    for other in untimed["frontier"].values():   # nothing on the frontier costs less
        assert chosen["compiles"] * chosen["padded"] / chosen["real"] <= \
            other["compiles"] * other["padded"] / other["real"] + 1e-12
    assert 1 <= k <= len(hist)


def test_advise_reads_the_counters_also_after_a_json_round_trip():
    metrics = {"dynamic_sizes": {"g0_forward input 0 dim 1": {"7": 2, "13": 1, "29": 4}},
               "bucket_compiles": {"g0_forward input 0 dim 1": {"16": 1, "32": 1}},
               "dynamic_ladders": {"g0_forward input 0 dim 1": [16, 32, 64]}}
    (entry,) = buckets.advise(metrics)
    assert entry["calls"] == 7 and entry["distinct"] == 3
    assert entry["today"]["compiles"] == 2 and entry["measured_compiles"] == {16: 1, 32: 1}
    today = entry["today"]
    assert entry["proposal"]["objective"] <= today["compiles"] * today["padded"] / today["real"]
    assert entry["proposal"]["ladder"] == [29]   # one compile for 39% more work beats two for 21%


def test_the_report_shows_today_and_the_proposal_side_by_side():
    run = analyze.empty_run("neuron", "synthetic")
    run["status"]["outcome"] = "ok"
    dim = "g0_forward input 0 dim 1"
    run["metrics"].update({"dynamic_sizes": {dim: {s: 3 for s in (7, 9, 13, 30, 61, 100, 180, 300)}},
                           "bucket_compiles": {dim: {16: 1, 32: 1, 64: 1, 128: 1, 256: 1, 512: 1}},
                           "dynamic_ladders": {dim: [16, 32, 64, 128, 256, 512]}})
    report = analyze.build(run)
    md = render.to_markdown(report)
    assert "## Variable shapes" in md and dim in md
    today = buckets.ladder_cost(buckets._histogram(run["metrics"]["dynamic_sizes"][dim]),
                                [16, 32, 64, 128, 256, 512])
    assert f"{100 * today['waste']:.1f}%" in md
    proposed = report["shapes"][0]["proposal"]["cost"]
    assert ", ".join(map(str, proposed["buckets"])) in md


def test_a_bucketed_compile_stream_feeds_the_advisor(monkeypatch):
    import torch

    import torchneuron

    torch._dynamo.reset()
    torchneuron.metrics.reset()
    monkeypatch.setattr(torchneuron.config, "shapes", "bucketed")
    monkeypatch.setattr(torchneuron.config, "shape_buckets", "pow2")

    def f(x):
        return (x * 2).softmax(0).sum(0)

    cf = torch.compile(f, backend="neuron", dynamic=True)
    lengths = [7, 13, 29, 30, 13, 61]
    for n in lengths:
        x = torch.linspace(-3, 3, n * 4).reshape(n, 4)
        assert torch.allclose(cf(x.to("neuron")).cpu(), f(x), atol=1e-6)
    m = torchneuron.metrics()
    (dim,) = [d for d, sizes in m["dynamic_sizes"].items() if len(sizes) > 1]   # the other dim stays 4
    assert m["dynamic_sizes"][dim] == {7: 1, 13: 2, 29: 1, 30: 1, 61: 1}
    assert m["bucket_compiles"][dim] == {16: 1, 32: 1, 64: 1}
    assert m["dynamic_ladders"][dim] == "pow2 from 16"
    (entry,) = [e for e in buckets.advise(m) if e["dim"] == dim]
    assert entry["today"]["compiles"] == 3 and entry["today"]["buckets"] == [16, 32, 64]
    torch._dynamo.reset()
