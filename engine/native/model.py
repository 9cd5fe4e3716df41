"""The decoder of contract §2.3-§2.4: a pre-norm, grouped-query Llama-family model.

This file is the readable statement of one layer:

    R̂ = Norm(R);  Q, K, V = R̂·Wq, R̂·Wk, R̂·Wv;  Q̃, K̃ = RoPE(Q, K, positions)
    query head h reads KV head g(h) = ⌊h·H_kv/H_q⌋;  O = softmax(Q̃K̃ᵀ/√d_h + M)·V
    U = R + OutProj(concat(O));  R' = U + (silu(Norm(U)·W_g) ⊙ Norm(U)·W_u)·W_d

Family variants, each a field of ModelArgs: biases on Q/K/V (Qwen2), on OutProj and on the MLP's
projections (Llama's attention_bias and mlp_bias); QK-norm, Q and K each normalised per head before
RoPE (Qwen3: Q, K = Norm_q(R̂·Wq), Norm_k(R̂·Wk), so the cache holds RoPE of the normalised keys), or
over the whole projections (OLMo 2); post-norms in place of pre-norms (OLMo 2: U = R + Norm(OutProj(...)) with
the attention reading R itself, and likewise the MLP).

Attention kernels, the KV cache, recording, faults and chunking change the model from
outside (``prefill.py``'s ForwardStep, ``kv_cache.py``, ``faults.py``); adapters and
quantisation replace its linear layers (``lora.py``, ``quantize.py``). Here the
attention only calls ``step.rope_of`` and ``step.attend``, and the block only ``step.record``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.args import ModelArgs
from ..models.routing import router_margin

# The per-head attention output before the output projection; the block records the five
# residual-stream states (layer_input, attn_update, mid, mlp_update, layer_output) in that order.
HEAD_STATE = "attn_heads"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, scale: str = "activation"):
        super().__init__()
        self.eps = eps
        self.scale = scale
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale == "float32":
            return (self.weight.to(h.dtype) * h).to(dtype)
        if self.scale == "offset":  # Gemma: the weight is stored as w, the norm multiplies by 1 + w
            return (h * (1.0 + self.weight.to(h.dtype))).to(dtype)
        return self.weight * h.to(dtype)


def norm(args: ModelArgs, dim: int) -> RMSNorm:
    return RMSNorm(dim, args.norm_eps, args.norm_scale)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos/sin tables for explicit position ids: (B, S) -> two (B, 1, S, head_dim), times ``scale`` (LongRoPE's
    attention factor) before they are rounded to ``dtype``."""
    freqs = positions[..., None].to(inv_freq.dtype) * inv_freq  # (B, S, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, head_dim)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, S, head_dim) by the tables of ``rope_cos_sin``."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm == "head":  # Qwen3: Q and K normalised per head, before RoPE
            self.q_norm, self.k_norm = norm(args, args.head_dim), norm(args, args.head_dim)
        elif args.qk_norm == "proj":  # OLMo 2: the whole projections, before they are split into heads
            self.q_norm = norm(args, args.n_heads * args.head_dim)
            self.k_norm = norm(args, args.n_kv_heads * args.head_dim)

    def forward(self, x: torch.Tensor, step, layer: int) -> torch.Tensor:
        B, S, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        step.op(layer, "q", q)
        step.op(layer, "k", k)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
            step.op(layer, "q_norm", q)
            step.op(layer, "k_norm", k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
            step.op(layer, "q_norm", q.reshape(B, S, -1))
            step.op(layer, "k_norm", k.reshape(B, S, -1))
        q = q.transpose(1, 2)  # (B, n_heads, S, head_dim)
        k = k.transpose(1, 2)  # (B, n_kv_heads, S, head_dim)
        v = self.wv(x)
        step.op(layer, "v", v)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, S, head_dim)
        cos, sin = step.rope_of(layer)
        q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        step.op(layer, "q_rope", q_rot, heads_first=True)
        step.op(layer, "k_rope", k_rot, heads_first=True)
        # Writes K̃, V to the cache, reads what attention sees, runs the kernel with g(h).
        o = step.attend(layer, q_rot, k_rot, v, k)  # (B, n_heads, S, head_dim)
        o = o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, n_heads*head_dim)
        step.record(layer, HEAD_STATE, o)
        step.op(layer, "attn_core", o)
        out = self.wo(o)
        step.op(layer, "o_proj", out)
        return out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=args.mlp_bias)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=args.mlp_bias)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=args.mlp_bias)  # down
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        """The activation applied to the gate projection's output."""
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def forward(self, x: torch.Tensor, op=None) -> torch.Tensor:
        """``op(name, tensor)``: where the block records the MLP's op-level states (None: not recorded)."""
        gate = self.w1(x)
        act = self.act(gate)
        if op is None:
            return self.w2(act * self.w3(x))
        up = self.w3(x)
        mul = act * up
        down = self.w2(mul)
        for name, t in (("gate", gate), ("up", up), ("act_mul", mul), ("down", down)):
            op(name, t)
        return down


