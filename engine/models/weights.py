"""A model's weights under our names: every tensor of its state dict and its shape, in state-dict order.

The snapshot's master weights (snapshot.py) are held under these names; the loaders map a checkpoint's own names
onto them (hub.py, gguf_loader.py), and ``check_state`` holds what they loaded to these names and shapes; the
synthetic weights are drawn in this order (synthetic.py). Our engine's ``Transformer`` registers exactly these
(tests/test_skeleton.py holds the two together).
"""
from __future__ import annotations

from ..shared.errors import ModelLoadError
from .args import ModelArgs


def _linear(name: str, fan_in: int, fan_out: int, bias: bool) -> dict[str, tuple]:
    return {f"{name}.weight": (fan_out, fan_in), **({f"{name}.bias": (fan_out,)} if bias else {})}


def _mlp(name: str, dim: int, hidden: int, bias: bool) -> dict[str, tuple]:
    """A gated MLP: w1 (gate), w3 (up), w2 (down)."""
    return {**_linear(f"{name}.w1", dim, hidden, bias), **_linear(f"{name}.w3", dim, hidden, bias),
            **_linear(f"{name}.w2", hidden, dim, bias)}


def _attention(p: str, args: ModelArgs) -> dict[str, tuple]:
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = {**_linear(f"{p}.wq", args.dim, q, args.qkv_bias), **_linear(f"{p}.wk", args.dim, kv, args.qkv_bias),
           **_linear(f"{p}.wv", args.dim, kv, args.qkv_bias), **_linear(f"{p}.wo", q, args.dim, args.o_bias)}
    if args.qk_norm == "head":  # Qwen3: per head
        out.update({f"{p}.q_norm.weight": (args.head_dim,), f"{p}.k_norm.weight": (args.head_dim,)})
    elif args.qk_norm == "proj":  # OLMo 2: the whole projections
        out.update({f"{p}.q_norm.weight": (q,), f"{p}.k_norm.weight": (kv,)})
    return out


def _feed_forward(p: str, args: ModelArgs, layer: int) -> dict[str, tuple]:
    if not args.moe(layer):
        return _mlp(p, args.dim, args.hidden_dim, args.mlp_bias)
    out = _linear(f"{p}.gate", args.dim, args.n_experts, False)  # the router
    for e in range(args.n_experts):
        out.update(_mlp(f"{p}.experts.{e}", args.dim, args.moe_hidden_dim, False))
    if args.shared_expert_dim:
        out.update(_mlp(f"{p}.shared_expert", args.dim, args.shared_expert_dim, False))
        out.update(_linear(f"{p}.shared_expert_gate", args.dim, 1, False))
    return out


def _layer(i: int, args: ModelArgs) -> dict[str, tuple]:
    p, dim = f"layers.{i}", (args.dim,)
    pre, post = args.norm_placement in ("pre", "sandwich"), args.norm_placement in ("post", "sandwich")
    out = {f"{p}.attention_norm.weight": dim} if pre else {}
    out.update(_attention(f"{p}.attention", args))
    if post:
        out[f"{p}.attention_post_norm.weight"] = dim
    if pre:
        out[f"{p}.ffn_norm.weight"] = dim
    out.update(_feed_forward(f"{p}.feed_forward", args, i))
    if post:
        out[f"{p}.ffn_post_norm.weight"] = dim
    return out


def state_shapes(args: ModelArgs) -> dict[str, tuple]:
    """Every tensor name of the model's state dict and its shape, in state-dict order (``output.weight`` is listed
    when it is tied to the embeddings too)."""
    out = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        out.update(_layer(i, args))
    out["norm.weight"] = (args.dim,)
    out.update(_linear("output", args.dim, args.vocab_size, args.lm_head_bias))
    return out


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
