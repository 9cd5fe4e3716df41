"""engine/engines.py: one interface to every engine, and what a trace says about a prepared side."""
from __future__ import annotations

import pytest
import torch

from prefill_diff.engine import engines
from prefill_diff.engine.config import load_side
from prefill_diff.engine.models.rope import rope_inv_freq
from prefill_diff.engine.prepared import prepare


class TraceCapture:
    """A TraceRecorder (engine/shared/trace_recorder.py) that keeps what it is given, in trace coordinates."""

    def __init__(self):
        self.meta, self.states, self.caches, self.finals = {}, {}, {}, {}
        self.steps_, self.response_ = {}, {}

    def inputs(self, sample, col, ids, valid, positions, token_index):
        pass

    def state(self, layer, name, sample, col, x):
        self.states[(layer, name, sample, col)] = x.clone()

    def cache(self, layer, sample, keys, values, positions):
        self.caches[(layer, sample)] = positions.clone()

    def final(self, sample, norm_last, logits, column, token_index):
        self.finals[sample] = (logits.clone(), column, token_index)

    def steps(self, sample, col, phase, step, cache_len):
        self.steps_[sample] = (col, phase.clone(), step.clone(), cache_len.clone())

    def response_logits(self, sample, token_index, logits):
        self.response_[sample] = (token_index.clone(), logits.clone())

    def update_meta(self, **items):
        self.meta.update(items)


def run(preset: str):
    prep = prepare(load_side(preset))
    rec = TraceCapture()
    gen = engines.execute(prep, rec)
    layers = []
    while True:
        try:
            layers.append(next(gen))
        except StopIteration as stop:
            return prep, rec, layers, stop.value


@pytest.mark.parametrize("preset", ["reference", "batched-left", "transformers"])
def test_execute_yields_every_layer_and_returns_the_record(preset):
    prep, rec, layers, record = run(preset)
    L = prep.snapshot.args.n_layers
    assert layers == list(range(L))
    assert record is prep.record and "invariant_violations" in record
    assert sorted(rec.finals) == list(range(len(prep.tokens)))
    assert {(layer, s) for layer in range(L) for s in range(len(prep.tokens))} == set(rec.caches)


def test_engines_agree_through_the_one_interface():
    _, ref, _, _ = run("reference")
    _, hf, _, _ = run("transformers")
    for s, (logits, col, tok) in ref.finals.items():
        assert tok == hf.finals[s][2]
        torch.testing.assert_close(hf.finals[s][0], logits, rtol=1e-4, atol=1e-4)


def test_trace_meta_describes_the_prepared_side():
    prep = prepare(load_side("batched-left"))
    meta = engines.trace_meta(prep)
    assert meta["model"]["weights_digest"] == prep.snapshot.weights_digest
    assert meta["model"]["rope_inv_freq"] == rope_inv_freq(prep.snapshot.args).tolist()
    assert meta["engine"]["batching"] == "left" and meta["engine"]["name"] == "native"
    assert meta["repro"]["torch"] == torch.__version__
    assert meta["record"] == prep.record and meta["record"] is not prep.record


def test_token_texts_without_a_tokenizer_is_none():
    prep = prepare(load_side("reference"))
    assert prep.snapshot.tokenizer is None
    assert engines.token_texts(prep, [1, 2]) is None


def test_token_texts_decodes_each_distinct_id_once():
    class Tok:
        def __init__(self):
            self.asked = []

        def decode(self, ids):
            self.asked.append(list(ids))
            return f"<{ids[0]}>"

    prep = prepare(load_side("reference"))
    snap = prep.snapshot
    prep.snapshot = type(snap)(snap.source, snap.args, snap.state, tokenizer=Tok())
    assert engines.token_texts(prep, [7, 3, 7, 12]) == {"3": "<3>", "7": "<7>", "12": "<12>"}
    assert sorted(prep.snapshot.tokenizer.asked) == [[3], [7], [12]]


# -- the registry: one entry per engine, its options in its own table ------------------------------------

def test_every_engine_is_one_registry_entry_with_a_module_that_has_the_three_functions():
    from prefill_diff.engine.registry import ENGINES
    for info in ENGINES.values():
        mod = info.load()
        assert all(callable(getattr(mod, f, None)) for f in ("check", "plan", "execute")), info.name
        assert (info.options is None) == (info.table is None), info.name


@pytest.mark.parametrize("preset", ["reference", "transformers-sdpa", "llama.cpp-flash", "llama.cpp-batched",
                                    "fault:skip-kv", "prefix-reuse", "kv-int8"])
def test_a_recorded_run_reads_back_as_the_same_run(preset):
    """A trace's meta.side.run is what golden and twin runs are rebuilt from: every option comes back."""
    from prefill_diff.engine.config import run_from_dict
    run = load_side(preset).run
    assert run_from_dict(run.as_dict(), "test") == run


def test_runs_recorded_before_the_option_tables_keep_reading():
    """Traces written before each engine had its own table: transformers' attn_implementation at the top of
    meta.side.run, llama.cpp's options under "llamacpp" (which older readers dropped)."""
    from prefill_diff.engine.config import run_from_dict
    old = load_side("transformers").run.as_dict()
    del old["transformers"]
    old["attn_implementation"] = "sdpa"
    assert run_from_dict(old, "old trace").options.attn_implementation == "sdpa"
    old = load_side("llama.cpp-batched").run.as_dict()
    assert old["llamacpp"]["flash_attn"] is False
    assert run_from_dict(old, "old trace").options.flash_attn is False


def test_llama_cpp_refuses_tensor_parallel_runs_before_any_process_starts(run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "llama.cpp"\n[run]\ntp = 2\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and "does not shard over tensor-parallel ranks" in res.output
