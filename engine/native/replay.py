"""Our engine's op replay (``replay_ops``; engine/replaying.py runs the loop): each op of engine/native/model.py,
computed by the model's own module, on the reference's input to it.

    attn_norm  attention_norm(layer_input)          q, k, v   wq, wk, wv(attn_norm)
    q_norm     q_norm(q), per head or whole          q_rope    apply_rope(q_norm, or q without QK-norm) with
                                                               rope_cos_sin at the sample's positions
    attn_core  the configured kernel on q_rope, k_rope, v, causal over the sample's cells in token order
    o_proj     wo(attn_core)                         attn_residual  layer_input + o_proj (scaled as the block adds it)
    mlp_norm   ffn_norm(attn_residual)               gate, up  w1, w3(mlp_norm)
    act_mul    act(gate) * up                        down      w2(act_mul)
"""
from __future__ import annotations

import torch

from ..replaying import INPUTS, ROPE_WITHOUT_QK_NORM, replay
from .attention import AttentionMask
from .model import MoE, apply_rope, rope_cos_sin


def replay_ops(prep, given):
    """The planned engine's ops replayed on ``given`` (a ReplayInput): a ReplayOutput."""
    engine = prep.engine
    if engine.tp is not None:
        why = "a tensor-parallel rank holds a shard of each projection: replay runs on one process (tp = 1)"
        return replay(given, engine.dtype, prep.side.run.dtype, lambda layer: dict.fromkeys(INPUTS, why))
    kernel = prep.side.run.options.kernel
    return replay(given, engine.dtype, prep.side.run.dtype, lambda layer: layer_ops(engine, layer),
                  notes=[f"attention replayed with our engine's {kernel} kernel"])


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(1, T, heads·head_dim) -> (1, heads, T, head_dim)."""
    return x.view(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(1, heads, T, head_dim) -> (1, T, heads·head_dim)."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def _rope(engine, layer: int):
    """fn(x (1, T, heads·D), sample) -> x rotated as layer ``layer`` rotates, at the sample's positions."""
    args = engine.args

    def fn(inputs, sample):
        pos = torch.as_tensor(sample.positions, dtype=torch.long)[None]  # (1, T)
        if args.local_rope(layer):
            cos, sin = rope_cos_sin(pos, engine.inv_freq_local, engine.dtype)
        else:
            cos, sin = rope_cos_sin(pos, engine.call_inv_freq(pos), engine.dtype, engine.rope_scale)
        return _rows(apply_rope(_heads(inputs[0], args.head_dim), cos, sin))
    return fn


def _attention(engine, layer: int):
    def fn(inputs, sample):
        q, k, v = (_heads(x, engine.args.head_dim) for x in inputs)
        T = q.shape[2]
        tok, seq = torch.arange(T)[None], torch.zeros((1, T), dtype=torch.long)
        mask = AttentionMask(tok, tok, seq, seq, sentinel=True)
        mask.causal = True
        mask = mask.windowed(engine.args.window(layer))
        return _rows(engine.kernel(q, k, v, mask))
    return fn


def _qk_norm(attn, head_dim: int, which: str):
    norm = getattr(attn, f"{which}_norm")
    if attn.qk_norm == "head":
        return lambda inputs, sample: norm(inputs[0].view(1, inputs[0].shape[1], -1, head_dim)).flatten(2)
    return lambda inputs, sample: norm(inputs[0])


def layer_ops(engine, layer: int) -> dict:
    """{op name: (input names, fn) or why not} for layer ``layer`` of our model."""
    args, block = engine.args, engine.model.layers[layer]
    attn, ff = block.attention, block.feed_forward
    one = lambda module: lambda inputs, sample: module(inputs[0])  # noqa: E731
    ops = {"q": one(attn.wq), "k": one(attn.wk), "v": one(attn.wv), "q_rope": _rope(engine, layer),
           "k_rope": _rope(engine, layer), "attn_core": _attention(engine, layer), "o_proj": one(attn.wo)}
    why = {}
    if attn.qk_norm == "none":
        why.update(q_norm="the model has no QK-norm", k_norm="the model has no QK-norm")
    else:
        ops.update(q_norm=_qk_norm(attn, args.head_dim, "q"), k_norm=_qk_norm(attn, args.head_dim, "k"))
    if block.pre:
        ops.update(attn_norm=one(block.attention_norm), mlp_norm=one(block.ffn_norm))
    else:
        why.update(attn_norm="the model has no input norm", mlp_norm="the model has no input norm")
    if block.post:
        why["attn_residual"] = "the block normalises o_proj's output before the residual sum (a post-norm)"
    else:
        ops["attn_residual"] = lambda inputs, sample: inputs[0] + block._scaled(inputs[1])
    if isinstance(ff, MoE):
        moe = "a mixture of experts' MLP has no single gate, up or down projection"
        why.update(gate=moe, up=moe, act_mul=moe, down=moe)
    else:
        ops.update(gate=one(ff.w1), up=one(ff.w3), down=one(ff.w2),
                   act_mul=lambda inputs, sample: ff.act(inputs[0]) * inputs[1])
    inputs = {**INPUTS, **(ROPE_WITHOUT_QK_NORM if attn.qk_norm == "none" else {})}
    return {**{name: (inputs[name], fn) for name, fn in ops.items()}, **why}
