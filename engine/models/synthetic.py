"""The built-in synthetic models' weights: seeded, so one seed always gives the same weights_digest."""
from __future__ import annotations

import torch

from .args import ModelArgs
from .weights import state_shapes


def synthetic_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights; norm weights near 1 so every sub-layer matters."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in state_shapes(args).items():  # state-dict order: the draws depend on it
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "tok_embeddings.weight":
            state[name] = torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            state[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state
