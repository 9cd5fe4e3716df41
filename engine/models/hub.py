"""Real checkpoints: local Hugging Face directories and llama.cpp GGUF files.

Only local files are read; nothing is downloaded. Weights are loaded with
safetensors (never pickle) or the gguf package, and mapped to our module names (hf_names.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import os

from . import budget, safetensors_check
from ..shared.errors import ConfigError, ModelLoadError, UnsupportedModel
from ..shared.untrusted import read_small_file, strict_json
from .args import ModelArgs
from .hf_names import MOE_STYLE, hf_to_ours, unfused
from .snapshot import Snapshot
from .tokenizer import hf_tokenizer
from .weights import check_state

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Olmo2ForCausalLM": "olmo2", "GraniteForCausalLM": "granite",
                   "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                   "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                   "Qwen3MoeForCausalLM": "qwen3_moe"}
_WINDOW_ARCHS = ("mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3")  # whose transformers code reads sliding_window
_GEMMA = ("gemma2", "gemma3")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")
_MODEL_TYPES = {"gemma3": ("gemma3_text",)}  # model_type values naming the class, where not the arch

def _one_of(*values):
    """A check: the value must be one of ``values`` (None stands for an absent or null field)."""
    def check(v, cfg, arch):
        return None if any(v is w or (v == w and type(v) is type(w)) or (w is False and v is None)
                           for w in values) else " or ".join(_short(w) for w in values)
    return check


def _arch_only(arches, check):
    """``check`` for the listed architectures; the others' transformers code never reads the field."""
    return lambda v, cfg, arch: check(v, cfg, arch) if arch in arches else None


def _positive_int(v, cfg, arch):
    return None if isinstance(v, int) and not isinstance(v, bool) and v > 0 else "a positive integer"


def _head_dim(v, cfg, arch):
    if v is None:
        h, n = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        return None if isinstance(h, int) and isinstance(n, int) and n > 0 and h % n == 0 else (
            f"absent only when hidden_size ({h}) is a multiple of num_attention_heads ({n})")
    return _positive_int(v, cfg, arch)


def _sliding_window(v, cfg, arch):
    if arch in _MOE:  # their code reads it (Qwen's only with use_sliding_window); windows with experts: not here
        applied = v is not None and (arch == "mixtral" or cfg.get("use_sliding_window"))
        return f"null for {arch} (a sliding window with experts is not implemented)" if applied else None
    if v is None or arch not in _WINDOW_ARCHS:
        return None if v is None else f"null for {arch} (its transformers code has no sliding window)"
    return _positive_int(v, cfg, arch)


def _layer_types(v, cfg, arch):
    n = cfg.get("num_hidden_layers")
    if v is None:
        return None
    if arch in ("mistral", "phi3"):
        return f"null for {arch} (its transformers code applies sliding_window to every layer)"
    if arch not in _WINDOW_ARCHS:
        return None if isinstance(v, list) and all(t == "full_attention" for t in v) else \
            f"every layer 'full_attention' for {arch} (its transformers code has no sliding window)"
    if not (isinstance(v, list) and len(v) == n and all(t in ("full_attention", "sliding_attention") for t in v)):
        return f"a list of {n} entries, each 'full_attention' or 'sliding_attention'"
    return None


def _layer_list(v, cfg, arch):
    n = cfg.get("num_hidden_layers")
    ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i for i in v)
    return None if ok and (not isinstance(n, int) or all(i < n for i in v)) else f"a list of layer indices below {n}"


def _moe_sizes(v, cfg, arch):
    return None if arch not in _MOE or _positive_int(v, cfg, arch) is None else "a positive integer"


def _finite_positive(v, cfg, arch):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return None if ok else "a positive finite number"


def _names(v, cfg, arch):
    return None if isinstance(v, list) and all(isinstance(a, str) for a in v) else "a list of class names"


def _multiplier(v, cfg, arch):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return None if ok else "a positive finite number"


