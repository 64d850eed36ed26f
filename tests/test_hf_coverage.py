"""The Hugging Face architecture sweep (``python -m tools.hf_coverage``).

CI runs a representative handful of architectures through the same check the sweep uses (neuron
against CPU: forward, backward, greedy generate); ``pytest -m slow tests/test_hf_coverage.py``
runs every causal-LM architecture of the installed transformers.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers.utils import logging as hf_logging  # noqa: E402

from tools import hf_coverage  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

# GPT-2: learned positions, Conv1D projections. Mixtral: mixture of experts (histc and grouped
# matmuls on neuron). Gemma 2: logit soft-capping, alternating sliding-window layers. Mamba: a
# state-space model with its own cache.
SUBSET = ["gpt2", "mixtral", "gemma2", "mamba"]


@pytest.fixture(autouse=True)
def _silent_fallback():
    import torchneuron
    old = torchneuron.config.fallback
    torchneuron.config.fallback = "silent"   # fallbacks are recorded per model, not warned
    yield
    torchneuron.config.fallback = old


@pytest.mark.parametrize("arch", SUBSET)
def test_architecture_matches_cpu(arch):
    row = hf_coverage.check_architecture(arch)
    assert row["status"] == "pass", f"{row['reason']}\n{row.get('traceback', '')}"
    assert row["forward"]["ok"] and row["backward"]["ok"] and row["generate"]["ok"]
    assert row["generate"]["tokens"] == hf_coverage.NEW_TOKENS
    # These run entirely on lowered ops.
    assert row["fallbacks"] == {}


def test_tiny_config_shrinks_every_size():
    cfg = hf_coverage.tiny_config("mixtral")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (hf_coverage.HIDDEN, hf_coverage.LAYERS,
                                                                       hf_coverage.VOCAB)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts) == (4, 2, 4)
    # Per-layer lists keep every kind of layer the full-size model has.
    cfg = hf_coverage.tiny_config("gemma2")
    assert sorted(set(cfg.layer_types)) == ["full_attention", "sliding_attention"]


def test_constant_weights_get_noise_so_routers_have_no_ties():
    model, _ = hf_coverage.build_model("mixtral")
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.unique().numel() > 1


def test_mismatch_is_reported_as_failure(monkeypatch):
    # A wrong neuron result must fail the architecture (the check compares, it does not just run).
    import torch
    original = torch.nn.functional.silu

    def wrong_on_neuron(x, inplace=False):
        out = original(x, inplace=inplace)
        return out * 1.01 if x.device.type == "neuron" else out

    monkeypatch.setattr(torch.nn.functional, "silu", wrong_on_neuron)
    row = hf_coverage.check_architecture("llama", generate=False)
    assert row["status"] == "fail" and "forward mismatch" in row["reason"], row


def test_report_lists_every_row_with_reason_and_fallbacks():
    rows = [
        {"arch": "a", "status": "pass", "reason": "", "fallbacks": {"foo.default": 2}, "seconds": 1,
         "forward": {"ok": True, "logits_max_abs_err": 1e-7, "loss_abs_err": 0.0},
         "backward": {"ok": True, "worst_rel_err": 1e-6, "worst_param": "w"}, "generate": {"ok": True, "tokens": 4}},
        {"arch": "b", "status": "fail", "reason": "backward mismatch: w relative error 0.5", "fallbacks": {},
         "seconds": 1, "forward": {"ok": True, "logits_max_abs_err": 1e-7, "loss_abs_err": 0.0},
         "backward": {"ok": False, "worst_rel_err": 0.5, "worst_param": "w"}},
        {"arch": "c", "status": "not-buildable", "reason": "needs an extra package: timm", "fallbacks": {},
         "seconds": 0},
    ]
    s = hf_coverage.summarise(rows)
    assert (s["buildable"], s["passed"], s["not_buildable"], s["forward_ok"], s["with_fallbacks"]) == (2, 1, 1, 2, 1)
    text = hf_coverage.render(rows, "cmd")
    assert "| a |" in text and "foo.default x2" in text
    assert "backward mismatch: w relative error 0.5" in text
    assert "needs an extra package: timm" in text
    assert "| pass forward + backward + generate | 1 | 50.0% of buildable |" in text


def test_model_keeping_last_forward_tensors_is_still_copied(monkeypatch):
    # Some models store tensors of their last forward as attributes (recurrent_gemma's recurrent
    # states): not graph leaves, so the model cannot be deep-copied after the CPU reference run.
    build = hf_coverage.build_model

    def build_with_state(model_type, seed=0):
        model, cfg = build(model_type, seed)
        model.register_forward_hook(lambda m, args, out: setattr(m, "last_logits", out.logits))
        return model, cfg

    monkeypatch.setattr(hf_coverage, "build_model", build_with_state)
    row = hf_coverage.check_architecture("llama", generate=False)
    assert row["status"] == "pass", f"{row['reason']}\n{row.get('traceback', '')}"


def test_resume_reruns_named_architectures_and_reports_the_whole_mapping(tmp_path, monkeypatch):
    import json

    results, report = tmp_path / "results.jsonl", tmp_path / "report.md"
    ran = []

    def fake_shard(archs, results, timeout, generate, run=None):   # the worker process, in-process
        for a in archs:
            ran.append(a)
            hf_coverage._append(results, {"arch": a, "status": "pass", "reason": "", "fallbacks": {}, "seconds": 1,
                                          "run": hf_coverage._run_info(run)})

    monkeypatch.setattr(hf_coverage, "_run_shard", fake_shard)
    monkeypatch.setattr(hf_coverage, "causal_lm_types", lambda: ["a", "b", "c"])
    results.write_text(json.dumps({"arch": "a", "status": "fail", "reason": "old bug", "fallbacks": {}, "seconds": 1})
                       + "\n" + json.dumps({"arch": "b", "status": "pass", "reason": "", "fallbacks": {},
                                            "seconds": 1}) + "\n")
    common = ["--results", str(results), "--output", str(report)]

    hf_coverage.main(["--resume", "a", *common])
    assert ran == ["a"]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["arch"] for r in rows] == ["b", "a"]          # the stale failure is gone, b is kept
    text = report.read_text()
    assert "old bug" not in text and "| b |" in text and "not run (sweep stopped before them: c)" in text
    command = f"python -m tools.hf_coverage --resume a --results {results} --output {report}"
    assert f"Generated by `{command}`" in text
    assert f"| `{command}` |" in text                       # a's row names the run that produced it
    assert "| not recorded (rows written before the tool recorded its command) |" in text   # b's

    hf_coverage.main(["--resume", *common])                  # none named: only the missing ones
    assert ran == ["a", "c"]
    assert "| pass forward + backward + generate | 3 | 100.0% of buildable |" in report.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("arch", hf_coverage.causal_lm_types())
def test_every_architecture(arch):
    row = hf_coverage.check_architecture(arch)
    if row["status"] == "not-buildable":
        pytest.skip(row["reason"])
    assert row["status"] == "pass", f"{row['reason']}\n{row.get('traceback', '')}"


def test_a_generate_cpu_cannot_run_is_not_compared_and_not_a_pass():
    """A failed CPU generate was recorded as ok (and the architecture as passing): nothing was
    compared."""
    class CannotGenerate:
        def generate(self, **kwargs):
            raise ValueError("this model cannot generate")

    row = {"fallbacks": {}}
    gen = hf_coverage._check_generate(CannotGenerate(), CannotGenerate(), torch.ones(1, 2, dtype=torch.long),
                                      torch.ones(1, 2, dtype=torch.long), row)
    assert gen["ok"] is None and gen["not_compared"].startswith("CPU generate fails: ")
    ok = {"ok": True, "logits_max_abs_err": 1e-7, "loss_abs_err": 0.0}
    rows = [{"arch": "a", "status": "generate-not-compared", "reason": gen["not_compared"], "fallbacks": {},
             "seconds": 1, "forward": ok, "backward": {"ok": True, "worst_rel_err": 1e-6, "worst_param": "w"},
             "generate": gen}]
    s = hf_coverage.summarise(rows)
    assert (s["passed"], s["generate_checked"], s["generate_ok"], s["generate_not_compared"]) == (0, 0, 0, 1)
    text = hf_coverage.render(rows, "cmd")
    assert "not compared (CPU cannot)" in text
    assert "| pass forward + backward + generate | 0 |" in text
