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
outside (``prefill.py``'s ForwardStep, ``cache.py``, ``faults.py``); adapters and
quantisation replace its linear layers (``adapters.py``, ``quantize.py``). Here the
attention only calls ``step.rope`` and ``step.attend``, and the block only ``step.record``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

# The per-head attention output before the output projection; the block records the five
# residual-stream states (layer_input, attn_update, mid, mlp_update, layer_output) in that order.
HEAD_STATE = "attn_heads"


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    vocab_size: int = 96
    norm_eps: float = 1e-5
    hidden_act: str = "silu"  # the MLP's activation; the only one implemented (recorded for the model's identity)
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs, e.g. (("factor", 8.0), ("rope_type", "llama3"))
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention's output projection (Llama's attention_bias, with qkv_bias)
    mlp_bias: bool = False  # biases on the MLP's three projections (Llama's mlp_bias)
    qk_norm: str = "none"  # "head": an RMSNorm over each head's d_h on Q and K before RoPE (Qwen3); "proj": over
    # the whole Q (H_q·d_h) and K (H_kv·d_h) projections (OLMo 2)
    norm_placement: str = "pre"  # "pre": Norm before each sub-layer (Llama); "post": Norm on each sub-layer's
    # output, before it is added to the residual, and none before (OLMo 2)
    norm_scale: str = "activation"  # RMSNorm's weight multiplies the normalised vector rounded to the activation
    # dtype (Llama) or in float32, rounded after (OLMo 2): the same in float32, not in bf16/fp16
    lm_head_bias: bool = False
    dropout: float = 0.0
    max_position: int = 8192
    tokenizer_vocab_size: int | None = None
    attention_rule: str = "causal"
    arch: str = "llama"

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {name} must be a positive integer (got {name}={value!r})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_heads must be divisible by n_kv_heads "
                f"(got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE (got head_dim={self.head_dim})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1) (got dropout={self.dropout})")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive (got rope_theta={self.rope_theta})")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be positive (got norm_eps={self.norm_eps})")
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size < 1:
            raise ConfigError(f"tokenizer_vocab_size must be a positive integer "
                              f"(got tokenizer_vocab_size={self.tokenizer_vocab_size})")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu', the only activation implemented (got {self.hidden_act!r})")
        for name, allowed in (("qk_norm", ("none", "head", "proj")), ("norm_placement", ("pre", "post")),
                              ("norm_scale", ("activation", "float32"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if self.attention_rule != "causal":
            raise ConfigError(f"attention_rule must be 'causal' (got {self.attention_rule!r})")

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    def rope_dict(self) -> dict:
        return {"rope_theta": self.rope_theta, **dict(self.rope_scaling)}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        d = dict(d)
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = tuple(sorted(d["rope_scaling"].items()))
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"unknown model keys {unknown} (known: {sorted(cls.__dataclass_fields__)})")
        return cls(**d)

    def replace(self, **kw) -> "ModelArgs":
        return replace(self, **kw)


# Built-in seeded synthetic models. ``seed-2.8`` is the shape ledger model of contract §2.8;
# ``synthetic`` is the default: every §2.11 fault can show on it (H_kv = 2), and its head size (32) is one every
# engine's attention kernels take (vLLM's CPU attention refuses 16).
_SYNTHETIC = ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256, vocab_size=96)
MODEL_PRESETS = {
    "seed-2.8": ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, hidden_dim=16, vocab_size=20),
    "synthetic": _SYNTHETIC,
    # one per family (synthetic:FAMILY), the same sizes: each can be tried on every engine without a file
    "synthetic:qwen2": _SYNTHETIC.replace(qkv_bias=True, arch="qwen2"),
    "synthetic:qwen3": _SYNTHETIC.replace(qk_norm="head", arch="qwen3"),
    "synthetic:llama-biased": _SYNTHETIC.replace(qkv_bias=True, o_bias=True, mlp_bias=True),
    "synthetic:olmo2": _SYNTHETIC.replace(qk_norm="proj", norm_placement="post", norm_scale="float32", arch="olmo2"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, scale: str = "activation"):
        super().__init__()
        self.eps = eps
        self.scale_in_float32 = scale == "float32"
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight.to(h.dtype) * h).to(dtype)
        return self.weight * h.to(dtype)


def norm(args: ModelArgs, dim: int) -> RMSNorm:
    return RMSNorm(dim, args.norm_eps, args.norm_scale)


def rope_inv_freq(args: ModelArgs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies θ_i = base^(-2i/d_h), with Llama-3 or linear scaling if configured."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d))
    scaling = dict(args.rope_scaling)
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ConfigError(f"rope_type must be one of default, linear, llama3 (got {kind!r})")
    return inv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables for explicit position ids: (B, S) -> two (B, 1, S, head_dim)."""
    freqs = positions[..., None].to(inv_freq.dtype) * inv_freq  # (B, S, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, head_dim)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


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
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # (B, n_heads, S, head_dim)
        k = k.transpose(1, 2)  # (B, n_kv_heads, S, head_dim)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, S, head_dim)
        cos, sin = step.rope
        q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Writes K̃, V to the cache, reads what attention sees, runs the kernel with g(h).
        o = step.attend(layer, q_rot, k_rot, v, k)  # (B, n_heads, S, head_dim)
        o = o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, n_heads*head_dim)
        step.record(layer, HEAD_STATE, o)
        return self.wo(o)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=args.mlp_bias)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=args.mlp_bias)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=args.mlp_bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # registered in the order the state dict lists them (the synthetic weights are drawn in that order)
        self.post = args.norm_placement == "post"  # OLMo 2: each sub-layer's output is normalised before it
        if not self.post:                          # joins the residual, its input is not
            self.attention_norm = norm(args, args.dim)
        self.attention = Attention(args)
        if self.post:
            self.attention_post_norm = norm(args, args.dim)
        else:
            self.ffn_norm = norm(args, args.dim)
        self.feed_forward = FeedForward(args)
        if self.post:
            self.ffn_post_norm = norm(args, args.dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, step, layer: int) -> torch.Tensor:
        step.record(layer, "layer_input", x)  # R_ℓ, (B, S, dim)
        if self.post:
            a = self.dropout(self.attention_post_norm(self.attention(x, step, layer)))
        else:
            a = self.dropout(self.attention(self.attention_norm(x), step, layer))
        step.record(layer, "attn_update", a)  # what is added to the residual
        u = x + a  # U_ℓ
        step.record(layer, "mid", u)
        if self.post:
            m = self.dropout(self.ffn_post_norm(self.feed_forward(u)))
        else:
            m = self.dropout(self.feed_forward(self.ffn_norm(u)))
        step.record(layer, "mlp_update", m)
        out = u + m  # R_ℓ+1
        step.record(layer, "layer_output", out)
        return out


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
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
        for layer, block in enumerate(self.layers):
            x = block(x, step, layer)  # R_ℓ+1, (B, S, dim)
            yield layer, x

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """z = W_U·h + b_U (contract §2.7)."""
        return self.output(h)
