"""Architecture coverage of Hugging Face causal LMs on neuron: ``python -m torchneuron.tools.hf_coverage``.

For every entry of the installed transformers' causal-LM auto mapping it builds a tiny
random-weight configuration (few layers, small hidden size, small vocabulary; nothing downloaded),
instantiates the model on CPU, and compares neuron against that CPU oracle:

* forward: logits and loss (labels = inputs);
* backward: the gradient of every parameter;
* greedy ``generate()``: token for token (dynamic cache), when forward passed.

Each architecture ends as ``pass``, ``fail`` (with the first mismatch or error) or ``not-buildable``
(its configuration or model cannot be instantiated offline without extra packages, with the reason).
The CPU fallbacks each model used on neuron are recorded. Results go to ``docs/hf_coverage.md``.

Architectures run in a worker process (compiled executables are shared between models of equal
shapes); a worker that crashes or hangs is replaced and the architecture is recorded as failed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torchneuron

REPO = Path(__file__).resolve().parents[3]
DEFAULT_RESULTS = REPO / "build" / "hf_coverage" / "results.jsonl"
DEFAULT_OUTPUT = REPO / "docs" / "hf_coverage.md"

SEQ_LEN = 8
BATCH = 2
NEW_TOKENS = 4
VOCAB = 128
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
LAYERS = 2
FFN = 64
MAX_POSITIONS = 128

# Tolerances against the CPU oracle (float32 everywhere; XLA may reassociate sums). Logits:
# |neuron - cpu| <= LOGITS_ATOL * max(1, max|cpu|) + LOGITS_RTOL * |cpu|, elementwise.
LOGITS_RTOL, LOGITS_ATOL = 1e-3, 1e-4
GRAD_RTOL = 2e-3
TARGET_PCT = 95   # of buildable architectures passing forward and backward (the target)

# Config fields by meaning: every spelling that architectures use for the same size.
_HIDDEN = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "dim", "d_embed",
           "hidden_dim", "word_embed_proj_dim", "embedding_size", "emb_dim", "embedding_dim", "attention_hidden_size",
           "input_embedding_size", "output_embedding_size", "pronunciation_embed_dim", "shape_embed_dim",
           "hidden_size_global")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers",
           "num_decoder_layers", "num_encoder_layers", "num_blocks")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
          "encoder_attention_heads", "num_attention_heads_per_layer")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "kv_n_heads",
             "num_key_value_groups_heads")
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff",
        "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
        "dense_intermediate_size", "moe_shared_expert_intermediate_size", "intermediate_size_mlp",
        "mlp_hidden_size", "ffn_size", "dim_feedforward", "dim_ff", "dff", "mlp_dim", "shared_intermediate_size")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
              "seq_length", "max_length_position", "context_length")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
            "n_experts")
_VOCABS = ("vocab_size", "unpadded_vocab_size", "shape_vocab_size", "pronunciation_vocab_size", "n_words",
           "decoder_vocab_size", "encoder_hash_byte_group_vocab")
_TOP_K = ("num_experts_per_token", "num_experts_per_tok", "top_k", "moe_topk", "num_selected_experts", "moe_top_k", "experts_per_token", "moe_k")
_SMALL = {  # other sizes: name -> tiny value
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "time_step_rank": 4,
    "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_expand": 2, "mamba_d_conv": 4, "n_groups": 1,
    "mamba_n_groups": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "attention_window": 4, "rnn_width": 32, "lru_width": 32, "proj_size": 32,
    "num_memory_tokens": 0, "global_attention_layers": None, "num_buckets": 32, "relative_attention_num_buckets": 8,
    "max_window_layers": LAYERS, "moe_num_shared_experts": 1, "moe_layer_end_index": LAYERS - 1,
    "o_lora_rank": 16, "index_topk": 4, "num_expert_group": 1, "num_group": 1, "num_dense_layers": 1,
    "mamba_headdim": 8, "n_mamba_heads": 8, "num_layers_per_stack": 1, "sliding_window": 4096, "rotary_dim": 4, "rotary_emb_base": 10000,
}
# MoE counts that a config class may leave None (dense) but every checkpoint sets.
_MOE_COUNTS = {"n_shared_experts": 1, "num_shared_experts": 1}
# Architectures whose layer pattern comes from periods/offsets or that need a field set to build
# a tiny model that still has every kind of layer it has at full size.
_ARCH_OVERRIDES = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_dt_rank": 4},
    "zamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "attention_head_dim": 16, "mamba_dt_rank": 4},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},  # concat of 2 streams
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 16},
    # Reformer's backward runs in training mode only (see _TRAIN_MODE_BACKWARD), where the axial
    # position shape must multiply to the sequence length and LSH rotations need a fixed seed.
    "reformer": {"is_decoder": True, "axial_pos_shape": [2, SEQ_LEN // 2], "axial_pos_embds_dim": [16, 16],
                 "attn_layers": ["local", "lsh"], "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4,
                 "num_buckets": 2, "attention_head_size": 8, "hash_seed": 0},
    "hrm_text": {"num_hidden_layers": 1, "num_layers_per_stack": None, "H_cycles": 1, "L_cycles": 1,
                 "L_bp_cycles": [1]},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 8},                            # heads * head_dim = expand * hidden
    "zaya": {"num_experts_per_tok": 1},                    # the only routing it supports
    "dots3_note": {"text_config": {"head_dim": 16}},       # = qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16},
    "gemma4_unified_assistant": {"text_config": {"num_kv_shared_layers": LAYERS}},   # all layers share KV
    "gemma3n": {"text_config": {"num_kv_shared_layers": 0}},
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id", "image_token_id", "image_token_index",
              "video_token_id", "audio_token_id", "boi_token_id", "eoi_token_id")
# Dropout-like probabilities: zero, so train-mode and eval-mode runs agree with CPU.
_DROPOUT_WORDS = ("dropout", "drop_rate", "_pdrop", "dropout_rate", "layerdrop", "attention_probs_dropout_prob",
                  "hidden_dropout_prob")


def _shrink_dict(d: dict, old_layers: int | None = None) -> dict:
    """A copy of a config dict with every known size made tiny (sub-configs included)."""
    out = dict(d)
    layers_before = next((d[k] for k in _LAYERS if isinstance(d.get(k), int)), old_layers)
    for keys, value in ((_HIDDEN, HIDDEN), (_LAYERS, LAYERS), (_HEADS, HEADS), (_KV_HEADS, KV_HEADS),
                        (_FFN, FFN), (_POSITIONS, MAX_POSITIONS), (_VOCABS, VOCAB)):
        for k in keys:
            if isinstance(out.get(k), int) and not isinstance(out.get(k), bool):
                out[k] = value
    # MoE sizes may default to None (dense) in the config class but are set by every checkpoint.
    for keys, value in ((_EXPERTS, 4), (_TOP_K, 2)):
        for k in keys:
            if k in out and (out[k] is None or isinstance(out[k], int)) and not isinstance(out[k], bool):
                out[k] = value
    for k, v in _MOE_COUNTS.items():
        if k in out and (out[k] is None or isinstance(out[k], int)):
            out[k] = v
    if "kv_lora_rank" in out:   # multi-head latent attention has no grouped KV heads
        for k in _KV_HEADS:
            if k in out:
                out[k] = HEADS
    for k, v in _SMALL.items():
        if k in out and (out[k] is not None or v is None) and not isinstance(out[k], bool | dict | list):
            out[k] = v
    if "head_dim" in out and (out["head_dim"] is None or isinstance(out["head_dim"], int)):
        out["head_dim"] = HEAD_DIM
    for k in _KV_HEADS:
        if k in out and out[k] is None:
            out[k] = KV_HEADS
    if "kv_channels" in out and isinstance(out["kv_channels"], int):
        out["kv_channels"] = HEAD_DIM
    for k in _TOKEN_IDS:
        v = out.get(k)
        if isinstance(v, int) and v >= VOCAB:
            out[k] = VOCAB - 1 - _TOKEN_IDS.index(k)
        elif isinstance(v, list):
            out[k] = [x if not isinstance(x, int) or x < VOCAB else VOCAB - 1 for x in v]
    for k, v in list(out.items()):
        if isinstance(v, float) and 0 < v < 1 and any(w in k for w in _DROPOUT_WORDS):
            out[k] = 0.0
        elif isinstance(v, list) and layers_before and len(v) == layers_before and k not in _HIDDEN:
            out[k] = _per_layer(v, LAYERS)
        elif isinstance(v, dict) and ("model_type" in v or any(x in v for x in _HIDDEN)):
            out[k] = _shrink_dict(v, layers_before)
        elif isinstance(v, dict) and v and all(_is_index(x) for x in v):
            # Per-layer settings keyed by layer index: keep the ones that still exist.
            out[k] = {x: y for x, y in v.items() if int(x) < LAYERS}
    return out


def _per_layer(values: list, n: int) -> list:
    """A per-layer list cut to ``n`` layers, keeping every distinct kind of layer it had (up to n)."""
    kinds = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
    kinds = kinds[:n]
    return [kinds[i % len(kinds)] for i in range(n)] if kinds else values[:n]


def _is_index(x) -> bool:
    return isinstance(x, int) or (isinstance(x, str) and x.isdigit())


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class NotBuildable(Exception):
    """The architecture cannot be instantiated offline without extra packages."""


def tiny_config(model_type: str):
    """A tiny random-weight configuration of ``model_type``, or NotBuildable with the reason."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    try:
        base = cls()
    except Exception as err:
        raise NotBuildable(f"default config fails: {type(err).__name__}: {_first_line(err)}") from err
    d = base.to_dict()
    for k in ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(k, None)
    small = _merge(_shrink_dict(d), _ARCH_OVERRIDES.get(model_type, {}))
    # Only the changed fields are passed, so derived ones are recomputed by the config's own
    # __init__; some configs want the whole dict back (sub-configs that do not round-trip alone).
    changed = {k: v for k, v in small.items() if d.get(k) != v}
    try:
        cfg = cls(**changed)
    except Exception as err:
        try:
            cfg = cls(**small)
        except Exception:
            raise NotBuildable(_rejected(model_type, err).replace("model rejects", "config class rejects")) from err
    cfg.use_cache = True
    return cfg


