"""Tiny random-weight configurations of Hugging Face architectures (the sizes the sweep runs).

Every size field an architecture's config uses, under any of its spellings, is made tiny (few
layers, small hidden size and vocabulary); per-layer lists keep every kind of layer; dropout is
zero. Only the changed fields are passed back to the config class, so derived fields are
recomputed by the config's own ``__init__``. Nothing is downloaded.
"""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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
    cls = CONFIG_MAPPING[model_type]
    try:
        base = cls()
    except Exception as err:
        raise NotBuildable(f"default config fails: {type(err).__name__}: {first_line(err)}") from err
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
            raise NotBuildable(rejection_reason(model_type, err).replace("model rejects", "config class rejects")) from err
    cfg.use_cache = True
    return cfg


def first_line(err) -> str:
    """The first line of an error message (two when the first only introduces the second)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:   # "validation error for ...:" then the actual error
        text += " " + lines[1]
    return text[:300]


def rejection_reason(model_type: str, err: Exception) -> str:
    """Why the model class rejected the tiny config, and whether its full-size default fails too."""
    reason = f"{type(err).__name__}: {first_line(err)}"
    try:
        default = CONFIG_MAPPING[model_type]()
        with torch.device("meta"):   # no memory: only whether the class accepts its own default
            MODEL_FOR_CAUSAL_LM_MAPPING[type(default)](default)
    except Exception:
        return f"transformers cannot build it from its own default config either: {reason}"
    return f"model rejects the tiny config: {reason}"