def _model_type(v, cfg, arch):
    names = _MODEL_TYPES.get(arch, (arch,))
    return None if v is None or v in names else f"{' or '.join(map(repr, names))} (the class named in architectures)"


def _gemma_rope(v, cfg, arch):
    """Gemma 3's rope_parameters: a table per layer type, each a default or linear RoPE."""
    if not isinstance(v, dict) or not v or not set(v) <= {"full_attention", "sliding_attention"}:
        return "a table with full_attention and sliding_attention entries (Gemma 3)"
    for kind, table in v.items():
        bad = _rope_dict(table, cfg, arch)
        if bad is not None:
            return f"{kind}: {bad}"
        if kind == "sliding_attention" and table.get("rope_type", "default") != "default":
            return "sliding_attention: rope_type default (scaled local RoPE is not implemented)"
    return None


def _rope_params(v, cfg, arch):
    return _gemma_rope(v, cfg, arch) if arch == "gemma3" and isinstance(v, dict) and (
        "full_attention" in v or "sliding_attention" in v) else _rope_dict(v, cfg, arch)


def _softcap(v, cfg, arch):
    return None if v is None else _multiplier(v, cfg, arch)


_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "longrope": {"short_factor", "long_factor"}}
_ROPE_OPTIONAL = {"longrope": {"factor", "attention_factor", "original_max_position_embeddings"}}
# rope types a family's transformers config renames before use: Phi3Config reads the legacy "su" and "yarn" as
# longrope (whatever the other keys; longrope's own keys are then required)
_LEGACY_ROPE = {"phi3": {"su": "longrope", "yarn": "longrope"}}


def rope_kind(table: dict, arch: str) -> str:
    """A RoPE table's type as transformers reads it for ``arch``: rope_type, else the legacy type, renamed where
    the family's config renames it (_LEGACY_ROPE)."""
    kind = table.get("rope_type", table.get("type", "default"))
    return _LEGACY_ROPE.get(arch, {}).get(kind, kind)


