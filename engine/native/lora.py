"""LoRA adapters, applied to a built model from outside: ΔW = scale·B·A on the attention projections."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.digest import digest_tensors
from .model import ModelArgs, Transformer

ATTN_PROJ = ("wq", "wk", "wv", "wo")


@dataclass
class Adapter:
    """LoRA: low-rank deltas ΔW = scale·B·A on the attention projections."""
    id: str
    rank: int
    scale: float
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{wq|wk|wv|wo}.A" (rank, in) and ".B" (out, rank)
    digest: str = ""

    def __post_init__(self):
        if not self.digest:
            self.digest = digest_tensors(self.tensors) + f"|rank={self.rank}|scale={self.scale}"

    def identity(self) -> dict:
        return {"id": self.id, "digest": self.digest, "rank": self.rank}


def seeded_adapter(args: ModelArgs, id: str, rank: int = 4, seed: int = 1, scale: float = 1.0) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    sizes = {"wq": (args.dim, args.n_heads * args.head_dim), "wk": (args.dim, args.n_kv_heads * args.head_dim),
             "wv": (args.dim, args.n_kv_heads * args.head_dim), "wo": (args.n_heads * args.head_dim, args.dim)}
    for i in range(args.n_layers):
        for w, (fan_in, fan_out) in sizes.items():
            tensors[f"layers.{i}.{w}.A"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"layers.{i}.{w}.B"] = torch.randn(fan_out, rank, generator=g) * 0.5 / rank ** 0.5
    return Adapter(id=id, rank=rank, scale=scale, tensors=tensors)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, A: torch.Tensor, B: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        self.A, self.B, self.scale = A, B, scale

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.A), self.B) * self.scale


def apply_adapter(model: Transformer, adapter: Adapter, dtype: torch.dtype) -> None:
    for i, block in enumerate(model.layers):
        for w in ATTN_PROJ:
            A = adapter.tensors[f"layers.{i}.{w}.A"].to(dtype)
            B = adapter.tensors[f"layers.{i}.{w}.B"].to(dtype)
            setattr(block.attention, w, LoRALinear(getattr(block.attention, w), A, B, adapter.scale))
