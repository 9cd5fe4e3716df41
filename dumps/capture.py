"""Capture one side's prefill into a Recorder: drives ``engine.engines.execute`` and writes the trace.

Imports the engine (and so torch) only when called, so ``inspect`` stays light.
"""
from __future__ import annotations

from .recorder import Recorder


def capture(prep, recorder: Recorder, extra_meta: dict | None = None):
    """Run a prepared side into ``recorder``; a generator yielding each completed layer.

    Returns the run record (also written into the trace's meta).
    """
    from ..engine.engines import execute, token_texts, trace_meta  # defers torch (see the module docstring)
    recorder.begin([list(t) for t in prep.tokens], prep.n_cols, {**trace_meta(prep), **(extra_meta or {})})
    steps = execute(prep, recorder)
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
