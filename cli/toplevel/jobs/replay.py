"""``run --replay-ops``: the candidate engine replays its ops on the reference's inputs, and the replay is judged.

Reads the reference trace into engine/shared/op_replay.py's ``ReplayInput`` (each sample's valid cells in token
order), asks the candidate's engine module for ``replay_ops``, and hands its outputs to verify/op_replay.py.
"""
from __future__ import annotations

import numpy as np

from ..dumps.reader import Trace
from ..dumps.schema import OP
from ..engine.registry import ENGINES
from ..engine.shared.errors import ConfigError
from ..engine.shared.op_replay import ReplayInput, ReplaySample
from ..verify.op_replay import ReplayResult, judge_replay


def check_replay(engine: str) -> None:
    """--replay-ops needs a candidate engine that replays ops (registry ``replays_ops``): refused before anything
    runs otherwise."""
    info = ENGINES.get(engine)
    if info is not None and not getattr(info, "replays_ops", False):
        able = [e.name for e in ENGINES.values() if getattr(e, "replays_ops", False)]
        raise ConfigError(f"--replay-ops: the {engine} engine cannot replay its ops on the reference's inputs "
                          f"(engines that can: {', '.join(able) or 'none'})")


def replay_input(ref: Trace) -> ReplayInput:
    """The reference's recorded op outputs and layer states, per sample, at its valid cells in token order."""
    cells, samples = [], []
    rows = ref.rows
    for s in range(ref.n_samples):
        cols, toks = ref.cells(s)
        order = np.argsort(toks, kind="stable")
        cols, toks = np.asarray(cols)[order], np.asarray(toks)[order]
        cells.append(cols)
        samples.append(ReplaySample(s, ref.inputs["positions"][s, cols].astype(np.int64), toks.astype(np.int64),
                                    rows["phase"][s, cols]))

    held: dict = {}  # the layer being replayed or judged: (name, i) -> its rows, each read from the file once

    def tensor(layer: int, name: str, i: int):
        if held.get("layer") != layer:  # the replay and the judging go layer by layer
            held.clear()
            held["layer"] = layer
        key = (name, i)
        if key not in held:
            view = ref.layer(layer)
            ds = view.op(name) if name in OP else view.state(name)
            held[key] = None if ds is None else np.asarray(ds[samples[i].sample])[cells[i]]
        return held[key]

    dtype = str((ref.meta.get("engine") or {}).get("dtype") or "float32")
    return ReplayInput(samples, list(range(ref.n_layers)), dtype, tensor)


def replay_ops(ref: Trace, cand: Trace, cand_prep, exact) -> ReplayResult:
    """Replay the candidate's ops on the reference's inputs and judge them against the reference's outputs."""
    info = cand_prep.side.run.info
    given = replay_input(ref)
    got = info.replayer().replay_ops(cand_prep, given)
    return judge_replay(info.name, got.out, got.not_replayed, got.notes, got.dtype or given.dtype,
                        len(given.samples), given.tensor, given.dtype, exact, ref.meta, cand.meta)