class MoE(nn.Module):
    """A mixture of experts in place of the MLP (ModelArgs' n_experts): the router, the experts, and Qwen2-MoE's
    gated shared expert. Computed as transformers computes it: expert by expert in ascending id, each over the
    tokens that chose it, its weighted output added into a zero tensor of the activation dtype."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)  # the router
        sub = args.replace(hidden_dim=args.moe_hidden_dim, mlp_bias=False)
        self.experts = nn.ModuleList(FeedForward(sub) for _ in range(args.n_experts))
        if args.shared_expert_dim:
            self.shared_expert = FeedForward(args.replace(hidden_dim=args.shared_expert_dim, mlp_bias=False))
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)
        self.k, self.renorm, self.f32_weights = args.n_active_experts, args.norm_topk_prob, \
            args.moe_weight_dtype == "float32"
        self.last_routing = None  # (ids, weights, router logits) of the last call, for the recorder

    def route(self, x: torch.Tensor, forced: torch.Tensor | None = None, fault: str | None = None):
        """x (T, dim) -> router logits (T, E) in the activation dtype, top-k ids (T, k) by descending probability,
        their weights (T, k) as they scale the experts' outputs, the margin (T,): the k-th minus the (k+1)-th
        logit (+inf when every expert is taken). ``forced`` (T, k), -1 where not forced: those rows take these
        experts instead (routing replay), weighted by their own probabilities, renormalised as the model does."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if fault == "router-topk-off-by-one" and self.k < probs.shape[-1]:  # ranks 2..k+1
            top, ids = (t[:, 1:] for t in torch.topk(probs, self.k + 1, dim=-1))
        else:
            top, ids = torch.topk(probs, self.k, dim=-1)
        if forced is not None:
            rows = (forced >= 0).all(dim=-1)
            if bool(rows.any()):
                ids = torch.where(rows[:, None], forced, ids)
                top = torch.where(rows[:, None], probs.gather(-1, forced.clamp(min=0)), top)
        if self.renorm != (fault == "router-norm-topk"):
            top = top / top.sum(dim=-1, keepdim=True)
        margin, scale = router_margin(logits, self.k)
        return logits, ids, top if self.f32_weights else top.to(logits.dtype), margin, scale

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None, fault: str | None = None) -> torch.Tensor:
        """x (B, S, dim); ``forced`` (B, S, k) expert ids to take where >= 0 (routing replay); ``fault``: one of
        config.ROUTER_FAULTS, injected."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, ids, weights, margin, scale = self.route(flat, None if forced is None else forced.reshape(-1, self.k),
                                                         fault)
        self.last_routing = tuple(t.reshape(*shape[:-1], *t.shape[1:]) for t in (ids, weights, margin, scale, logits))
        out = torch.zeros_like(flat)
        for e in torch.unique(ids).tolist():  # ascending, as transformers adds them
            tok, slot = torch.where(ids == e)
            y = self.experts[e](flat[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat)
            out = out + (shared if fault == "shared-gate-dropped" else
                         torch.sigmoid(self.shared_expert_gate(flat)) * shared)
        return out.reshape(shape)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        # registered in the order the state dict lists them (the synthetic weights are drawn in that order)
        # OLMo 2 ("post"): each sub-layer's output is normalised before it joins the residual, its input is not;
        # Gemma ("sandwich"): both
        self.pre = args.norm_placement in ("pre", "sandwich")
        self.post = args.norm_placement in ("post", "sandwich")
        if self.pre:
            self.attention_norm = norm(args, args.dim)
        self.attention = Attention(args)
        if self.post:
            self.attention_post_norm = norm(args, args.dim)
        if self.pre:
            self.ffn_norm = norm(args, args.dim)
        self.feed_forward = MoE(args) if args.moe(layer) else FeedForward(args)
        if self.post:
            self.ffn_post_norm = norm(args, args.dim)
        self.dropout = nn.Dropout(args.dropout)
        self.residual_multiplier = args.residual_multiplier

    def _scaled(self, update: torch.Tensor) -> torch.Tensor:
        """A sub-layer's output as it is added to the residual (Granite scales it by residual_multiplier)."""
        return update if self.residual_multiplier == 1.0 else update * self.residual_multiplier

    def forward(self, x: torch.Tensor, step, layer: int) -> torch.Tensor:
        step.record(layer, "layer_input", x)  # R_ℓ, (B, S, dim)
        h = x
        if self.pre:
            h = self.attention_norm(x)
            step.op(layer, "attn_norm", h)
        a = self.attention(h, step, layer)
        a = self._scaled(self.dropout(self.attention_post_norm(a) if self.post else a))
        step.record(layer, "attn_update", a)  # what is added to the residual
        u = x + a  # U_ℓ
        step.record(layer, "mid", u)
        step.op(layer, "attn_residual", u)
        h = u
        if self.pre:
            h = self.ffn_norm(u)
            step.op(layer, "mlp_norm", h)
        if isinstance(self.feed_forward, MoE):
            m = self.feed_forward(h, step.forced_routing(layer), step.faults.router)
            step.record_routing(layer, *self.feed_forward.last_routing)
        else:
            m = self.feed_forward(h, step.op_of(layer))
        m = self._scaled(self.dropout(self.ffn_post_norm(m) if self.post else m))
        step.record(layer, "mlp_update", m)
        out = u + m  # R_ℓ+1
        step.record(layer, "layer_output", out)
        return out


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, layer) for layer in range(args.n_layers))
        self.norm = norm(args, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=args.lm_head_bias)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, step) -> torch.Tensor:
        """R_0 = Embed(tokens); R_ℓ+1 = Block_ℓ(R_ℓ) for every layer; returns R_L, (B, S, dim).

        The prefill then reads h = Norm(R_L) at each sequence's last valid token and z = unembed(h).
        """
        x = None
        for _, x in self.layer_by_layer(tokens, step):
            pass
        return x

    def layer_by_layer(self, tokens: torch.Tensor, step):
        """``forward`` one layer at a time: yields (ℓ, R_ℓ+1) as layer ℓ ends, so a caller can stop at a break."""
        x = self.tok_embeddings(tokens)  # R_0, (B, S, dim)
        if self.args.embed_scale == "sqrt_dim":  # Gemma: the factor rounded to the activation dtype first
            x = x * torch.tensor(self.args.dim ** 0.5, dtype=x.dtype)
        if self.args.embedding_multiplier != 1.0:
            x = x * self.args.embedding_multiplier
        for layer, block in enumerate(self.layers):
            x = block(x, step, layer)  # R_ℓ+1, (B, S, dim)
            yield layer, x

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """z = W_U·h + b_U (contract §2.7), divided by logits_scaling (Granite), soft-capped (Gemma 2)."""
        z = self.output(h)
        if self.args.logits_scaling != 1.0:
            z = z / self.args.logits_scaling
        if self.args.final_softcap is not None:  # Gemma 2
            z = torch.tanh(z / self.args.final_softcap) * self.args.final_softcap
        return z