def _first_line(err) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:   # "validation error for ...:" then the actual error
        text += " " + lines[1]
    return text[:300]


# -- one architecture ------------------------------------------------------------------------------
def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _inputs(vocab: int, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    # Ids above the special tokens the tiny configs use (0..3 and VOCAB-15..VOCAB-1).
    ids = torch.randint(4, min(vocab, VOCAB) - 16, (BATCH, SEQ_LEN), generator=g)
    return ids, torch.ones_like(ids)


def build_model(model_type: str, seed: int = 0):
    """The tiny model (CPU, eval mode, seeded random weights) and its config."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cfg = tiny_config(model_type)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(cfg, wanted):
        # Composite configs whose causal-LM class takes one of their parts (musicgen's decoder).
        part = next((getattr(cfg, k) for k in getattr(cfg, "sub_configs", {}) if isinstance(getattr(cfg, k, None), wanted)),
                    None)
        cfg = part if part is not None else cfg
    torch.manual_seed(seed)
    try:
        # The class itself: a sub-config (emu3's text config) has no entry of its own in the mapping.
        model = model_cls._from_config(cfg)
    except ImportError as err:
        raise NotBuildable(f"needs an extra package: {_first_line(err) or 'ImportError'}") from err
    except Exception as err:
        raise NotBuildable(_rejected(model_type, err)) from err
    prepare = _PREPARE.get(model_type)
    if prepare is not None:
        prepare(model)
    _break_ties(model, seed)
    return model.eval(), cfg


def _break_ties(model, seed: int) -> None:
    """Give constant-initialised weights (zero router gates, zero expert-score biases, unit norms)
    a little seeded noise. Otherwise every router score is equal and top-k picks among exact ties,
    whose order PyTorch leaves unspecified (CPU and CUDA already differ), which would compare
    arbitrary expert choices instead of the model. Trained checkpoints have no such ties."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    tensors = [p for p in model.parameters()]
    tensors += [b for n, b in model.named_buffers() if "bias" in n.rsplit(".", 1)[-1]]
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point() and t.numel() > 1 and bool((t == t.reshape(-1)[0]).all()):
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.02)