def _rope_dict(v, cfg, arch):
    if v is None:
        return None
    if not isinstance(v, dict):
        return "a table"
    kind = rope_kind(v, arch)
    if kind not in _ROPE_KEYS:
        return "rope_type default, linear, llama3 or longrope (Phi-3 also 'su' and 'yarn', read as longrope)"
    given = v.get("rope_type", v.get("type", "default"))
    name = repr(kind) if given == kind else f"{given!r} (which transformers' {arch} reads as {kind!r})"
    known = _ROPE_KEYS[kind] | _ROPE_OPTIONAL.get(kind, set())
    extra = sorted(set(v) - known - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        return f"for rope_type {name} only the keys {sorted(known | {'rope_type', 'rope_theta'})} (got {extra})"
    missing = sorted(_ROPE_KEYS[kind] - set(v))
    if missing:
        return f"rope_type {name} with {missing}"
    for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
        if v.get(key) is not None and _finite_positive(v[key], cfg, arch) is not None:
            return f"{key} as a positive finite number (got {_short(v[key])})"
    omax = v.get("original_max_position_embeddings")
    if omax is not None and _positive_int(omax, cfg, arch) is not None:
        return f"original_max_position_embeddings as a positive integer (got {_short(omax)})"
    if v.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor 1.0 (partial rotary embeddings are not implemented)"
    if kind == "longrope":
        half = (cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // max(cfg.get("num_attention_heads") or 1, 1)) // 2
        for key in ("short_factor", "long_factor"):
            f = v[key]
            if not (isinstance(f, list) and len(f) == half and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in f)):
                return f"longrope {key} as {half} positive numbers (head_dim / 2)"
        if not isinstance(v.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings")), int):
            return "longrope with original_max_position_embeddings (in the table or the config)"
    return None


_USED, _NO_EFFECT = None, None  # fields read into ModelArgs / fields that cannot change a prefill's numbers
_DECODING = "a decoding or tokenizer setting: not part of a prefill"
_BOOKKEEPING = "bookkeeping: does not change what the model computes"

# Every transformers config field a checkpoint may carry, and the values our engine implements for it.
# name -> (check, why): check is None when any value is accepted (the field is read into ModelArgs, or
# cannot change a prefill's result); otherwise check(value, config, arch) returns None for a supported
# value, else a description of what is supported. A field not in this table is refused: whitelist,
# never blacklist, so a config that asks for something we do not implement is never run as something else.
HF_FIELDS = {
    # -- the architecture and its sizes, read into ModelArgs
    "architectures": (_names, "picks the family (SUPPORTED_ARCHS); anything else is refused before this table"),
    "model_type": (_model_type, "transformers builds the model from model_type: it must name the same class"),
    "hidden_size": (_positive_int, "d, read into ModelArgs.dim"),
    "num_hidden_layers": (_positive_int, "L, ModelArgs.n_layers"),
    "num_attention_heads": (_positive_int, "H_q, ModelArgs.n_heads"),
    "num_key_value_heads": (lambda v, c, a: None if v is None else _positive_int(v, c, a),
                            "H_kv (absent: H_q), ModelArgs.n_kv_heads"),
    "head_dim": (_head_dim, "d_h (absent: hidden_size / num_attention_heads), ModelArgs.head_dim"),
    "intermediate_size": (_positive_int, "the MLP width, ModelArgs.hidden_dim"),
    "vocab_size": (_positive_int, "|V|, ModelArgs.vocab_size"),
    "rms_norm_eps": (_finite_positive, "ModelArgs.norm_eps"),
    "max_position_embeddings": (_positive_int, "ModelArgs.max_position; bounds the positions a prompt may use"),
    "tie_word_embeddings": (_one_of(True, False), "both implemented; false needs an lm_head.weight in the checkpoint"),
    # -- what each layer computes
    "hidden_act": (lambda v, c, a: None if a in _GEMMA else _one_of("silu")(v, c, a),
                   "the MLP is silu(x·W_g) ⊙ x·W_u: only silu is implemented (Gemma reads hidden_activation)"),
    "hidden_activation": (_arch_only(_GEMMA, _one_of("gelu_pytorch_tanh", None)),
                          "Gemma: the MLP's gate activation, gelu with the tanh approximation"),
    "query_pre_attn_scalar": (_arch_only(_GEMMA, _multiplier), "Gemma: attention scores are scaled by its "
                                                               "inverse square root, in place of head_dim's"),
    "attn_logit_softcapping": (_arch_only(_GEMMA, _softcap), "Gemma: scores -> cap·tanh(scores/cap)"),
    "final_logit_softcapping": (_arch_only(_GEMMA, _softcap), "Gemma: logits -> cap·tanh(logits/cap)"),
    "use_bidirectional_attention": (_one_of(False, None), "causal attention only"),
    "_sliding_window_pattern": (_arch_only(("gemma3",), _positive_int), "Gemma 3: every n-th layer is full (used "
                                                                        "when layer_types is absent)"),
    "sliding_window_pattern": (_arch_only(("gemma3",), _positive_int), "Gemma 3: every n-th layer is full (used "
                                                                       "when layer_types is absent)"),
    "rope_local_base_freq": (_arch_only(("gemma3",), _multiplier), "Gemma 3 (transformers 4): the RoPE base of "
                                                                    "sliding-window layers"),
    "attention_bias": (_arch_only(("llama", "qwen3", "olmo2", "granite") + _GEMMA, _one_of(True, False)),
                       "Llama, Qwen3, OLMo 2, Granite and Gemma: true adds q/k/v and o_proj biases; Qwen2 always has q/k/v "
                       "biases and no o_proj bias, Mistral none: their code ignores the field"),
    "mlp_bias": (_arch_only(("llama", "granite"), _one_of(True, False)),
                 "Llama and Granite: biases on the MLP's three projections; the others' code ignores it"),
    "embedding_multiplier": (_arch_only(("granite",), _multiplier), "Granite: R_0 = Embed(tokens) * it"),
    "residual_multiplier": (_arch_only(("granite",), _multiplier), "Granite: each update is scaled by it before "
                                                                   "it joins the residual"),
    "attention_multiplier": (_arch_only(("granite",), _multiplier), "Granite: the attention score scale, in place "
                                                                    "of 1/sqrt(head_dim)"),
    "logits_scaling": (_arch_only(("granite",), _multiplier), "Granite: the logits are divided by it"),
    # -- mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); the other families' code never reads these
    "num_local_experts": (_moe_sizes, "Mixtral, Qwen3-MoE: the experts per MoE layer, ModelArgs.n_experts"),
    "num_experts": (_moe_sizes, "Qwen2-MoE, Qwen3-MoE: the experts per MoE layer, ModelArgs.n_experts"),
    "num_experts_per_tok": (_moe_sizes, "the top-k experts each token takes, ModelArgs.n_active_experts"),
    "moe_intermediate_size": (_arch_only(_QWEN_MOE, _positive_int), "Qwen-MoE: an expert's MLP width "
                                                                     "(Mixtral's is intermediate_size)"),
    "shared_expert_intermediate_size": (_arch_only(("qwen2_moe",), lambda v, c, a: None if v in (0, None) else
                                                   _positive_int(v, c, a)),
                                        "Qwen2-MoE: the always-on shared expert's width, gated by sigmoid(w·x)"),
    "norm_topk_prob": (_arch_only(_QWEN_MOE, _one_of(True, False)), "Qwen-MoE: the top-k probabilities "
                                                                    "renormalised to sum 1 (Mixtral always does)"),
    "decoder_sparse_step": (_arch_only(_QWEN_MOE, _positive_int), "Qwen-MoE: layer i has experts when (i + 1) is a "
                                                                  "multiple of it (and it is not in mlp_only_layers)"),
    "mlp_only_layers": (_arch_only(_QWEN_MOE, _layer_list), "Qwen-MoE: layers with a dense MLP, ModelArgs.dense_layers"),
    "qkv_bias": (_arch_only(("qwen2_moe",), _one_of(True, False)), "Qwen2-MoE (transformers 5): q/k/v biases"),
    "router_aux_loss_coef": (_NO_EFFECT, "a training loss weight"),
    "router_jitter_noise": (_NO_EFFECT, "Mixtral: noise on the router's input in training mode only"),
    "output_router_logits": (_NO_EFFECT, "what forward returns besides, not what it computes"),
    "partial_rotary_factor": (_one_of(1.0, 1, None), "RoPE over the whole head: partial rotary is not implemented"),
    "rope_interleaved": (_one_of(False), "RoPE is rotate-half, never interleaved pairs"),
    "use_qk_norm": (_one_of(False), "QK-norm (a norm on queries and keys) is not implemented"),
    "qk_norm": (_one_of(False), "QK-norm is not implemented"),
    "qk_layernorm": (_one_of(False), "QK-norm is not implemented"),
    "use_mrope": (_one_of(False), "multimodal RoPE is not implemented"),
    "original_max_position_embeddings": (lambda v, c, a: None if v is None else _positive_int(v, c, a),
                                         "LongRoPE's original length, when its table does not give it"),
    "rope_theta": (_finite_positive, "θ_base, ModelArgs.rope_theta"),
    "rope_parameters": (_rope_params, "transformers 5: rope_theta and rope_type default, linear, llama3 or longrope "
                                      "(Gemma 3: one such table per layer type)"),
    "rope_scaling": (_rope_dict, "transformers 4: rope_type (or type) default, linear, llama3 or longrope (Phi-3's "
                                 "legacy su and yarn are longrope, as transformers reads them); null"),
    "sliding_window": (_sliding_window, "W, ModelArgs.sliding_window: Mistral's and Phi-3's layers (all of them), "
                                        "Gemma's by layer_types, and Qwen2's "
                                        "and Qwen3's (with use_sliding_window, by layer_types) see their W most "
                                        "recent tokens"),
    "use_sliding_window": (_arch_only(_WINDOW_ARCHS, _one_of(True, False)),
                           "Qwen2, Qwen3: whether sliding_window applies"),
    "max_window_layers": (_arch_only(("qwen2", "qwen3"), lambda v, c, a: None if v is None else
                                     _positive_int(v + 1, c, a) if isinstance(v, int) else "an integer"),
                          "Qwen2, Qwen3: layers from this one on use the window (when layer_types is absent)"),
    "layer_types": (_layer_types, "which layers use the sliding window, ModelArgs.layer_types"),
    "pretraining_tp": (_positive_int, "transformers 4 slices the same matmuls into this many parts (the same "
                                      "function; transformers 5 ignores it)"),
    "pruned_heads": (_one_of({}, None), "pruned attention heads are not implemented"),
    "is_encoder_decoder": (_one_of(False), "a decoder-only model"),
    "add_cross_attention": (_one_of(False), "no cross-attention"),
    "quantization_config": (_one_of(None), "quantised checkpoints are not loaded (weights are read as float)"),
    "chunk_size_feed_forward": (_NO_EFFECT, "computes the MLP in chunks of tokens: the same function"),
    "attention_dropout": (_NO_EFFECT, "dropout: off in a prefill (the model runs in eval mode)"),
    "hidden_dropout": (_NO_EFFECT, "dropout: off in a prefill"),
    "resid_pdrop": (_NO_EFFECT, "dropout: off in a prefill"),
    "embd_pdrop": (_NO_EFFECT, "dropout: off in a prefill"),
    "attn_pdrop": (_NO_EFFECT, "dropout: off in a prefill"),
    # -- decoding and tokenizer settings
    **{k: (_NO_EFFECT, _DECODING) for k in (
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "forced_bos_token_id", "forced_eos_token_id", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "tokenizer_class", "prefix", "task_specific_params")},
    # -- bookkeeping
    **{k: (_NO_EFFECT, _BOOKKEEPING) for k in (
        "_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype", "use_bfloat16",
        "use_cache", "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
        "torchscript", "finetuning_task", "id2label", "label2id", "num_labels", "problem_type", "tf_legacy_loss",
        "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "is_decoder",
        "tie_encoder_decoder", "cross_attention_hidden_size", "keys_to_ignore_at_inference", "is_llama_config",
        "transformers.js_config", "ignore_keys_at_rope_validation")},
}


def _check_fields(cfg: dict, arch: str, where: str) -> None:
    for key, value in cfg.items():
        if key not in HF_FIELDS:
            raise UnsupportedModel(f"{where}: config field {key}={_short(value)} is not one our engine implements "
                                 "(unknown field; supported fields: see prefill_diff.engine.models.hub.HF_FIELDS)")
        check, why = HF_FIELDS[key]
        want = None if check is None else check(value, cfg, arch)
        if want is not None:
            raise UnsupportedModel(f"{where}: config field {key}={_short(value)} is not supported "
                                 f"(supported: {want}; {why})")


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def args_from_hf_config(cfg: dict, where: str) -> ModelArgs:
    """ModelArgs from a transformers config.json, after checking every field against HF_FIELDS."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise UnsupportedModel(f"{where}: architecture {archs or cfg.get('model_type')} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ModelLoadError(f"{where}: config.json has no {key}")
    _check_fields(cfg, arch, where)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = None
    if arch == "gemma3" and ("full_attention" in rope or "sliding_attention" in rope):
        local = rope.get("sliding_attention", {})
        rope = dict(rope.get("full_attention", {}))
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    elif arch == "gemma3":
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope_kind(rope, arch)
    scaling = ()
    if kind == "longrope":
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if kind not in (None, "default"):
        keep = {"rope_type": kind, **{k: tuple(v) if isinstance(v, list) else v for k, v in rope.items() if k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "short_factor",
            "long_factor", "attention_factor") and v is not None}}
        scaling = tuple(sorted(keep.items()))
    n_heads = cfg["num_attention_heads"]
    dim = cfg["hidden_size"]
    window, kinds = _window(cfg, arch)
    granite, gemma = arch == "granite", arch in _GEMMA
    qpas = cfg.get("query_pre_attn_scalar", 256) if gemma else None
    moe = _moe_args(cfg, arch)
    try:
        return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                         n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                         head_dim=cfg.get("head_dim") or dim // n_heads, hidden_dim=cfg["intermediate_size"],
                         vocab_size=cfg["vocab_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                         rope_theta=theta, rope_scaling=scaling,
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                         hidden_act=(cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else
                         cfg.get("hidden_act", "silu"),
                         qkv_bias=arch == "qwen2" or (arch == "qwen2_moe" and cfg.get("qkv_bias", True) is not False)
                         or (arch in ("llama", "qwen3", "olmo2", "granite") + _GEMMA
                                                      and bool(cfg.get("attention_bias"))),
                         o_bias=arch in ("llama", "qwen3", "olmo2", "granite") + _GEMMA
                         and bool(cfg.get("attention_bias")),
                         mlp_bias=arch in ("llama", "granite") and bool(cfg.get("mlp_bias")),
                         sliding_window=window, layer_types=kinds,
                         attention_multiplier=float(cfg.get("attention_multiplier", 1.0)) if granite else
                         float(qpas) ** -0.5 if gemma else None,
                         embed_scale="sqrt_dim" if gemma else "none",
                         attn_softcap=_float_or_none(cfg.get("attn_logit_softcapping")) if gemma else None,
                         final_softcap=_float_or_none(cfg.get("final_logit_softcapping")) if gemma else None,
                         rope_local_theta=local_theta,
                         embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite else 1.0,
                         residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
                         logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
                         qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmo2": "proj"}.get(
                             arch, "none"), **moe,
                         norm_placement={"olmo2": "post", "gemma2": "sandwich", "gemma3": "sandwich"}.get(arch, "pre"),
                         norm_scale={"olmo2": "float32", "gemma2": "offset", "gemma3": "offset"}.get(arch, "activation"),
                         max_position=int(cfg.get("max_position_embeddings", 8192)), arch=arch)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from None


def _moe_args(cfg: dict, arch: str) -> dict:
    """ModelArgs' mixture-of-experts fields as transformers builds the family's layers."""
    if arch not in _MOE:
        return {}
    # absent fields take the config class's defaults, as transformers does
    n = cfg.get("num_local_experts", 8) if arch == "mixtral" else cfg.get(
        "num_experts", cfg.get("num_local_experts", 60 if arch == "qwen2_moe" else 128))
    if arch == "mixtral":
        return dict(n_experts=n, n_active_experts=cfg.get("num_experts_per_tok", 2),
                    moe_hidden_dim=cfg["intermediate_size"], norm_topk_prob=True, moe_weight_dtype="float32")
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return dict(n_experts=n, n_active_experts=cfg.get("num_experts_per_tok", 8 if arch == "qwen3_moe" else 4),
                moe_hidden_dim=cfg.get("moe_intermediate_size", 768 if arch == "qwen3_moe" else 1408),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_dim=int(cfg.get("shared_expert_intermediate_size", 5632) or 0) if arch == "qwen2_moe"
                else 0,
                dense_layers=dense)


def _float_or_none(v):
    return None if v is None else float(v)


def _window(cfg: dict, arch: str) -> tuple:
    """(sliding_window, layer_types) as transformers applies them: Mistral's window on every layer; Qwen2's and
    Qwen3's only with use_sliding_window, on the layers layer_types names (absent: from max_window_layers on)."""
    window = cfg.get("sliding_window") if arch in _WINDOW_ARCHS else None
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if window is None:
        return None, ()
    n = cfg["num_hidden_layers"]
    if arch not in ("mistral", "phi3") and cfg.get("layer_types") is not None:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in cfg["layer_types"])
    elif arch in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers")
        first = n if first is None else first
        kinds = tuple("sliding" if i >= first else "full" for i in range(n))
    elif arch in _GEMMA:  # transformers' defaults: Gemma 2 alternates from a sliding layer, Gemma 3 five in six
        every = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        kinds = tuple("sliding" if (i + 1) % every else "full" for i in range(n))
    else:
        kinds = ()
    return window, (() if kinds == ("sliding",) * n else kinds)


CONFIG_MAX_BYTES = 16 << 20  # a transformers config is kilobytes; anything near this is not one


# The fields any decoder's config names with one meaning, checked whatever the family (ours or one only
# transformers runs) before anything is read from them: field -> check(value) -> None or what it must be.
COMMON_FIELDS = {
    "architectures": _names, "model_type": lambda v, c, a: None if isinstance(v, str) else "a string",
    **{k: _positive_int for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                  "vocab_size", "max_position_embeddings")},
    **{k: lambda v, c, a: None if v is None else _positive_int(v, c, a) for k in ("num_key_value_heads", "head_dim")},
    "rms_norm_eps": _finite_positive, "rope_theta": _finite_positive,
    "tie_word_embeddings": lambda v, c, a: None if isinstance(v, bool) else "true or false",
}


