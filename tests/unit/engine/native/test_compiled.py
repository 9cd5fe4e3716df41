"""engine/native/compiled.py: which modules compile_layers hands to inductor, what warm_up runs, and one test that
compiles (~2 s with inductor's cache warm, ~15 s cold on 2 cores): a compiled engine records what the eager one
records, with no compilation left for the recorded run."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from conftest import Capture
from prefill_diff.engine.calls import plan_calls
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state
from prefill_diff.engine.native.compiled import compile_layers, warm_up
from prefill_diff.engine.calls import Faults
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.config import RunConfig
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.settings import cache_config
from prefill_diff.engine.native import skeleton
from prefill_diff.engine.shared.errors import ConfigError, PreconditionError

# where each family places its norms (docs/contract.md's table), written out here rather than read from the model
NORMS = {"pre": {"attention_norm", "ffn_norm"}, "post": {"attention_post_norm", "ffn_post_norm"},
         "sandwich": {"attention_norm", "ffn_norm", "attention_post_norm", "ffn_post_norm"}}


def build(preset):
    args = MODEL_PRESETS[preset]
    model, _ = skeleton.build(Snapshot(preset, args, synthetic_state(args, 0)))
    return args, model


@pytest.mark.parametrize("preset", ["synthetic", "synthetic:olmo2", "synthetic:gemma2", "synthetic:mixtral"])
def test_compile_layers_compiles_each_layer_norms_and_mlp_and_nothing_else(preset):
    """Per layer exactly the family's norms and the MLP (or mixture of experts) are set to compile; attention,
    the embedding, the final norm, the output and every submodule of a compiled module stay eager. Compilation
    itself waits for a first call (nothing runs here)."""
    args, model = build(preset)
    compile_layers(model)
    per_layer = NORMS[args.norm_placement] | {"feed_forward"}
    want = {f"layers.{i}.{name}" for i in range(args.n_layers) for name in per_layer}
    got = {name for name, m in model.named_modules() if m._compiled_call_impl is not None}
    assert got == want


def test_compile_must_be_a_boolean():
    """A compile setting that is not a boolean is refused when the configuration is made."""
    with pytest.raises(ConfigError, match="compile must be true or false"):
        NumericalConfig(compile="yes")


class FakeEngine:
    """Records what warm_up asks it to prefill, and whether autograd was on; takes ``delay`` seconds per call."""

    def __init__(self, delay):
        self.delay, self.seen = delay, []

    def prefill(self, ids, mask, positions, cache, **kw):
        self.seen.append((ids, mask, positions, cache, kw, torch.is_grad_enabled()))
        time.sleep(self.delay)


def prep_of(engine, calls, run=RunConfig()):
    return SimpleNamespace(side=SimpleNamespace(run=run), calls=calls, engine=engine)


def test_warm_up_runs_every_planned_call_once_without_recording_and_times_it():
    """Each call in plan order, once, with its own tensors, segments, history and faults and the run's cache
    configuration, no recorder, autograd off; the seconds returned cover those calls and no more than the
    wall time around warm_up."""
    calls = plan_calls([[3, 4, 5], [6, 7], [8, 9, 10, 11]], [[0, 1, 2], [0, 1], [0, 1, 2, 3]], [0, 1, 2],
                       "unbatched", 0, {1: "prefix"})
    calls[2].faults = Faults(last_column=True)
    run = RunConfig(chunk_size=2)
    cache = cache_config(run)
    eng = FakeEngine(0.02)
    grad_before = torch.is_grad_enabled()  # another test's suspended engine generator may hold no_grad
    t0 = time.perf_counter()
    took = warm_up(prep_of(eng, calls, run))
    wall = time.perf_counter() - t0
    assert len(eng.seen) == len(calls)
    for (ids, mask, pos, c, kw, grad), call in zip(eng.seen, calls):
        assert ids is call.ids and mask is call.mask and pos is call.positions and c == cache
        assert kw == {"segments": call.segments, "history": call.history, "faults": call.faults}
        assert not grad
    assert 0.02 * len(calls) <= took <= wall
    assert torch.is_grad_enabled() == grad_before  # restored afterwards


def test_warm_up_lets_a_refused_call_through():
    """A call the engine refuses (an id outside the vocabulary) is not swallowed by the warm-up: the §2.1 error
    reaches the caller."""
    args = MODEL_PRESETS["seed-2.8"]
    eng = Engine(Snapshot("seed-2.8", args, synthetic_state(args, 0)))
    calls = plan_calls([[1, 2], [3, args.vocab_size]], [[0, 1], [0, 1]], [0, 1], "left", 0)
    with pytest.raises(PreconditionError, match=r"2\.1\(1\)"):
        warm_up(prep_of(eng, calls))


def test_compiled_engine_records_what_eager_records_and_compiles_only_in_warm_up():
    """float64, a left-padded batch: after warm_up compiled the call's shape, the recorded prefill compiles
    nothing more, every state the eager engine records is recorded (none stopped firing), with the same values
    up to float64 rounding, and so are the logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # compiled code of earlier tests in this process would be reused (or hit the recompile limit)
    args = MODEL_PRESETS["seed-2.8"]
    snap = Snapshot("seed-2.8", args, synthetic_state(args, 0))
    calls = plan_calls([[1, 2, 3, 4, 5], [3, 4, 5]], [[0, 1, 2, 3, 4], [0, 1, 2]], [0, 1], "left", 0)
    (call,) = calls
    compiled = Engine(snap, NumericalConfig(dtype="float64", compile=True))
    frames = counters["frames"]["total"]
    warm_up(prep_of(compiled, calls))
    assert counters["frames"]["total"] > frames  # the warm-up compiled
    frames = counters["frames"]["total"]
    cap = Capture()
    res = compiled.prefill(call.ids, call.mask, call.positions, recorder=cap)
    assert counters["frames"]["total"] == frames  # ...and the recorded run did not
    ecap = Capture()
    eres = Engine(snap, NumericalConfig(dtype="float64")).prefill(call.ids, call.mask, call.positions, recorder=ecap)
    assert cap.states.keys() == ecap.states.keys() and len(cap.states) == 6 * args.n_layers
    for key, x in ecap.states.items():
        torch.testing.assert_close(cap.states[key], x, rtol=1e-12, atol=1e-12, msg=str(key))
    torch.testing.assert_close(res.next_logits, eres.next_logits, rtol=1e-12, atol=1e-12)
