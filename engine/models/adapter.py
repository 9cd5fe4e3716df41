"""LoRA adapters as a model's data: low-rank deltas ΔW = scale·B·A on the attention projections, seeded, with the
digest that is part of a snapshot's identity. How an engine applies one is the engine's own (engine/native/lora.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import ModelArgs
from .digest import digest_tensors


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
