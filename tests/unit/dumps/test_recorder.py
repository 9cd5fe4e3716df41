"""The Recorder is the TraceRecorder that engines write through (engine/shared/trace_recorder.py): every method
the interface declares, with the same parameters, and the attribute it declares."""
from __future__ import annotations

import inspect

import pytest

from prefill_diff.dumps.recorder import Recorder
from prefill_diff.engine.shared.trace_recorder import TraceRecorder

DECLARED = [n for n, v in vars(TraceRecorder).items() if callable(v) and not n.startswith("_")]


def test_the_interface_declares_the_life_cycle_and_the_values():
    assert {"begin", "layer_done", "flush", "close", "abort"} <= set(DECLARED)
    assert {"inputs", "state", "routing", "cache", "final", "update_meta", "final_top_ids"} <= set(DECLARED)


def _mismatch(cls, name: str) -> str | None:
    """Why ``cls.name`` is not the interface's method of that name, or None."""
    want = list(inspect.signature(getattr(TraceRecorder, name)).parameters)
    if not callable(getattr(cls, name, None)):
        return f"{cls.__name__} has no {name}"
    got = list(inspect.signature(getattr(cls, name)).parameters)
    return None if got == want else f"{cls.__name__}.{name}{got} is not TraceRecorder.{name}{want}"


@pytest.mark.parametrize("name", DECLARED)
def test_the_recorder_has_each_declared_method_with_its_parameters(name):
    assert _mismatch(Recorder, name) is None


def test_an_in_memory_recorder_has_the_declared_meta_once_begun():
    rec = Recorder(None, "stats")
    meta = {"model": {"args": {"dim": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4,
                               "vocab_size": 16}}, "engine": {"dtype": "float32"}}
    rec.begin([[1, 2]], 2, meta)
    assert rec.meta["engine"] == {"dtype": "float32"} and rec.meta["model"]["args"]["dim"] == 8
    rec.abort()


def test_a_missing_method_or_a_changed_parameter_is_seen():
    """The check above can fail: a method missing, or one whose parameters differ, is named."""
    class Partial:
        def inputs(self, sample, col, ids, valid, positions): ...
    assert _mismatch(Partial, "routing") == "Partial has no routing"
    assert "Partial.inputs" in _mismatch(Partial, "inputs")
