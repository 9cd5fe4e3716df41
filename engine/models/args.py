"""The model vocabulary every engine shares, as plain data with no torch: a model's shape and family variants
(``ModelArgs``) and the built-in synthetic models (``MODEL_PRESETS``).

A config file's [model] is checked against these (engine/config.py) before anything imports torch; every engine,
loader and the trace's metadata describe a model by them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..shared.errors import ConfigError


_NOT_NONE = ("embedding_multiplier", "residual_multiplier", "logits_scaling")  # the optional scalars never None


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
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs, e.g. (("factor", 8.0), ("rope_type", "llama3"))
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention's output projection (Llama's attention_bias, with qkv_bias)
    mlp_bias: bool = False  # biases on the MLP's three projections (Llama's mlp_bias)
    qk_norm: str = "none"  # "head": an RMSNorm over each head's d_h on Q and K before RoPE (Qwen3); "proj": over
    # the whole Q (H_q·d_h) and K (H_kv·d_h) projections (OLMo 2)
    norm_placement: str = "pre"  # "pre": Norm before each sub-layer (Llama); "post": Norm on each sub-layer's
    # output, before it is added to the residual, and none before (OLMo 2); "sandwich": both (Gemma 2 and 3)
    norm_scale: str = "activation"  # RMSNorm's weight multiplies the normalised vector rounded to the activation
    # dtype (Llama) or in float32, rounded after (OLMo 2): the same in float32, not in bf16/fp16; "offset": by
    # (1 + weight), in float32 (Gemma)
    embed_scale: str = "none"  # "sqrt_dim": R_0 = Embed(tokens) * sqrt(dim), the factor in the activation dtype
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    rope_local_theta: float | None = None  # the RoPE base of sliding-window layers, when theirs differs (Gemma 3)
    sliding_window: int | None = None  # W: a window layer's query sees its W most recent tokens, itself included
    layer_types: tuple = ()  # per layer "full" or "sliding"; () = every layer sliding when sliding_window is set
    attention_multiplier: float | None = None  # the attention score scale (Granite); None: 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0  # Granite: R_0 = Embed(tokens) * this
    residual_multiplier: float = 1.0  # Granite: each sub-layer's output is scaled by this before it is added
    logits_scaling: float = 1.0  # Granite: z = unembed(h) / this
    # Mixture of experts (0 experts: a dense MLP). Each MoE layer's router scores every expert (a linear map of
    # the MLP's input), takes the softmax in float32, keeps the top n_active experts (ties: the lower id) and
    # weights their outputs by those probabilities, renormalised to sum 1 when norm_topk_prob (Mixtral always;
    # Qwen3-MoE by its config). Each expert is a SwiGLU MLP of width moe_hidden_dim.
    n_experts: int = 0
    n_active_experts: int = 0  # top-k
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = False
    moe_weight_dtype: str = "activation"  # the top-k weights as they scale the experts' outputs: rounded to the
    # activation dtype (Qwen-MoE) or kept in float32, the product rounded after (Mixtral)
    shared_expert_dim: int = 0  # Qwen2-MoE: an always-on SwiGLU expert of this width, gated by sigmoid(w·x)
    dense_layers: tuple = ()  # layers whose MLP is dense (hidden_dim) in a MoE model (Qwen's mlp_only_layers)
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
        for name, allowed in (("qk_norm", ("none", "head", "proj")), ("norm_placement", ("pre", "post", "sandwich")),
                              ("norm_scale", ("activation", "float32", "offset")), ("embed_scale", ("none", "sqrt_dim")),
                              ("hidden_act", ("silu", "gelu_pytorch_tanh"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be a positive integer or absent (got {self.sliding_window!r})")
        if self.layer_types:
            kinds = tuple(self.layer_types)
            if len(kinds) != self.n_layers or not set(kinds) <= {"full", "sliding"}:
                raise ConfigError(f"layer_types must list 'full' or 'sliding' for each of the {self.n_layers} layers "
                                  f"(got {list(kinds)[:8]})")
            if "sliding" in kinds and self.sliding_window is None:
                raise ConfigError("layer_types has sliding layers but sliding_window is not set")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier",
                     "attn_softcap", "final_softcap", "rope_local_theta"):
            v = getattr(self, name)
            if not (v is None and name not in _NOT_NONE) and not (
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive finite number (got {name}={v!r})")
        if self.n_experts:
            for name in ("n_experts", "n_active_experts", "moe_hidden_dim"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ConfigError(f"a mixture of experts needs {name} as a positive integer (got {name}={v!r})")
            if self.n_active_experts > self.n_experts:
                raise ConfigError(f"n_active_experts must be at most n_experts (got {self.n_active_experts} of "
                                  f"{self.n_experts})")
            if self.moe_weight_dtype not in ("activation", "float32"):
                raise ConfigError(f"moe_weight_dtype must be 'activation' or 'float32' (got {self.moe_weight_dtype!r})")
            if any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.dense_layers):
                raise ConfigError(f"dense_layers must list layers in [0, {self.n_layers}) "
                                  f"(got {list(self.dense_layers)[:8]})")
            if self.hidden_act != "silu":
                raise ConfigError("a mixture of experts' experts are SwiGLU: hidden_act must be 'silu' "
                                  f"(got {self.hidden_act!r})")
        elif self.n_active_experts or self.moe_hidden_dim or self.shared_expert_dim or self.dense_layers \
                or self.norm_topk_prob:
            raise ConfigError("n_active_experts, moe_hidden_dim, shared_expert_dim, dense_layers and norm_topk_prob "
                              "need n_experts > 0")
        if not isinstance(self.shared_expert_dim, int) or self.shared_expert_dim < 0:
            raise ConfigError(f"shared_expert_dim must be a non-negative integer (got {self.shared_expert_dim!r})")
        if self.attention_rule != "causal":
            raise ConfigError(f"attention_rule must be 'causal' (got {self.attention_rule!r})")

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    def ops_not_computed(self) -> dict:
        """The op-level states (dumps/schema.py OP_TENSORS) a model of these arguments never computes, and why."""
        out = {}
        if self.qk_norm == "none":
            out.update(q_norm="the model has no QK-norm", k_norm="the model has no QK-norm")
        if self.norm_placement == "post":
            why = "the model normalises each sub-layer's output, not its input (no input norm)"
            out.update(attn_norm=why, mlp_norm=why)
        if self.n_experts and not self.dense_layers:
            why = "a mixture of experts' MLP has no single gate, up or down projection"
            out.update(gate=why, up=why, act_mul=why, down=why)
        return out

    def moe(self, layer: int) -> bool:
        """Layer ``layer``'s MLP is a mixture of experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window W, or None when it attends to every earlier token."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding"):
            return None
        return self.sliding_window

    @property
    def attn_scale(self) -> float | None:
        """The attention score scale the model sets, or None for the kernels' 1/sqrt(head_dim)."""
        return None if self.attention_multiplier is None else float(self.attention_multiplier)

    def rope_dict(self) -> dict:
        d = {"rope_theta": self.rope_theta, **dict(self.rope_scaling)}
        return d if self.rope_local_theta is None else {**d, "rope_local_theta": self.rope_local_theta}

    def local_rope(self, layer: int) -> bool:
        """Layer ``layer`` rotates with the local RoPE base (a sliding-window layer of Gemma 3)."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        d["layer_types"] = list(self.layer_types)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        d = dict(d)
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                             for k, v in d["rope_scaling"].items()))
        for key in ("layer_types", "dense_layers"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
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
    # a window shorter than the built-in prompts: every layer (Mistral), or alternating with full layers (Qwen2)
    "synthetic:mistral": _SYNTHETIC.replace(sliding_window=8, arch="mistral"),
    "synthetic:qwen2-window": _SYNTHETIC.replace(qkv_bias=True, sliding_window=8,
                                                 layer_types=("full", "sliding", "full", "sliding"), arch="qwen2"),
    # Gemma: sandwich norms by (1 + w), GeGLU, a scaled embedding, query_pre_attn_scalar 64 (not head_dim), small
    # soft-caps (so that they matter on a random model), alternating local and global layers
    "synthetic:gemma2": _SYNTHETIC.replace(norm_placement="sandwich", norm_scale="offset", hidden_act="gelu_pytorch_tanh",
                                           embed_scale="sqrt_dim", attention_multiplier=64 ** -0.5, attn_softcap=2.0,
                                           final_softcap=3.0, sliding_window=8,
                                           layer_types=("sliding", "full", "sliding", "full"), tie_embeddings=True,
                                           arch="gemma2"),
    "synthetic:gemma3": _SYNTHETIC.replace(norm_placement="sandwich", norm_scale="offset", hidden_act="gelu_pytorch_tanh",
                                           embed_scale="sqrt_dim", attention_multiplier=64 ** -0.5, qk_norm="head",
                                           sliding_window=8, layer_types=("sliding", "sliding", "sliding", "full"),
                                           rope_theta=1e6, rope_local_theta=1e4, tie_embeddings=True, arch="gemma3"),
    # Phi-3: fused projections in its checkpoints; LongRoPE's long factors past 3 positions. Every built-in prompt
    # and reused prefix is longer: a call's factors depend on its longest position (as in transformers), so a batch
    # or a reused prefix on both sides of the switch rotates differently from the prompt alone
    "synthetic:phi3": _SYNTHETIC.replace(max_position=256, rope_scaling=(
        ("long_factor", tuple(2.0 + 0.25 * i for i in range(16))), ("original_max_position_embeddings", 3),
        ("rope_type", "longrope"), ("short_factor", tuple(1.0 + 0.05 * i for i in range(16)))), arch="phi3"),
    # mixtures of experts: four experts, two active; Mixtral's weights kept in float32 and always renormalised,
    # Qwen2-MoE's gated shared expert, Qwen3-MoE's renormalised top-k and a dense last layer (mlp_only_layers)
    "synthetic:mixtral": _SYNTHETIC.replace(n_experts=4, n_active_experts=2, moe_hidden_dim=256, norm_topk_prob=True,
                                            moe_weight_dtype="float32", arch="mixtral"),
    "synthetic:qwen2-moe": _SYNTHETIC.replace(qkv_bias=True, n_experts=4, n_active_experts=2, moe_hidden_dim=64,
                                              shared_expert_dim=128, arch="qwen2_moe"),
    "synthetic:qwen3-moe": _SYNTHETIC.replace(qk_norm="head", n_experts=4, n_active_experts=2, moe_hidden_dim=64,
                                              norm_topk_prob=True, dense_layers=(3,), arch="qwen3_moe"),
    "synthetic:granite": _SYNTHETIC.replace(attention_multiplier=0.125, embedding_multiplier=6.0,
                                            residual_multiplier=0.22, logits_scaling=4.0, arch="granite"),
}
