"""Capture one side's prefill into a Recorder: the bridge from engine/ to the trace format.

Imports the engine (and so torch) only when called, so ``inspect`` stays light.
"""
from __future__ import annotations

import platform

import h5py
import numpy as np

from .recorder import Recorder


def repro_record(numerical: dict) -> dict:
    """What makes a run reproducible besides model and inputs (seed §2.10)."""
    import torch
    return {"torch": torch.__version__, "numpy": np.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "python": platform.python_version(),
            "platform": platform.platform(), "device": "cpu", "threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "nondeterministic_reductions_allowed": not numerical.get("deterministic", True)}


def trace_meta(prep) -> dict:
    """The trace's meta attribute for a prepared side (engine.runner.Prepared)."""
    from ..engine.config import describe
    from ..engine.model import rope_inv_freq
    snap, side = prep.snapshot, prep.side
    run = side.run
    layout = run.cache.layout.resolved(run.numerical.dtype).as_dict()
    return {
        "model": {"source": snap.source, "spec": side.model.describe(), "args": snap.args.as_dict(),
                  "weights_digest": snap.weights_digest,
                  "adapter": None if snap.adapter is None else snap.adapter.identity(),
                  "rope_inv_freq": rope_inv_freq(snap.args).tolist()},
        "side": describe(side),
        "engine": {"name": run.engine, "kernel": run.numerical.kernel, "dtype": run.numerical.dtype,
                   "batching": run.batching, "chunk_size": run.cache.chunk_size},
        "layout": layout,
        "texts": list(prep.texts) if prep.texts else None,
        "repro": repro_record(run.as_dict()["numerical"]),
        "tolerance": None,
        "record": dict(prep.record),  # what is known before the run; completed when it ends
    }


def token_texts(prep, trace_ids) -> dict | None:
    tok = prep.snapshot.tokenizer
    if tok is None:
        return None
    return {str(i): tok.decode([int(i)]) for i in sorted(set(int(t) for t in trace_ids))}


def capture(prep, recorder: Recorder, extra_meta: dict | None = None):
    """Run a prepared side into ``recorder``; a generator yielding each completed layer.

    Returns the run record (also written into the trace's meta).
    """
    from ..engine import runner
    recorder.begin([list(t) for t in prep.tokens], prep.n_cols, {**trace_meta(prep), **(extra_meta or {})})
    if prep.side.run.engine == "transformers":
        from ..engine import hf_engine
        steps = hf_engine.execute(prep, recorder)
    elif prep.side.run.engine == "llama.cpp":
        from ..engine import llamacpp_engine
        steps = llamacpp_engine.execute(prep, recorder)
    else:
        steps = runner.execute(prep, recorder)
    while True:
        try:
            layer = next(steps)
        except StopIteration as stop:
            record = stop.value
            break
        recorder.layer_done(layer)
        yield layer
    ids = [t for row in prep.tokens for t in row]
    if "final/topk_ids" in recorder.f:
        ids += recorder.f["final/topk_ids"][:].ravel().tolist()
    recorder.update_meta(record=record, token_text=token_texts(prep, ids))
    return record


def record(prep, recorder: Recorder, progress=None, extra_meta: dict | None = None) -> dict:
    """Run and close: the whole trace, written atomically."""
    if progress is not None and hasattr(progress, "set_total"):  # a progress display that shows "n of L layers"
        progress.set_total(prep.snapshot.args.n_layers)
    with recorder:
        gen = capture(prep, recorder, extra_meta)
        while True:
            try:
                layer = next(gen)
            except StopIteration as stop:
                result = stop.value
                break
            if progress is not None:
                progress(layer)
    return result
