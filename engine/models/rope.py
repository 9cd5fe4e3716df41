"""RoPE's frequencies as a model defines them (its ``rope_theta`` and ``rope_scaling``): the inverse frequencies
with Llama-3, linear or LongRoPE scaling, LongRoPE's switch to its long factors and its factor on cos and sin.

Every engine that rotates or records rotations reads them here: ours rotates with them, and a trace records them so
that its reader can rotate keys a cache kept before RoPE.
"""
from __future__ import annotations

import math

import torch

from ..shared.errors import ConfigError
from .args import ModelArgs


def rope_inv_freq(args: ModelArgs, dtype: torch.dtype = torch.float32, local: bool = False,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies θ_i = base^(-2i/d_h), with Llama-3, linear or LongRoPE scaling if configured (``local``:
    the sliding-window layers' own base, unscaled, as Gemma 3 has; ``long``: LongRoPE's long factors)."""
    d = args.head_dim
    base = args.rope_local_theta if local else args.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d))
    scaling = {} if local else dict(args.rope_scaling)
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":  # Phi-3: θ_i / ext_i, ext the short factors or (past the original length) the long ones
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32).to(dtype)
        if ext.shape != inv.shape:
            raise ConfigError(f"longrope factors must number head_dim/2 = {d // 2} (got {ext.shape[0]})")
        return 1.0 / (ext * base ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d))
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
        raise ConfigError(f"rope_type must be one of default, linear, llama3, longrope (got {kind!r})")
    return inv


def longrope_switch(args: ModelArgs) -> int | None:
    """LongRoPE's original length: a call whose longest position + 1 exceeds it rotates with the long factors
    (as transformers decides per forward). None without LongRoPE."""
    scaling = dict(args.rope_scaling)
    return int(scaling["original_max_position_embeddings"]) if scaling.get("rope_type") == "longrope" else None


def rope_attention_factor(args: ModelArgs) -> float:
    """LongRoPE's factor on cos and sin: attention_factor, else sqrt(1 + ln s / ln L0) for s = L / L0 > 1."""
    scaling = dict(args.rope_scaling)
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or args.max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
