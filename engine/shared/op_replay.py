"""Op replay's interface, declared once: what an engine is handed and what it hands back (``--replay-ops``).

Replay isolates an op: the candidate engine runs each of its ops on the reference's input to that op (schema
``OP_TENSORS[name].inputs``: the reference's recorded outputs of the ops, or layer states, it takes), so an op
whose replayed output is bitwise the reference's own only inherits a difference in its own forward, and one whose
replayed output still differs computes differently itself.

The job reads the reference trace into a ``ReplayInput`` (plain numpy, one entry per reference sample: its valid
cells in token order) and calls the engine module's ``replay_ops(prep, given) -> ReplayOutput``; the comparison
(verify/) judges the outputs against the reference's recorded ones. An engine declares the capability in the
registry (``EngineInfo.replays_ops``). Part of the shared leaf: imports nothing heavy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# the op-level states' names (dumps/schema.py OP_TENSORS, which a test holds this to), for an engine that names them
OP_NAMES = ("attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_core", "o_proj",
            "attn_residual", "mlp_norm", "gate", "up", "act_mul", "down")


@dataclass
class ReplaySample:
    """One reference sample's valid cells, in token order."""
    sample: int  # the reference trace's sample
    positions: np.ndarray  # (T,) int64: each cell's position id
    token_index: np.ndarray  # (T,) int64: each cell's token index (0..T-1 for a whole sample)
    phase: np.ndarray  # (T,) uint8: schema PHASES index (0 prefill, 1 decode)


@dataclass
class ReplayInput:
    """What the reference computed, for replaying the candidate's ops on it.

    ``tensor(layer, name, i)`` is the reference's recorded output of op or layer state ``name`` at ``layer`` for
    ``samples[i]``: (T, width) float array (bfloat16 widened to float32, exactly), or None when the reference did not
    record it. ``dtype`` is the reference's activation dtype (cast inputs to the candidate's own before an op).
    ``layers``: the layers to replay.
    """
    samples: list
    layers: list
    dtype: str
    tensor: Callable


@dataclass
class ReplayOutput:
    """The candidate's replayed op outputs: ``out[(layer, name)]`` a list, one (T, width) array per ``samples``
    entry of the input (in its own dtype, numpy; bfloat16 widened to float32); ``not_replayed`` {op name: why} for
    each op the engine could not replay (its input not recorded by the reference, an op it does not have, ...);
    ``notes``: anything the report should say about how the ops were run (e.g. the kernel a replayed attention
    used)."""
    out: dict = field(default_factory=dict)
    not_replayed: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    dtype: str = ""
