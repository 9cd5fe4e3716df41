"""LoRA adapters (engine/models/adapter.py), applied to a built model from outside: ΔW = scale·B·A on the attention
projections."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.adapter import Adapter
from .model import Transformer

ATTN_PROJ = ("wq", "wk", "wv", "wo")


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
