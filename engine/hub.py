"""Real checkpoints: local Hugging Face directories and llama.cpp GGUF files.

Only local files are read; nothing is downloaded. Weights are loaded with
safetensors (never pickle) or the gguf package, and mapped to our module names.
"""
from __future__ import annotations

import json
import os
import re

import torch

from .errors import ModelLoadError
from .model import ModelArgs
from .snapshot import Snapshot

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}

# our name <- Hugging Face name (per layer with {i})
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight", "output.bias": "lm_head.bias"}


def ours_to_hf(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = re.match(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise KeyError(name)


def hf_to_ours(name: str) -> str | None:
    for ours, hf in _TOP_MAP.items():
        if name == hf:
            return ours
    m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for ours, hf in _LAYER_MAP.items():
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}"
    return None


def hf_state_dict(state: dict) -> dict:
    """Our snapshot state under Hugging Face names (for loading into transformers)."""
    return {ours_to_hf(k): v for k, v in state.items()}


def args_from_hf_config(cfg: dict, where: str) -> ModelArgs:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{where}: architecture {archs or cfg.get('model_type')} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "mistral"):
        raise ModelLoadError(f"{where}: sliding-window attention is not supported (sliding_window="
                             f"{cfg['sliding_window']})")
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
    return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                     head_dim=cfg.get("head_dim") or dim // n_heads, hidden_dim=cfg["intermediate_size"],
                     vocab_size=cfg["vocab_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings")),
                     qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias")),
                     max_position=int(cfg.get("max_position_embeddings", 8192)), arch=arch)


def load(source: str) -> Snapshot:
    if source.startswith("hf:"):
        return load_hf_dir(source[3:])
    from .gguf_loader import load_gguf, smollm2_path
    if source == "smollm2":
        return load_gguf(smollm2_path(), source)
    return load_gguf(source[5:], source)


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
            ours = hf_to_ours(name)
            if ours is not None:
                state[ours] = t.float()
            elif not name.endswith("rotary_emb.inv_freq"):
                raise ModelLoadError(f"{where}: unexpected tensor {name!r} in {fn}")
    if args.tie_embeddings or "output.weight" not in state:
        args = args.replace(tie_embeddings=True)
        state["output.weight"] = state["tok_embeddings.weight"]
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
