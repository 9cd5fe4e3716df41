"""transformers' op replay (``replay_ops``; engine/replaying.py runs the loop): each op computed by transformers'
own modules and functions, on the reference's input to it.

    attn_norm  input_layernorm(layer_input)         q, k, v   q_proj, k_proj, v_proj (Phi-3: qkv_proj, split)
    q_norm     the attention's q_norm (per head when its weight is one head's)
    q_rope     the modeling module's apply_rotary_pos_emb with the model's rotary_emb cos/sin at the sample's
               position ids, on q_norm (q without QK-norm)
    attn_core  the configured attention interface (eager, sdpa) with a causal mask over the sample's cells, as
               transformers builds it for one unpadded row (eager: 0 / the dtype's min; sdpa: is_causal)
    o_proj     o_proj(attn_core)                    attn_residual  layer_input + o_proj (× Granite's multiplier)
    mlp_norm   post_attention_layernorm (Gemma: pre_feedforward_layernorm)
    gate, up   gate_proj, up_proj (Phi-3: gate_up_proj, split)   act_mul  act_fn(gate) * up   down  down_proj
"""
from __future__ import annotations

import inspect
import sys

import torch

from ..replaying import INPUTS, ROPE_WITHOUT_QK_NORM, causal_visible, replay
from ..models.dtypes import torch_dtype
from .hf_ops import _ATTN, _MLP, _child, _linear


def replay_ops(prep, given):
    """transformers' model, built as the side's execute builds it, replaying its ops on ``given``."""
    from .hf_engine import build_model  # hf_engine imports this module at its end
    run = prep.side.run
    model = build_model(prep.snapshot, run.dtype, run.options.attn_implementation, run.options.load)
    return replay_model(model, given, run.dtype)


def replay_model(model, given, dtype: str):
    """A built transformers model's ops replayed on ``given`` (a ReplayInput): a ReplayOutput."""
    from .hf_engine import decoder
    layers, _ = decoder(model)
    impl = model.config._attn_implementation
    return replay(given, torch_dtype(dtype), dtype, lambda layer: layer_ops(model, layers, layer),
                  notes=[f"attention replayed with transformers' {impl} attention interface"])


def _heads(x, head_dim):
    return x.view(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)  # (1, heads, T, head_dim)


def _rows(x):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)  # (1, T, heads·head_dim)


def _rope(model, attn, layer: int, which: int):
    """fn rotating (1, T, heads·D) at the sample's position ids as the layer does (``which``: 0 q, 1 k)."""
    module = sys.modules[type(attn).__module__]
    rotary = model.model.rotary_emb
    typed = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3: per layer type
    head_dim = attn.head_dim

    def fn(inputs, sample):
        x = _heads(inputs[0], head_dim)
        pos = torch.as_tensor(sample.positions, dtype=torch.long)[None]  # (1, T)
        extra = (model.config.layer_types[layer],) if typed else ()
        cos, sin = rotary(x, pos, *extra)
        return _rows(module.apply_rotary_pos_emb(x, x, cos, sin)[which])
    return fn


