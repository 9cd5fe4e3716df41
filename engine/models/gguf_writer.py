"""Write a snapshot as a llama.cpp GGUF file (F32 or F16 weights), so llama.cpp can run any model the tool can.

The inverse of gguf_loader: our names -> GGUF names; for the "llama" architecture the Q/K rows (and
their biases) are permuted into llama.cpp's RoPE layout, as llama.cpp's own converter does. Models with
Q/K/V biases alone are written as "qwen2" and models with QK-norm as "qwen3" (Hugging Face's RoPE
layout, rows kept). The vocabulary is written as "no_vocab" with the vocabulary size: llama.cpp is fed
token ids, never text.
"""
from __future__ import annotations

import numpy as np

from ..shared.errors import ConfigError, ModelLoadError
from .gguf_loader import _LAYER, _NAMES

_TOP = {ours: theirs for theirs, ours in _NAMES.items()}
_PER_LAYER = {ours: theirs for theirs, ours in _LAYER.items()}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row permutation of Q/K for its RoPE (the inverse of gguf_loader.unpermute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_arch(args) -> str:
    """llama.cpp's graph for the model: qwen3 with QK-norm, qwen2 with Q/K/V biases alone, else llama (whose
    graph adds any Q/K/V, output and MLP biases the file holds)."""
    if args.qk_norm == "head":
        return "qwen3"
    if args.qkv_bias and not (args.o_bias or args.mlp_bias):
        return "qwen2"
    return "llama"


def check_convertible(snapshot) -> None:
    """Refuse, in one line, what llama.cpp's llama/qwen2 graphs cannot express from our weights."""
    a = snapshot.args
    why = []
    if a.rope_scaling:
        why.append(f"RoPE scaling {dict(a.rope_scaling)}")
    if a.lm_head_bias:
        why.append("an output-layer bias")
    if a.norm_placement != "pre" or a.qk_norm == "proj" or a.norm_scale == "float32":
        why.append(f"norm_placement={a.norm_placement}, qk_norm={a.qk_norm}, norm_scale={a.norm_scale} ({a.arch}: the "
                   "GGUF writer emits llama, qwen2 and qwen3 only)")
    if a.sliding_window is not None:
        why.append(f"a sliding window (W={a.sliding_window}; llama.cpp's llama, qwen2 and qwen3 graphs attend to every "
                   "earlier token)")
    if a.norm_scale == "offset" or a.embed_scale != "none" or a.hidden_act != "silu" or a.attn_softcap is not None \
            or a.final_softcap is not None or a.rope_local_theta is not None:
        why.append("Gemma's (1 + w) norms, GeGLU, embedding scale, soft-caps or local RoPE base")
    if a.attention_multiplier is not None or (a.embedding_multiplier, a.residual_multiplier,
                                              a.logits_scaling) != (1.0, 1.0, 1.0):
        why.append("Granite's multipliers (the GGUF writer emits llama, qwen2 and qwen3 only)")
    if a.qk_norm == "head" and (a.o_bias or a.qkv_bias or a.mlp_bias):
        why.append("QK-norm with biases (llama.cpp's qwen3 graph has none)")
    if a.n_experts:
        why.append(f"a mixture of experts ({a.arch}; the GGUF writer emits dense llama, qwen2 and qwen3 only)")
    if a.dropout:
        why.append(f"dropout={a.dropout}")
    if snapshot.adapter is not None:
        why.append(f"a LoRA adapter ({snapshot.adapter.id})")
    if why:
        raise ConfigError(f"model {snapshot.source}: the llama.cpp engine cannot run a model with "
                          + ", ".join(why) + " (converted to GGUF, llama.cpp would compute another model)")


def _name(ours: str) -> str:
    if ours in _TOP:
        return _TOP[ours]
    _, i, *rest = ours.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{_PER_LAYER[module]}.{kind}"


def write_gguf(snapshot, path: str, wtype: str = "f32") -> None:
    """Write ``snapshot`` to ``path``: 2-D weights in ``wtype`` (f32 | f16), norms and biases in f32."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("converting a model for llama.cpp needs the gguf package: "
                             "pip install 'prefill-diff[llamacpp]'") from None
    check_convertible(snapshot)
    a = snapshot.args
    arch = gguf_arch(a)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"prefill-diff conversion of {snapshot.source}")
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_position)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.hidden_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(float(a.rope_theta))
    w.add_layer_norm_rms_eps(float(a.norm_eps))
    w.add_vocab_size(a.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if wtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("no_vocab")
    for ours in sorted(snapshot.state):
        if ours == "output.weight" and a.tie_embeddings:
            continue  # llama.cpp reuses token_embd.weight when output.weight is absent
        t = snapshot.state[ours].detach().float().cpu().numpy()
        if arch == "llama" and ours.endswith(("wq.weight", "wq.bias")):
            t = permute(t, a.n_heads)
        elif arch == "llama" and ours.endswith(("wk.weight", "wk.bias")):
            t = permute(t, a.n_kv_heads)
        if wtype == "f16" and t.ndim == 2:
            t = t.astype(np.float16)
        w.add_tensor(_name(ours), np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
