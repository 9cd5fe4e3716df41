"""Our tensor names and Hugging Face checkpoints' names, both ways: the layers' projections and norms (where the
family puts its norms), a mixture of experts' tensors (one per expert, as its checkpoints hold them), and Phi-3's
fused projections split into ours. The loader (hub.py) reads a checkpoint through them; the transformers and vLLM
engines write our weights under them.
"""
from __future__ import annotations

import re

import torch

from ..shared.errors import ModelLoadError
from .args import ModelArgs


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
# the MLP, OLMo 2's and Gemma's the norm on the attention's output
_NORMS = {
    "pre": {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"},
    "post": {"attention_post_norm.weight": "post_attention_layernorm.weight",
             "ffn_post_norm.weight": "post_feedforward_layernorm.weight"},
    "sandwich": {"attention_norm.weight": "input_layernorm.weight",
                 "attention_post_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "ffn_post_norm.weight": "post_feedforward_layernorm.weight"},
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight", "output.bias": "lm_head.bias"}


# a mixture of experts' tensors in checkpoints (one tensor per expert): the block's name and each expert's
# projections (gate, down, up as our w1, w2, w3), per family
MOE_STYLE = {"mixtral": "mixtral", "qwen2_moe": "qwen", "qwen3_moe": "qwen"}
_MOE_NAMES = {"mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
              "qwen": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}


def _layer_map(placement: str) -> dict:
    return {**_LAYER_MAP, **_NORMS[placement]}


def _moe_to_hf(rest: str, moe: str | None) -> str | None:
    """A layer tensor's name (after ``layers.N.``) under the checkpoint's MoE names, or None if not a MoE one."""
    m = re.fullmatch(r"feed_forward\.(gate|shared_expert_gate|experts\.(\d+)\.(w[123])|shared_expert\.(w[123]))"
                     r"\.weight", rest)
    if m is None or moe is None:
        return None
    block, proj = _MOE_NAMES[moe]
    if m.group(2) is not None:
        return f"{block}.experts.{m.group(2)}.{proj[m.group(3)]}.weight"
    if m.group(4) is not None:
        return f"{block}.shared_expert.{proj[m.group(4)]}.weight"
    return f"{block}.{m.group(1)}.weight"


def ours_to_hf(name: str, placement: str = "pre", moe: str | None = None) -> str:
    """Our tensor name under Hugging Face's (``placement``: where the family puts its norms, ModelArgs.norm_placement;
    ``moe``: the checkpoint's naming of experts, MOE_STYLE)."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = re.match(r"layers\.(\d+)\.(.+)", name)
    names = _layer_map(placement)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    if m and (hf := _moe_to_hf(m.group(2), moe)) is not None:
        return f"model.layers.{m.group(1)}.{hf}"
    raise KeyError(name)


def hf_to_ours(name: str, placement: str = "pre", moe: str | None = None) -> str | None:
    for ours, hf in _TOP_MAP.items():
        if name == hf:
            return ours
    m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for ours, hf in _layer_map(placement).items():
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}"
        if moe is not None:
            block, proj = _MOE_NAMES[moe]
            back = {v: k for k, v in proj.items()}
            e = re.fullmatch(re.escape(block) + r"\.(?:experts\.(\d+)\.(\w+)|shared_expert\.(\w+)|"
                             r"(gate|shared_expert_gate))\.weight", m.group(2))
            if e is not None and e.group(1) is not None and e.group(2) in back:
                return f"layers.{m.group(1)}.feed_forward.experts.{e.group(1)}.{back[e.group(2)]}.weight"
            if e is not None and e.group(3) in back:
                return f"layers.{m.group(1)}.feed_forward.shared_expert.{back[e.group(3)]}.weight"
            if e is not None and e.group(4) is not None:
                return f"layers.{m.group(1)}.feed_forward.{e.group(4)}.weight"
    return None


def hf_state_dict(state: dict, fused: bool = False, arch: str = "llama", in_memory: bool = False) -> dict:
    """Our snapshot state under Hugging Face names; ``fused``: Q/K/V and gate/up as Phi-3's qkv_proj and
    gate_up_proj. A mixture of experts (``arch`` names its family) is written one tensor per expert, as its
    checkpoints hold it, or with ``in_memory`` as transformers' modules hold it (each layer's experts stacked:
    ``mlp.experts.gate_up_proj`` (E, 2·I, dim) with gate rows first, ``mlp.experts.down_proj`` (E, dim, I))."""
    post = any(k.endswith("attention_post_norm.weight") for k in state)
    pre = any(k.endswith("attention_norm.weight") for k in state)
    placement = "sandwich" if pre and post else "post" if post else "pre"
    moe = MOE_STYLE.get(arch)
    if moe is not None and in_memory:
        state = dict(state)
        layers = sorted({int(k.split(".")[1]) for k in state if ".feed_forward.experts." in k})
        out = {}
        for i in layers:
            stem = f"layers.{i}.feed_forward."
            n = len({k for k in state if k.startswith(stem + "experts.") and k.endswith(".w1.weight")})
            ws = [[state.pop(f"{stem}experts.{e}.{w}.weight") for e in range(n)] for w in ("w1", "w3", "w2")]
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(ws[0], ws[1])])
            out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(ws[2])
        out.update({ours_to_hf(k, placement, "qwen"): v for k, v in state.items()})  # transformers' "mlp" names
        return out
    out = {ours_to_hf(k, placement, moe): v for k, v in state.items()}
    if fused:
        for name in [k for k in out if k.endswith("self_attn.q_proj.weight")]:
            stem = name[:-len("q_proj.weight")]
            out[stem + "qkv_proj.weight"] = torch.cat([out.pop(stem + p + "_proj.weight") for p in "qkv"])
        for name in [k for k in out if k.endswith("mlp.gate_proj.weight")]:
            stem = name[:-len("gate_proj.weight")]
            out[stem + "gate_up_proj.weight"] = torch.cat([out.pop(stem + "gate_proj.weight"),
                                                          out.pop(stem + "up_proj.weight")])
    return out


def unfused(name: str, t, args: ModelArgs, where: str) -> list:
    """[(name, tensor)]: Phi-3's fused qkv_proj (rows Q, K, V) and gate_up_proj (rows gate, up) split into the
    separate projections; any other tensor as it is."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    for fused, parts, sizes in (("self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
                                ("mlp.gate_up_proj.weight", ("gate_proj", "up_proj"),
                                 (args.hidden_dim, args.hidden_dim))):
        if name.endswith(fused):
            if t.ndim != 2 or t.shape[0] != sum(sizes):
                raise ModelLoadError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                     f"({sum(sizes)}, {args.dim})")
            stem = name[:-len(fused)] + fused.split(".")[0] + "."
            return [(f"{stem}{p}.weight", x) for p, x in zip(parts, t.split(list(sizes)))]
    return [(name, t)]
