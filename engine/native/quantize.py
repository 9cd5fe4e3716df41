"""Weight-only int8 quantisation, applied to a built model from outside (gpt-fast's quantize.py idea)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.digest import digest_tensors
from .model import Transformer


class WeightOnlyInt8Linear(nn.Module):
    """int8 weights with one scale per output channel (gpt-fast's WeightOnlyInt8QuantHandler idea)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (out,)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


# a mixture of experts' router and shared-expert gate stay in the activation dtype, as serving engines keep them:
# their outputs pick experts, and a quantised router would flip choices no weight-only scheme flips
ROUTERS = ("gate", "shared_expert_gate")


def quantize_int8(model: Transformer) -> str:
    """Replace every nn.Linear but a router by WeightOnlyInt8Linear; returns the quantised weights' digest."""
    tensors = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in ROUTERS:
                q = WeightOnlyInt8Linear(child)
                setattr(parent, name, q)
                full = f"{parent_name}.{name}".strip(".")
                tensors[full + ".weight"], tensors[full + ".scales"] = q.weight, q.scales.float()
    return digest_tensors(tensors)
