"""One interface to every engine: run a prepared side into a recorder, layer by layer.

``execute`` runs the engine the run names (its module, from the registry in engine/registry.py); what a
trace must say about the run (``trace_meta``, ``repro_record``) and the token texts a report shows
(``token_texts``) are read here from the engine's objects, so the trace package needs no torch.
"""
from __future__ import annotations

import platform

import h5py
import numpy as np
import torch

from .config import describe
from .models.cache_layout import CacheLayout
from .models.rope import longrope_switch, rope_attention_factor, rope_inv_freq
from .shared.trace_recorder import TraceRecorder
from .prepared import Prepared

def execute(prep: Prepared, recorder: TraceRecorder):
    """Run ``prep`` into ``recorder``: a generator yielding each completed layer index; returns the run record."""
    return (yield from prep.side.run.info.load().execute(prep, recorder))


def repro_record(deterministic: bool) -> dict:
    """What makes a run reproducible besides model and inputs (contract §2.10)."""
    return {"torch": torch.__version__, "numpy": np.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "python": platform.python_version(),
            "platform": platform.platform(), "device": "cpu", "threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "nondeterministic_reductions_allowed": not deterministic}


def layout_of(run) -> CacheLayout:
    """The KV cache layout a run asks for, as its trace records it: the run's cache dtype (resolved) and the layout
    its engine's options choose (``layout_fields``: ours); an engine whose options choose none is recorded
    contiguous until its run says otherwise (vLLM's engine writes its paged layout when it ends)."""
    chosen = run.options.layout_fields() if hasattr(run.options, "layout_fields") else {}
    return CacheLayout(dtype=run.cache_dtype, int8_scales=run.int8_scales, **chosen).resolved(run.dtype)


def trace_meta(prep: Prepared) -> dict:
    """The trace's meta attribute for a prepared side."""
    snap, side = prep.snapshot, prep.side
    run = side.run
    layout = layout_of(run).as_dict()
    return {
        "model": {"source": snap.source, "spec": side.model.describe(), "args": snap.described_args(),
                  "weights_digest": snap.weights_digest,
                  **({} if snap.truncated_of is None else
                     {"truncated": {"layers": snap.args.n_layers, "of": snap.truncated_of}}),
                  "adapter": None if snap.adapter is None else snap.adapter.identity(),
                  "rope_inv_freq": None if snap.foreign is not None else rope_inv_freq(snap.args).tolist(),
                  **({} if snap.args.rope_local_theta is None else
                     {"rope_local_inv_freq": rope_inv_freq(snap.args, local=True).tolist()}),
                  **({} if longrope_switch(snap.args) is None else
                     {"rope_long": {"inv_freq": rope_inv_freq(snap.args, long=True).tolist(),
                                    "switch": longrope_switch(snap.args),
                                    "attention_factor": rope_attention_factor(snap.args)}})},
        "side": describe(side),
        "engine": {"name": run.engine, "dtype": run.dtype,  # kernel: the one its options name (ours), else its own
                   "kernel": getattr(run.options, "kernel", "eager"),
                   "batching": run.batching, "chunk_size": run.chunk_size},
        "layout": layout,
        "texts": list(prep.texts) if prep.texts else None,
        "repro": repro_record(run.deterministic),
        "tolerance": None,
        "record": dict(prep.record),  # what is known before the run; completed when it ends
    }


def token_texts(prep: Prepared, ids) -> dict | None:
    """Each distinct token id's text under the model's tokenizer (None when the model has none)."""
    tok = prep.snapshot.tokenizer
    if tok is None:
        return None
    return {str(i): tok.decode([int(i)]) for i in sorted(set(int(t) for t in ids))}