def _read_config(path: str, where: str) -> dict:
    """config.json as a JSON object: a regular file (never a FIFO or a device), at most CONFIG_MAX_BYTES, strict
    JSON (NaN and Infinity are not numbers), the COMMON_FIELDS typed."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.lexists(cfg_path):
        raise ModelLoadError(f"{where}: no config.json (expected a local Hugging Face checkpoint directory)")
    raw = read_small_file(cfg_path, "config.json", CONFIG_MAX_BYTES)
    try:
        cfg = strict_json(raw)
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{where}: config.json is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: config.json must hold a JSON object (got {type(cfg).__name__})")
    for key, check in COMMON_FIELDS.items():
        if key in cfg and check(cfg[key], cfg, "") is not None:
            raise ModelLoadError(f"{where}: config.json {key}={_short(cfg[key])} is not valid (it must be "
                                 f"{check(cfg[key], cfg, '')})")
    return cfg


def _weight_files(path: str, where: str) -> list[str]:
    """The checkpoint's safetensors files, each header checked against its file (engine/models/safetensors_check.py),
    no tensor named by two of them."""
    try:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    except OSError as e:
        raise ModelLoadError(f"{where}: cannot list the checkpoint directory ({e.strerror})") from None
    if not files:
        raise ModelLoadError(f"{where}: no *.safetensors files (pickled .bin checkpoints are not loaded)")
    owner = {}
    for fn in files:
        for tensor in safetensors_check.check(os.path.join(path, fn), where):
            if tensor in owner:
                raise ModelLoadError(f"{where}: tensor {_short(tensor)} is defined twice, in {owner[tensor]} and "
                                     f"{fn} (which one the model holds would depend on the order of reading)")
            owner[tensor] = fn
    return files


def load_hf_dir(path: str) -> Snapshot:
    where = f"hf:{path}"
    cfg = _read_config(path, where)
    args = args_from_hf_config(cfg, where)
    budget.check_model(args, where)  # from the config alone, before a single weight is read
    files = _weight_files(path, where)
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ModelLoadError("hf: models need safetensors: pip install 'prefill-diff[hf]'") from None
    state = {}
    for fn in files:
        try:
            tensors = load_file(os.path.join(path, fn))
        except Exception as e:  # the header was checked; what remains is the library's own refusal of the data
            raise ModelLoadError(f"{where}: cannot read {fn} ({type(e).__name__}: {str(e)[:200]})") from None
        for name, t in tensors.items():
            for part, tensor in unfused(name, t, args, where):
                ours = hf_to_ours(part, args.norm_placement, MOE_STYLE.get(args.arch))
                if ours is not None:
                    state[ours] = tensor.float()
                elif not part.endswith("rotary_emb.inv_freq"):
                    raise ModelLoadError(f"{where}: unexpected tensor {name!r} in {fn}")
    if not args.tie_embeddings and "output.weight" not in state:
        raise ModelLoadError(f"{where}: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
                             "(transformers would initialise it at random)")
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    check_state(args, state, where)
    tokenizer = hf_tokenizer(path)
    if tokenizer is not None:
        args = args.replace(tokenizer_vocab_size=tokenizer.vocab_size)
    return Snapshot(where, args, state, tokenizer=tokenizer)


# The sizes a decoder's config names, for a model only transformers runs: our name <- its fields, first found.
_SIZES = {"dim": ("hidden_size", "n_embd", "d_model"), "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
          "n_heads": ("num_attention_heads", "n_head"), "vocab_size": ("vocab_size",)}


def describe_hf_dir(path: str, refusal: str) -> Snapshot:
    """A checkpoint our engine does not implement, described for the transformers engine alone: the sizes
    transformers' config names (the recorded tensors' shapes), digests of config.json and of the weight files
    (its identity), and why our engine refused it (``Snapshot.foreign``). No weight is read here."""
    where = f"hf:{path}"
    cfg = _read_config(path, where)
    files = _weight_files(path, where)
    sizes = {}
    for ours, names in _SIZES.items():
        value = next((cfg[n] for n in names if n in cfg), None)
        if _positive_int(value, cfg, "") is not None:
            raise ModelLoadError(f"{where}: config.json needs {' or '.join(names)} as a positive integer "
                                 f"(got {_short(value)})")
        sizes[ours] = value
    n_kv = cfg["num_key_value_heads"] if cfg.get("num_key_value_heads") is not None else sizes["n_heads"]
    head_dim = cfg["head_dim"] if cfg.get("head_dim") is not None else sizes["dim"] // sizes["n_heads"]
    for name, value in (("num_key_value_heads", n_kv), ("head_dim", head_dim)):
        if _positive_int(value, cfg, "") is not None:
            raise ModelLoadError(f"{where}: config.json {name} must be a positive integer (got {_short(value)})")
    max_pos = cfg.get("max_position_embeddings", 8192)
    try:
        args = ModelArgs(dim=sizes["dim"], n_layers=sizes["n_layers"], n_heads=sizes["n_heads"], n_kv_heads=n_kv,
                         head_dim=head_dim, hidden_dim=cfg.get("intermediate_size") or 1,
                         vocab_size=sizes["vocab_size"], norm_eps=1e-6,
                         max_position=max_pos if isinstance(max_pos, int) and max_pos > 0 else 8192,
                         tie_embeddings=bool(cfg.get("tie_word_embeddings")),
                         arch=str(cfg.get("model_type") or (cfg.get("architectures") or ["?"])[0])[:64])
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{where}: {e}") from None
    budget.check_model(args, where)  # its sizes alone (a lower bound: its own layers may hold more)
    digest = hashlib.sha256()
    for fn in ["config.json"] + files:
        digest.update(fn.encode() + b"\0")
        with open(os.path.join(path, fn), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    tokenizer = hf_tokenizer(path)
    if tokenizer is not None:
        args = args.replace(tokenizer_vocab_size=tokenizer.vocab_size)
    return Snapshot(where, args, {}, tokenizer=tokenizer, _digest="sha256:" + digest.hexdigest(), foreign=refusal)
