"""torch.compile (inductor) as a kernel source: each layer's norms and MLP become generated kernels.

What is compiled is pure tensor code — per layer ``attention_norm``, ``ffn_norm`` and
``feed_forward`` (gate, up, silu·up, down) — so the recorder never runs inside a compiled
region: ``TransformerBlock.forward`` records the outputs of compiled modules in eager code,
and nothing can silently stop firing (a forward hook registered after compiling would).
Attention (cache writes, the head map, the kernel) stays eager: it is the part the other
presets vary. All layers share one graph per module kind (parameters are graph inputs).

Compilation happens on the first call of each input shape; ``warm_up`` runs every planned
call once, unrecorded, so the compile time is measured apart from the recorded prefill.
"""
from __future__ import annotations

import time

import torch

from .settings import cache_config


def compile_layers(model) -> None:
    for block in model.layers:
        for name in ("attention_norm", "ffn_norm", "attention_post_norm", "ffn_post_norm", "feed_forward"):
            if hasattr(block, name):  # pre-norms or post-norms, as the family places them
                getattr(block, name).compile(backend="inductor")


def warm_up(prep) -> float:
    """Run every planned call once without recording (compiling each shape); returns the seconds taken."""
    run = prep.side.run
    t0 = time.perf_counter()
    with torch.no_grad():
        for c in prep.calls:
            prep.engine.prefill(c.ids, c.mask, c.positions, cache_config(run), segments=c.segments, history=c.history,
                                faults=c.faults)
    return time.perf_counter() - t0
