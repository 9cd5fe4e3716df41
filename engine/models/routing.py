"""A mixture of experts' routing decision, measured the same way on every engine."""
from __future__ import annotations

import torch


def router_margin(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> the margin (T,): the k-th minus the (k+1)-th logit (+inf when all E are taken),
    and the RMS of each row (T,), the scale of their noise; in float32 (float64 for a float64 model)."""
    z = logits.double() if logits.dtype == torch.float64 else logits.float()
    if k < z.shape[-1]:
        ranked = torch.topk(z, k + 1, dim=-1).values
        margin = ranked[:, k - 1] - ranked[:, k]
    else:
        margin = torch.full(z.shape[:1], float("inf"), dtype=z.dtype)
    return margin, z.square().mean(dim=-1).sqrt()
