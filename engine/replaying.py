"""Op replay's loop, shared by the engines that replay (engine/shared/op_replay.py has the interface).

An engine says, per layer, how it computes each op from the reference's inputs to it: ``ops_of(layer)`` returns
{op name: (input names, fn)} with ``fn(inputs, sample) -> (1, T, width)``, each input a (1, T, width) tensor in
the candidate's dtype (the reference's recorded values cast to it, as its own forward would hold them), or
{op name: why} for an op it cannot replay there. ``replay`` runs every op of every layer asked for on every
sample and gathers the outputs; an op whose input the reference did not record is not replayed, and says so.

The inputs are those of schema ``OP_TENSORS`` (``INPUTS``, checked against it by a test), but for an engine
whose model has no QK-norm, whose rotary reads the projections themselves (``ROPE_WITHOUT_QK_NORM``).
"""
from __future__ import annotations

import torch

from .shared.op_replay import ReplayInput, ReplayOutput

INPUTS = {
    "attn_norm": ("layer_input",), "q": ("attn_norm",), "k": ("attn_norm",), "v": ("attn_norm",),
    "q_norm": ("q",), "k_norm": ("k",), "q_rope": ("q_norm",), "k_rope": ("k_norm",),
    "attn_core": ("q_rope", "k_rope", "v"), "o_proj": ("attn_core",), "attn_residual": ("layer_input", "o_proj"),
    "mlp_norm": ("attn_residual",), "gate": ("mlp_norm",), "up": ("mlp_norm",), "act_mul": ("gate", "up"),
    "down": ("act_mul",),
}
ROPE_WITHOUT_QK_NORM = {"q_rope": ("q",), "k_rope": ("k",)}


def _tensor(a, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(a).to(dtype)[None]  # (1, T, width): a batch of one, as a sample's own forward


def _numpy(x: torch.Tensor):
    x = x.detach().reshape(-1, x.shape[-1])
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def _layers_text(layers: list) -> str:
    return f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"


def replay(given: ReplayInput, dtype: torch.dtype, dtype_name: str, ops_of, notes=()) -> ReplayOutput:
    """Every op of ``given.layers`` run on the reference's inputs, sample by sample (see the module docstring)."""
    out = ReplayOutput(notes=list(notes), dtype=dtype_name)
    skipped: dict = {}  # op name -> {why: [layers]}
    with torch.no_grad():
        for layer in given.layers:
            ops = ops_of(layer)
            for name in INPUTS:
                how = ops.get(name, "the engine has no such op")
                why = how if isinstance(how, str) else None
                rows = []
                for i, sample in enumerate(given.samples):
                    if why is not None:
                        break
                    inputs, fn = how
                    got = [given.tensor(layer, n, i) for n in inputs]
                    lack = [n for n, g in zip(inputs, got) if g is None]
                    if lack:
                        why = f"the reference recorded no {' or '.join(lack)}"
                        break
                    rows.append(_numpy(fn([_tensor(g, dtype) for g in got], sample)))
                if why is None:
                    out.out[(layer, name)] = rows
                else:
                    skipped.setdefault(name, {}).setdefault(why, []).append(layer)
    for name, whys in skipped.items():
        text = "; ".join(f"{why} ({_layers_text(layers)})" for why, layers in whys.items())
        if any(n == name for _, n in out.out):
            out.notes.append(f"{name} is not replayed at every layer: {text}")
        else:
            out.not_replayed[name] = text
    return out


def causal_visible(T: int, window: int | None = None) -> torch.Tensor:
    """(T, T) boolean: query i sees key j <= i (and j > i - window with a sliding window)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    vis = j <= i
    return vis if window is None else vis & (j > i - window)