def _attention(model, attn):
    """fn: the model's attention interface on (q_rope, k_rope, v), causal over the sample's cells."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    module = sys.modules[type(attn).__module__]
    impl = model.config._attn_implementation
    interface = module.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    window = getattr(attn, "sliding_window", None)
    extra = {"sliding_window": window}
    if getattr(attn, "attn_logit_softcapping", None) is not None:  # Gemma 2
        extra["softcap"] = attn.attn_logit_softcapping

    def fn(inputs, sample):
        q, k, v = (_heads(x, attn.head_dim) for x in inputs)
        T = q.shape[2]
        vis = causal_visible(T, window)[None, None]  # (1, 1, T, T)
        if impl == "eager":
            mask = torch.zeros(vis.shape, dtype=q.dtype).masked_fill(~vis, torch.finfo(q.dtype).min)
        else:
            mask = None if window is None or window >= T else vis
        out, _ = interface(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **extra)
        return out.reshape(1, T, -1)  # (1, T, heads, head_dim) -> (1, T, heads·head_dim)
    return fn


def _qk_norm(norm, head_dim):
    if norm.weight.numel() == head_dim:  # per head (Qwen3, Gemma 3)
        return lambda inputs, sample: norm(inputs[0].view(1, inputs[0].shape[1], -1, head_dim)).flatten(2)
    return lambda inputs, sample: norm(inputs[0])  # the whole projection (OLMo 2)


def layer_ops(model, layers, layer: int) -> dict:
    """{op name: (input names, fn) or why not} for decoder layer ``layer`` of transformers' model."""
    dec = layers[layer]
    attn, mlp = _child(dec, _ATTN), _child(dec, _MLP)
    cfg, cls = model.config, type(dec).__name__
    one = lambda module: lambda inputs, sample: module(inputs[0])  # noqa: E731
    part = lambda module, sizes, i: lambda inputs, sample: torch.split(module(inputs[0]), sizes, -1)[i]  # noqa: E731
    q_w, kv_w = cfg.num_attention_heads * attn.head_dim, cfg.num_key_value_heads * attn.head_dim
    ops, why = {"q_rope": _rope(model, attn, layer, 0), "k_rope": _rope(model, attn, layer, 1),
                "attn_core": _attention(model, attn), "o_proj": one(attn.o_proj)}, {}
    if (qkv := _linear(attn, "qkv_proj")) is not None:  # Phi-3
        ops.update({n: part(qkv, (q_w, kv_w, kv_w), i) for i, n in enumerate(("q", "k", "v"))})
    else:
        ops.update(q=one(attn.q_proj), k=one(attn.k_proj), v=one(attn.v_proj))
    qk_norm = getattr(attn, "q_norm", None) is not None
    if qk_norm:
        ops.update(q_norm=_qk_norm(attn.q_norm, attn.head_dim), k_norm=_qk_norm(attn.k_norm, attn.head_dim))
    else:
        why.update(q_norm=f"{cls} has no QK-norm", k_norm=f"{cls} has no QK-norm")
    pre = getattr(dec, "input_layernorm", None)
    mlp_norm = getattr(dec, "pre_feedforward_layernorm", None) or (pre and dec.post_attention_layernorm)
    if pre is None:
        why.update(attn_norm=f"{cls} has no input norm", mlp_norm=f"{cls} has no input norm")
    else:
        ops.update(attn_norm=one(pre), mlp_norm=one(mlp_norm))
    if pre is None or hasattr(dec, "pre_feedforward_layernorm"):
        why["attn_residual"] = f"{cls} normalises o_proj's output before the residual sum (a post-norm)"
    else:
        scale = getattr(cfg, "residual_multiplier", 1.0)  # Granite
        ops["attn_residual"] = lambda inputs, sample: inputs[0] + (inputs[1] if scale == 1.0 else inputs[1] * scale)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if _linear(mlp, "down_proj") is None or act is None:
        moe = f"{cls}'s MLP ({type(mlp).__name__}) is a mixture of experts: no single gate, up or down projection"
        why.update(gate=moe, up=moe, act_mul=moe, down=moe)
    else:
        if (gu := _linear(mlp, "gate_up_proj")) is not None:  # Phi-3: gate, then up
            ops.update(gate=part(gu, gu.out_features // 2, 0), up=part(gu, gu.out_features // 2, 1))
        else:
            ops.update(gate=one(mlp.gate_proj), up=one(mlp.up_proj))
        ops.update(act_mul=lambda inputs, sample: act(inputs[0]) * inputs[1], down=one(mlp.down_proj))
    inputs = {**INPUTS, **({} if qk_norm else ROPE_WITHOUT_QK_NORM)}
    return {**{name: (inputs[name], fn) for name, fn in ops.items()}, **why}