def _rejected(model_type: str, err: Exception) -> str:
    """Why the model class rejected the tiny config, and whether its full-size default fails too."""
    import torch
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    reason = f"{type(err).__name__}: {_first_line(err)}"
    try:
        default = CONFIG_MAPPING[model_type]()
        with torch.device("meta"):   # no memory: only whether the class accepts its own default
            MODEL_FOR_CAUSAL_LM_MAPPING[type(default)](default)
    except Exception:
        return f"transformers cannot build it from its own default config either: {reason}"
    return f"model rejects the tiny config: {reason}"


def _xmod_language(model):
    model.set_default_language(next(iter(model.config.languages)))


# Set-up an architecture needs before its first forward (not a config field).
_PREPARE = {"xmod": _xmod_language}
# Architectures whose backward refuses eval mode: forward and backward run in training mode (every
# dropout probability is zero in the tiny configs, so the result is the same), generate in eval mode.
_TRAIN_MODE_BACKWARD = {"reformer"}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _forward_backward(model, ids, mask):
    """(logits, loss, {param name: grad}) of one forward+backward with labels = ids."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return _logits(out).detach().cpu(), loss.detach().cpu(), grads


def _generate(model, ids, mask, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, pad_token_id=_pad_id(model), **kwargs)
    return out.cpu()


def _pad_id(model):
    cfg = model.generation_config
    for v in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v:
            return v[0]
    return 0


def _close(a, b, rtol, atol) -> tuple[bool, float]:
    import torch
    if a.shape != b.shape:
        return False, float("inf")
    a, b = a.float(), b.float()
    err = (a - b).abs()
    # float32 rounding grows with the size of the values: atol is relative to the largest one.
    finite_ref = b[torch.isfinite(b)]
    scale = max(1.0, float(finite_ref.abs().max())) if finite_ref.numel() else 1.0
    bad = err > atol * scale + rtol * b.abs()
    finite = torch.isfinite(a) == torch.isfinite(b)
    return bool((~bad).all() and finite.all()), float(err[torch.isfinite(err)].max()) if err.numel() else 0.0


def _grads_close(neuron: dict, cpu: dict) -> tuple[bool, str, float]:
    """Per parameter: ||g_neuron - g_cpu|| <= GRAD_RTOL * ||g_cpu|| (+ a floor from the largest grad)."""
    if set(neuron) != set(cpu):
        missing = sorted(set(cpu) ^ set(neuron))[:3]
        return False, f"parameters with gradients differ: {missing}", float("inf")
    scale = max((float(g.float().norm()) for g in cpu.values()), default=0.0)
    worst, worst_name = 0.0, ""
    for name, g in cpu.items():
        ref = g.float()
        diff = float((neuron[name].float() - ref).norm())
        rel = diff / (float(ref.norm()) + 1e-3 * scale + 1e-12)
        if not rel <= worst and rel == rel:
            worst, worst_name = rel, name
        if rel != rel:   # NaN
            return False, f"NaN gradient for {name}", float("nan")
    return worst <= GRAD_RTOL, worst_name, worst


def _greedy_tie(model_cpu, tokens_cpu, tokens_neuron, ids, mask) -> float | None:
    """Where greedy outputs first differ: the CPU logit gap between the two chosen tokens."""
    import torch
    diff = (tokens_cpu != tokens_neuron).nonzero()
    if not len(diff):
        return None
    row, col = int(diff[0, 0]), int(diff[0, 1])
    with torch.no_grad():
        prefix = tokens_cpu[row:row + 1, :col]
        logits = _logits(model_cpu(input_ids=prefix, use_cache=False))[0, -1]
    return float(logits[tokens_cpu[row, col]] - logits[tokens_neuron[row, col]])


def check_architecture(model_type: str, generate: bool = True) -> dict:
    """Run one architecture on neuron against CPU; returns its result row (never raises)."""

    row = {"arch": model_type, "status": "fail", "reason": "", "fallbacks": {}, "forward": None,
           "backward": None, "generate": None, "seconds": 0.0}
    start = time.perf_counter()
    try:
        try:
            model, cfg = build_model(model_type)
        except NotBuildable as err:
            row.update(status="not-buildable", reason=str(err))
            return row
        row["model_class"] = type(model).__name__
        row["params"] = sum(p.numel() for p in model.parameters())
        vocab = getattr(cfg.get_text_config(), "vocab_size", VOCAB) or VOCAB
        ids, mask = _inputs(vocab)
        # Copied before the CPU run: some models keep tensors of their last forward as attributes
        # (recurrent_gemma's recurrent and conv states), which are not graph leaves and cannot be
        # deep-copied afterwards.
        neuron_model = copy.deepcopy(model)
        if model_type in _TRAIN_MODE_BACKWARD:
            model.train()
            neuron_model.train()
        try:
            ref_logits, ref_loss, ref_grads = _forward_backward(model, ids, mask)
        except Exception as err:
            row.update(status="not-buildable", reason=f"CPU reference fails: {type(err).__name__}: {_first_line(err)}")
            return row
        neuron_model = neuron_model.to("neuron")
        before = torchneuron.metrics()["fallbacks"]
        try:
            logits, loss, grads = _forward_backward(neuron_model, ids.to("neuron"), mask.to("neuron"))
        except Exception as err:
            row["reason"] = f"forward/backward on neuron raised {type(err).__name__}: {_first_line(err)}"
            row["traceback"] = traceback.format_exc()[-3000:]
            return row
        finally:
            row["fallbacks"] = _delta(before, torchneuron.metrics()["fallbacks"])
        ok_logits, err_logits = _close(logits, ref_logits, LOGITS_RTOL, LOGITS_ATOL)
        ok_loss, err_loss = _close(loss, ref_loss, LOGITS_RTOL, LOGITS_ATOL)
        row["forward"] = {"ok": ok_logits and ok_loss, "logits_max_abs_err": err_logits, "loss_abs_err": err_loss}
        if not row["forward"]["ok"]:
            row["reason"] = f"forward mismatch: logits max abs err {err_logits:.3g}, loss err {err_loss:.3g}"
            return row
        ok_grads, where, worst = _grads_close(grads, ref_grads)
        row["backward"] = {"ok": ok_grads, "worst_param": where, "worst_rel_err": worst}
        if not ok_grads:
            row["reason"] = f"backward mismatch: {where} relative error {worst:.3g}"
            return row
        if generate:
            model.eval()
            neuron_model.eval()
            row["generate"] = _check_generate(model, neuron_model, ids, mask, row)
            if not row["generate"]["ok"]:
                row["reason"] = row["generate"]["reason"]
                return row
        row["status"] = "pass"
        return row
    except Exception as err:  # a bug in this tool or in transformers: recorded, the sweep goes on
        row["reason"] = f"{type(err).__name__}: {_first_line(err)}"
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - start, 2)


def _check_generate(model, neuron_model, ids, mask, row) -> dict:
    try:
        ref = _generate(model, ids, mask)
    except Exception as err:
        return {"ok": True, "skipped": f"CPU generate fails: {type(err).__name__}: {_first_line(err)}"}
    before = torchneuron.metrics()["fallbacks"]
    try:
        out = _generate(neuron_model, ids.to("neuron"), mask.to("neuron"))
    except Exception as err:
        row["traceback"] = traceback.format_exc()[-3000:]
        return {"ok": False, "reason": f"generate on neuron raised {type(err).__name__}: {_first_line(err)}"}
    finally:
        for op, n in _delta(before, torchneuron.metrics()["fallbacks"]).items():
            row["fallbacks"][op] = row["fallbacks"].get(op, 0) + n
    if out.shape == ref.shape and bool((out == ref).all()):
        return {"ok": True, "tokens": int(out.shape[1] - ids.shape[1])}
    gap = _greedy_tie(model, ref, out, ids, mask) if out.shape == ref.shape else None
    if gap is not None and abs(gap) < 1e-4:
        # Two candidate tokens with equal CPU logits: either choice is a correct greedy step.
        return {"ok": True, "tie": gap, "tokens": int(out.shape[1] - ids.shape[1])}
    return {"ok": False, "reason": f"greedy tokens differ from CPU (logit gap at first difference: {gap})"}


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# -- the sweep -------------------------------------------------------------------------------------
def _worker(archs: list[str], results: Path, timeout: int, generate: bool, run: dict | None = None) -> None:
    """Runs in a child process: one JSON line per architecture, each with ``run`` (the command that
    produced it, when and at which commit)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torchneuron.config.fallback = "silent"
    _enable_jax_cache()

    def alarm(signum, frame):
        raise TimeoutError(f"over {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    for arch in archs:
        print(f"[hf_coverage] {arch} ...", file=sys.stderr, flush=True)
        signal.alarm(timeout)
        try:
            row = check_architecture(arch, generate=generate)
        finally:
            signal.alarm(0)
        _append(results, {**row, "run": _run_info(run)})
        print(f"[hf_coverage] {arch}: {row['status']} {row['reason'][:160]} ({row['seconds']} s)",
              file=sys.stderr, flush=True)


def _enable_jax_cache() -> None:
    """Re-sweeps reuse compiled executables through JAX's persistent compilation cache."""
    import jax
    path = os.environ.get("TORCHNEURON_HF_JAX_CACHE", str(Path.home() / ".cache" / "torchneuron" / "hf-jax"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _run_info(run: dict | None) -> dict:
    return {**(run or {}), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _source_revision() -> str | None:
    """The repository commit the sweep runs from, marked when tracked files have local changes."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return rev.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _drop(results: Path, archs: list[str]) -> None:
    """Remove the rows of ``archs`` from ``results`` (they are about to be run again)."""
    if not results.exists():
        return
    keep = [line for line in results.read_text().splitlines()
            if line.strip() and json.loads(line)["arch"] not in set(archs)]
    results.write_text("".join(line + "\n" for line in keep))


def _done(results: Path) -> dict:
    rows = {}
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["arch"]] = row
    return rows


def sweep(archs: list[str], results: Path, timeout: int, generate: bool, jobs: int = 1,
          run: dict | None = None) -> None:
    """Run those of ``archs`` that have no row in ``results`` yet, in ``jobs`` worker processes (each
    keeps its compiled executables across its architectures); a worker that dies is replaced and
    the architecture it was on is failed. ``run`` (command, commit) is recorded in every row."""
    results.parent.mkdir(parents=True, exist_ok=True)
    todo = [a for a in archs if a not in _done(results)]
    shards = [todo[i::jobs] for i in range(max(1, jobs))]
    threads = [threading.Thread(target=_run_shard, args=(shard, results, timeout, generate, run))
               for shard in shards if shard]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _run_shard(archs: list[str], results: Path, timeout: int, generate: bool, run: dict | None = None) -> None:
    while True:
        todo = [a for a in archs if a not in _done(results)]
        if not todo:
            return
        cmd = [sys.executable, "-m", "torchneuron.tools.hf_coverage", "--worker", "--results", str(results),
               "--timeout", str(timeout), *(["--no-generate"] if not generate else []),
               "--run-info", json.dumps(run or {}), *todo]
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        done = _done(results)
        if proc.returncode != 0:
            first = next((a for a in todo if a not in done), None)
            if first is not None:
                _append(results, {"arch": first, "status": "fail", "fallbacks": {}, "seconds": 0,
                                  "reason": f"worker process died (exit code {proc.returncode})",
                                  "run": _run_info(run)})


def _append(results: Path, row: dict) -> None:
    # One write per row in append mode: rows from concurrent workers never interleave.
    with open(results, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


# -- the report ------------------------------------------------------------------------------------
def summarise(rows: list[dict]) -> dict:
    buildable = [r for r in rows if r["status"] != "not-buildable"]
    passed = [r for r in buildable if r["status"] == "pass"]
    forward_ok = [r for r in buildable if (r.get("forward") or {}).get("ok")]
    gen_checked = [r for r in forward_ok if r.get("generate") is not None and not r["generate"].get("skipped")]
    gen_ok = [r for r in gen_checked if r["generate"]["ok"]]
    backward_ok = [r for r in forward_ok if (r.get("backward") or {}).get("ok")]
    return {"total": len(rows), "buildable": len(buildable), "passed": len(passed),
            "not_buildable": len(rows) - len(buildable), "forward_ok": len(forward_ok),
            "backward_ok": len(backward_ok),
            "generate_checked": len(gen_checked), "generate_ok": len(gen_ok),
            "with_fallbacks": sum(1 for r in passed if r.get("fallbacks"))}


def _versions() -> str:
    import jax
    import torch
    import transformers
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, jax {jax.__version__}, "
            f"Python {platform.python_version()}, {platform.machine()}")


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], command: str, not_run: list[str] = ()) -> str:
    s = summarise(rows)
    out = [
        "# Hugging Face causal-LM architecture coverage on neuron",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} ({_versions()}),",
        "from the results of the runs listed under *Runs* below.",
        "",
        "Every architecture in transformers' causal-LM auto mapping is built from a tiny random-weight",
        f"config ({LAYERS} layers, hidden size {HIDDEN}, {HEADS} heads, vocabulary {VOCAB}; nothing is downloaded) and",
        f"run on neuron against the same model on CPU: forward (logits and loss, batch {BATCH} x {SEQ_LEN} tokens,",
        f"labels = inputs), backward (every parameter's gradient) and greedy `generate()` ({NEW_TOKENS} new tokens,",
        "default dynamic cache, token for token). An architecture *passes* when all three match; where",
        "`generate()` fails on CPU itself, generate is not compared (\"CPU cannot\", with the CPU error).",
        "*Not buildable* means the tiny model cannot be instantiated offline without extra packages, or",
        "its CPU reference itself fails; the reason is given. CPU fallbacks are the ATen ops that ran on",
        "CPU through torchneuron's fallback while that model ran on neuron (count of calls).",
        "",
        "## Summary",
        "",
        "| | count | share |",
        "| --- | ---: | ---: |",
        f"| architectures in the mapping | {s['total'] + len(not_run)} | |",
        f"| buildable offline | {s['buildable']} | |",
        f"| pass forward + backward + generate | {s['passed']} | {_pct(s['passed'], s['buildable'])} of buildable |",
        f"| forward matches CPU | {s['forward_ok']} | {_pct(s['forward_ok'], s['buildable'])} of buildable |",
        f"| greedy generate matches CPU (of forward-passing, where CPU generate runs) | {s['generate_ok']} / "
        f"{s['generate_checked']} | {_pct(s['generate_ok'], s['generate_checked'])} |",
        f"| passing architectures that used a CPU fallback | {s['with_fallbacks']} | |",
        f"| not buildable | {s['not_buildable']} | |",
        *([f"| not run (sweep stopped before them: {', '.join(not_run)}) | {len(not_run)} | |"] if not_run else []),
        "",
        f"Target: at least {TARGET_PCT}% of buildable architectures pass forward and backward on neuron: "
        f"{s['backward_ok']} / {s['buildable']} = {_pct(s['backward_ok'], s['buildable'])}, "
        f"**{'met' if s['buildable'] and s['backward_ok'] >= TARGET_PCT / 100 * s['buildable'] else 'not met'}**"
        f"{' (not every architecture has run)' if not_run else ''}. Greedy generation matches CPU on every",
        f"architecture that passes forward (where CPU generate runs): {s['generate_ok']} / {s['generate_checked']}, "
        f"**{'met' if s['generate_ok'] == s['generate_checked'] else 'not met'}**.",
        "",
        "## Per architecture",
        "",
        "| architecture | class | status | forward (max abs err) | backward (worst rel err) | generate | "
        "CPU fallbacks | reason | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | ---: |",
    ]
    for r in sorted(rows, key=lambda r: r["arch"]):
        fwd = r.get("forward") or {}
        bwd = r.get("backward") or {}
        gen = r.get("generate") or {}
        fwd_txt = "" if not fwd else f"{'ok' if fwd['ok'] else 'MISMATCH'} ({fwd['logits_max_abs_err']:.1e})"
        bwd_txt = "" if not bwd else f"{'ok' if bwd['ok'] else 'MISMATCH'} ({bwd['worst_rel_err']:.1e})"
        if not gen:
            gen_txt = ""
        elif gen.get("skipped"):
            gen_txt = "CPU cannot"
        elif gen.get("ok"):
            gen_txt = "ok (tie)" if "tie" in gen else "ok"
        else:
            gen_txt = "MISMATCH" if "differ" in gen.get("reason", "") else "error"
        fb = ", ".join(f"{k} x{v}" for k, v in sorted(r.get("fallbacks", {}).items())) or "none"
        if r["status"] == "not-buildable":
            fb = ""
        reason = r.get("reason", "") or (gen.get("skipped", "") if gen else "")
        out.append(f"| {r['arch']} | {r.get('model_class', '')} | {r['status']} | {fwd_txt} | {bwd_txt} | "
                   f"{gen_txt} | {_cell(fb)} | {_cell(reason)} | {r.get('seconds', 0):.0f} |")
    failing = [r for r in rows if r["status"] == "fail"]
    if failing:
        out += ["", "## Failures", ""]
        for r in sorted(failing, key=lambda r: r["arch"]):
            out.append(f"- **{r['arch']}**: {_cell(r['reason'])}")
    out += ["", *_runs_section(rows), "", _NOTES]
    return "\n".join(out)


def _runs_section(rows: list[dict]) -> list[str]:
    """Which command produced which rows (rows are kept across ``--resume`` runs)."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        run = r.get("run") or {}
        runs.setdefault((run.get("command"), run.get("commit")), []).append(r)
    out = ["## Runs", "",
           "Each row comes from the run below that last ran its architecture (`--resume` keeps the rows of",
           "earlier runs and replaces those of the architectures it names). Architecture time is the sum of",
           "the per-architecture times (shared machine; workers run in parallel with `--jobs`).", "",
           "| command | source revision | architectures | first row written (UTC) | last row written (UTC) | "
           "architecture time (s) |",
           "| --- | --- | ---: | --- | --- | ---: |"]
    for (command, commit), rs in sorted(runs.items(), key=lambda kv: min(_row_date(r) for r in kv[1])):
        dates = sorted(_row_date(r) for r in rs if _row_date(r))
        cmd = f"`{command}`" if command else "not recorded (rows written before the tool recorded its command)"
        out.append(f"| {_cell(cmd)} | {_cell(commit or 'not recorded')} | {len(rs)} | "
                   f"{dates[0] if dates else ''} | {dates[-1] if dates else ''} | "
                   f"{sum(r.get('seconds', 0) for r in rs):.0f} |")
    return out


def _row_date(row: dict) -> str:
    return (row.get("run") or {}).get("date", "")


_NOTES = """## What transformers needs from the device, and where it is handled

| need | how it works on neuron |
| --- | --- |
| `device_map="neuron"`, `.to("neuron")` | standard PyTorch device; tied embeddings stay tied (`runtime/modules.py`) |
| attention implementation | `sdpa` is selected; SDPA runs its math path from lowered ops; `eager` works too |
| `torch.accelerator` queries | `current_accelerator()` is `neuron` (PrivateUse1 registration) |
| `TrainingArguments.device`, accelerate `PartialState`, RNG checkpoints, compile backend | transformers and accelerate enable their neuron code paths by probing for AWS's `torch_neuronx`; `torchneuron.integrations.transformers` answers those two probes from the registered device |
| `Trainer(bf16=True)` / `torch.autocast("neuron")` | autocast kernels for the neuron key (`runtime/autocast.py`); `torch.neuron.is_bf16_supported()` |
| `DataLoader(pin_memory=True)` (Trainer default) | a Python backend cannot register a pinned allocator, and PJRT stages host buffers itself: batches go unpinned for neuron (`torchneuron.integrations.data`) |
| MoE experts (`grouped_mm`) | `histc` on integer expert ids and `_grouped_mm` are lowered (`ops/reductions.py`, `ops/linalg.py`) |
| `adamw_torch_fused` (Trainer's default optimizer) | `_fused_adamw_`/`_fused_adam_` are lowered; the learning rate is a runtime input, so LR schedules do not recompile |
| static-cache `generate()` | transformers compiles decoding with `torch.compile(backend="neuron", dynamic=False)`: one graph for all steps |
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchneuron.tools.hf_coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("archs", nargs="*", help="model types to run (default: every causal-LM architecture)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON-lines results file")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    p.add_argument("--resume", action="store_true",
                   help="keep results already in --results; architectures named on the command line are run "
                        "again (their old rows are replaced), with none named only those without a row run")
    p.add_argument("--render-only", action="store_true", help="write the report from --results only")
    p.add_argument("--timeout", type=int, default=600, help="seconds per architecture")
    p.add_argument("--no-generate", action="store_true", help="skip the greedy generate check")
    p.add_argument("--jobs", type=int, default=1, help="worker processes run in parallel")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-info", default="{}", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.worker:
        _worker(args.archs, args.results, args.timeout, not args.no_generate, json.loads(args.run_info))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = " ".join(["python -m torchneuron.tools.hf_coverage", *map(shlex.quote, raw)])
    archs = args.archs or causal_lm_types()
    start = time.perf_counter()
    if not args.render_only:
        if not args.resume and args.results.exists():
            args.results.unlink()
        elif args.resume and args.archs:
            _drop(args.results, args.archs)   # named again: run them, not keep their old rows
        sweep(archs, args.results, args.timeout, not args.no_generate, args.jobs,
              run={"command": command, "commit": _source_revision()})
    wall = time.perf_counter() - start
    done = _done(args.results)
    # A resumed or re-rendered sweep reports every architecture of the mapping, not only those named.
    scope = archs if args.archs and not args.resume else sorted(set(causal_lm_types()) | set(archs))
    rows = [done[a] for a in scope if a in done]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(rows, command, [a for a in scope if a not in done]) + "\n")
    s = summarise(rows)
    print(f"{s['passed']}/{s['buildable']} buildable architectures pass ({_pct(s['passed'], s['buildable'])}); "
          f"{s['not_buildable']} not buildable; {len(scope) - len(rows)} not run; wall {wall:.0f} s; "
          f"report: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
