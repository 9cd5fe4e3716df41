"""Real checkpoints: local Hugging Face directories and llama.cpp GGUF files.

Only local files are read; nothing is downloaded. Weights are loaded with
safetensors (never pickle) or the gguf package, and mapped to our module names.
"""
from __future__ import annotations

import json
import os
import re

from .errors import ConfigError, ModelLoadError
from .model import ModelArgs
from .skeleton import state_shapes
from .snapshot import Snapshot

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Olmo2ForCausalLM": "olmo2"}

# our name <- Hugging Face name (per layer with {i})
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias", "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias", "feed_forward.w2.bias": "mlp.down_proj.bias",
}
# the norms' names depend on where the family puts them: Llama's "post_attention_layernorm" is the norm before
# the MLP, OLMo 2's the norm on the attention's output
_PRE_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_POST_NORMS = {"attention_post_norm.weight": "post_attention_layernorm.weight",
               "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight", "output.bias": "lm_head.bias"}


def _layer_map(post: bool) -> dict:
    return {**_LAYER_MAP, **(_POST_NORMS if post else _PRE_NORMS)}


def ours_to_hf(name: str, post: bool = False) -> str:
    """Our tensor name under Hugging Face's (``post``: the family places its norms after the sub-layers)."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = re.match(r"layers\.(\d+)\.(.+)", name)
    names = _layer_map(post)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise KeyError(name)


def hf_to_ours(name: str, post: bool = False) -> str | None:
    for ours, hf in _TOP_MAP.items():
        if name == hf:
            return ours
    m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for ours, hf in _layer_map(post).items():
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}"
    return None


def hf_state_dict(state: dict) -> dict:
    """Our snapshot state under Hugging Face names (for loading into transformers)."""
    post = any(k.endswith("attention_post_norm.weight") for k in state)
    return {ours_to_hf(k, post): v for k, v in state.items()}


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
    if v is None:
        return None
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        return None  # Qwen2 and Qwen3 apply the window only with use_sliding_window
    return "null (sliding-window attention is not implemented)"


def _layer_types(v, cfg, arch):
    return None if v is None or (isinstance(v, list) and all(t == "full_attention" for t in v)) else \
        "every layer 'full_attention' (sliding-window layers are not implemented)"


def _model_type(v, cfg, arch):
    return None if v is None or v == arch else f"{arch!r} (the model class named in architectures)"


def _rope_dict(v, cfg, arch):
    if v is None:
        return None
    if not isinstance(v, dict):
        return "a table"
    kind = v.get("rope_type", v.get("type", "default"))
    keys = {"default": set(), "linear": {"factor"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
    if kind not in keys:
        return "rope_type default, linear or llama3"
    extra = sorted(set(v) - keys[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        return f"for rope_type {kind!r} only the keys {sorted(keys[kind] | {'rope_type', 'rope_theta'})} (got {extra})"
    missing = sorted(keys[kind] - set(v))
    if missing:
        return f"rope_type {kind!r} with {missing}"
    if v.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor 1.0 (partial rotary embeddings are not implemented)"
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
    "architectures": (_USED, "picks llama, mistral, qwen2, qwen3 or olmo2; anything else is refused before this "
                             "table"),
    "model_type": (_model_type, "transformers builds the model from model_type: it must name the same class"),
    "hidden_size": (_positive_int, "d, read into ModelArgs.dim"),
    "num_hidden_layers": (_positive_int, "L, ModelArgs.n_layers"),
    "num_attention_heads": (_positive_int, "H_q, ModelArgs.n_heads"),
    "num_key_value_heads": (lambda v, c, a: None if v is None else _positive_int(v, c, a),
                            "H_kv (absent: H_q), ModelArgs.n_kv_heads"),
    "head_dim": (_head_dim, "d_h (absent: hidden_size / num_attention_heads), ModelArgs.head_dim"),
    "intermediate_size": (_positive_int, "the MLP width, ModelArgs.hidden_dim"),
    "vocab_size": (_positive_int, "|V|, ModelArgs.vocab_size"),
    "rms_norm_eps": (_USED, "ModelArgs.norm_eps (validated there: positive)"),
    "max_position_embeddings": (_USED, "ModelArgs.max_position; bounds the positions a prompt may use"),
    "tie_word_embeddings": (_one_of(True, False), "both implemented; false needs an lm_head.weight in the checkpoint"),
    # -- what each layer computes
    "hidden_act": (_one_of("silu"), "the MLP is silu(x·W_g) ⊙ x·W_u: only silu is implemented"),
    "attention_bias": (_arch_only(("llama", "qwen3", "olmo2"), _one_of(True, False)),
                       "Llama, Qwen3 and OLMo 2: true adds q/k/v and o_proj biases; Qwen2 always has q/k/v biases "
                       "and no o_proj bias, Mistral none: their code ignores the field"),
    "mlp_bias": (_arch_only(("llama",), _one_of(True, False)), "Llama: biases on the MLP's three projections; "
                                                               "the others' code ignores it"),
    "partial_rotary_factor": (_one_of(1.0, 1, None), "RoPE over the whole head: partial rotary is not implemented"),
    "rope_interleaved": (_one_of(False), "RoPE is rotate-half, never interleaved pairs"),
    "use_qk_norm": (_one_of(False), "QK-norm (a norm on queries and keys) is not implemented"),
    "qk_norm": (_one_of(False), "QK-norm is not implemented"),
    "qk_layernorm": (_one_of(False), "QK-norm is not implemented"),
    "use_mrope": (_one_of(False), "multimodal RoPE is not implemented"),
    "rope_theta": (_USED, "θ_base, ModelArgs.rope_theta (validated there: positive)"),
    "rope_parameters": (_rope_dict, "transformers 5: rope_theta and rope_type default, linear or llama3"),
    "rope_scaling": (_rope_dict, "transformers 4: rope_type (or type) default, linear or llama3; null"),
    "sliding_window": (_sliding_window, "sliding-window attention is not implemented (Qwen2: unless enabled)"),
    "use_sliding_window": (_one_of(False), "Qwen2, Qwen3: sliding-window attention is not implemented"),
    "max_window_layers": (_NO_EFFECT, "Qwen2, Qwen3: which layers use the window, only with use_sliding_window"),
    "layer_types": (_layer_types, "every layer full causal attention"),
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
        "transformers.js_config")},
}


def _check_fields(cfg: dict, arch: str, where: str) -> None:
    for key, value in cfg.items():
        if key not in HF_FIELDS:
            raise ModelLoadError(f"{where}: config field {key}={_short(value)} is not one our engine implements "
                                 "(unknown field; supported fields: see prefill_diff.engine.hub.HF_FIELDS)")
        check, why = HF_FIELDS[key]
        want = None if check is None else check(value, cfg, arch)
        if want is not None:
            raise ModelLoadError(f"{where}: config field {key}={_short(value)} is not supported "
                                 f"(supported: {want}; {why})")


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def args_from_hf_config(cfg: dict, where: str) -> ModelArgs:
    """ModelArgs from a transformers config.json, after checking every field against HF_FIELDS."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{where}: architecture {archs or cfg.get('model_type')} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if arch == "mistral" and cfg.get("sliding_window"):
        raise ModelLoadError(f"{where}: sliding-window attention is not supported (sliding_window="
                             f"{cfg['sliding_window']})")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ModelLoadError(f"{where}: config.json has no {key}")
    _check_fields(cfg, arch, where)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = ()
    if kind not in (None, "default"):
        keep = {"rope_type": kind, **{k: v for k, v in rope.items() if k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
        scaling = tuple(sorted(keep.items()))
    n_heads = cfg["num_attention_heads"]
    dim = cfg["hidden_size"]
    try:
        return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                         n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                         head_dim=cfg.get("head_dim") or dim // n_heads, hidden_dim=cfg["intermediate_size"],
                         vocab_size=cfg["vocab_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                         rope_theta=theta, rope_scaling=scaling,
                         tie_embeddings=bool(cfg.get("tie_word_embeddings")), hidden_act=cfg.get("hidden_act", "silu"),
                         qkv_bias=arch == "qwen2" or (arch in ("llama", "qwen3", "olmo2")
                                                      and bool(cfg.get("attention_bias"))),
                         o_bias=arch in ("llama", "qwen3", "olmo2") and bool(cfg.get("attention_bias")),
                         mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias")),
                         qk_norm={"qwen3": "head", "olmo2": "proj"}.get(arch, "none"),
                         norm_placement="post" if arch == "olmo2" else "pre",
                         norm_scale="float32" if arch == "olmo2" else "activation",
                         max_position=int(cfg.get("max_position_embeddings", 8192)), arch=arch)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from None


def check_state(args: ModelArgs, state: dict, where: str) -> None:
    """Every tensor is one the model uses, with the shape it expects; none is missing (lm_head when tied)."""
    want = state_shapes(args)
    for name, t in state.items():
        if name not in want:
            raise ModelLoadError(f"{where}: tensor {name!r} is not part of the model our engine implements "
                                 f"(arch {args.arch}, qkv_bias={args.qkv_bias}, o_bias={args.o_bias}, "
                                 f"mlp_bias={args.mlp_bias}, qk_norm={args.qk_norm}, "
                                 f"norm_placement={args.norm_placement}, "
                                 f"lm_head_bias={args.lm_head_bias})")
        if tuple(t.shape) != want[name]:
            raise ModelLoadError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                 f"{want[name]}")
    missing = sorted(set(want) - set(state))
    if missing:
        raise ModelLoadError(f"{where}: weights are missing tensors {missing[:5]}")


def load_hf_dir(path: str) -> Snapshot:
    where = f"hf:{path}"
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{where}: no config.json (expected a local Hugging Face checkpoint directory)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where}: cannot read config.json ({e})") from None
    args = args_from_hf_config(cfg, where)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{where}: no *.safetensors files (pickled .bin checkpoints are not loaded)")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ModelLoadError("hf: models need safetensors: pip install 'prefill-diff[hf]'") from None
    state = {}
    for fn in files:
        for name, t in load_file(os.path.join(path, fn)).items():
            ours = hf_to_ours(name, post=args.norm_placement == "post")
            if ours is not None:
                state[ours] = t.float()
            elif not name.endswith("rotary_emb.inv_freq"):
                raise ModelLoadError(f"{where}: unexpected tensor {name!r} in {fn}")
    if not args.tie_embeddings and "output.weight" not in state:
        raise ModelLoadError(f"{where}: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
                             "(transformers would initialise it at random)")
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    check_state(args, state, where)
    tokenizer = _hf_tokenizer(path)
    if tokenizer is not None:
        args = args.replace(tokenizer_vocab_size=tokenizer.vocab_size)
    return Snapshot(where, args, state, tokenizer=tokenizer)


class Tokenizer:
    """The model's own tokenizer: encode text without special tokens, decode ids for reports."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = len(tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def _hf_tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                  "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:  # a broken tokenizer must not hide which file is bad
        raise ModelLoadError(f"hf:{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
