"""Op-level states (--level ops) of transformers against our engine, and op replay (replay_ops) on both engines.

Each engine's ops are checked against the other engine's (the independent computation), and each replay against
the reference it replays: bitwise where the candidate is the reference's own code path, op by op where one weight
of the reference differs (only that op parts, every op downstream of it, fed the reference's inputs, agrees).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import with_response
from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.schema import OP, OP_NAMES, OP_TENSORS
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.replaying import INPUTS
from prefill_diff.engine.shared.op_replay import OP_NAMES as SHARED_OP_NAMES, ReplayInput, ReplaySample
from prefill_diff.jobs.sides import prepare_side, record_side

MODELS = ("synthetic", "synthetic:qwen3")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """trace(source, model, inputs) -> the path of that side's trace at --level ops, recorded once."""
    d = tmp_path_factory.mktemp("ops")
    cache = {}

    def get(source, model="synthetic", inputs=None):
        key = (source, model, inputs)
        if key not in cache:
            cache[key] = record_side(prepare_side(source, ModelSpec(model), inputs), d / f"t{len(cache)}.h5",
                                     level="ops")
        return cache[key]
    return get


def replay_input(t: Trace) -> ReplayInput:
    """A trace's samples (their valid cells in token order) and recorded tensors, as a replay reads them."""
    samples, cols = [], {}
    for s in range(t.n_samples):
        c, tok = t.cells(s)
        cols[s] = c
        samples.append(ReplaySample(s, t.inputs["positions"][s, c].astype(np.int64), tok.astype(np.int64),
                                    t.rows["phase"][s, c]))

    def tensor(layer, name, i):
        view = t.layer(layer)
        ds = view.op(name) if name in OP else view.state(name)
        return None if ds is None else ds[samples[i].sample][cols[samples[i].sample]]
    return ReplayInput(samples, list(range(t.n_layers)), t.meta["engine"]["dtype"], tensor)


def replayed(ref_path, source, model="synthetic"):
    """(reference trace, the candidate side's ReplayOutput on it)."""
    t = Trace(ref_path)
    prep = prepare_side(source, ModelSpec(model))
    return t, prep.side.run.info.replayer().replay_ops(prep, replay_input(t))


def shares_equal(t: Trace, out) -> dict:
    """{(layer, op): share of the replayed op's elements bitwise equal to the reference's own}."""
    got = {}
    for (layer, name), rows in out.out.items():
        ds = t.layer(layer).op(name)
        eq = n = 0
        for s, r in enumerate(rows):
            x = ds[s][t.cells(s)[0]]
            assert x.shape == r.shape
            eq, n = eq + int((x == r).sum()), n + x.size
        got[(layer, name)] = eq / n
    return got


def test_replay_inputs_are_the_schemas():
    assert INPUTS == {o.name: o.inputs for o in OP_TENSORS}
    assert SHARED_OP_NAMES == tuple(o.name for o in OP_TENSORS)  # the engines' copy of the names (engine/shared)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_transformers_ops_match_ours(trace, model):
    with Trace(trace("reference", model)) as ours, Trace(trace("transformers", model)) as hf:
        assert hf.ops["recorded"] == ours.ops["recorded"]
        assert set(hf.ops["absent"]) == set(ours.ops["absent"]) == (set() if model.endswith("qwen3")
                                                                   else {"q_norm", "k_norm"})
        assert all("QK-norm" in why for why in hf.ops["absent"].values())
        for layer in range(hf.n_layers):
            for name in hf.ops["recorded"]:
                a, b = ours.layer(layer).op(name)[()], hf.layer(layer).op(name)[()]
                np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
                np.testing.assert_allclose(b[~np.isnan(b)], a[~np.isnan(a)], rtol=1e-4, atol=2e-5,
                                           err_msg=f"layer {layer} {name}")
        q0, q1 = hf.layer(0).op("q_rope")[()], hf.layer(1).op("q_rope")[()]
        valid = ~np.isnan(q0)
        assert not np.allclose(q0[valid], q1[valid])  # the rotary is keyed on the layer being run


@pytest.mark.slow
def test_left_padded_batch_records_the_same_cells(trace, tmp_path):
    cfg = tmp_path / "left.toml"
    cfg.write_text('preset = "transformers"\n[run]\nbatching = "left"\n')
    with Trace(trace("transformers")) as one, Trace(trace(str(cfg))) as batch:
        assert batch.ops["recorded"] == one.ops["recorded"]
        for s in range(one.n_samples):
            c1, c2, pad = one.cells(s)[0], batch.cells(s)[0], batch.pad_cols(s)
            assert len(pad) or s == 0  # the shorter prompts are padded
            state = batch.layer(2).state("layer_input")[s]
            for name in one.ops["recorded"]:
                a, b = one.layer(2).op(name)[s], batch.layer(2).op(name)[s]
                np.testing.assert_allclose(b[c2], a[c1], rtol=1e-4, atol=2e-5, err_msg=name)
                # the computed padding cells are stored where the layer states are
                np.testing.assert_array_equal(np.isnan(b[pad]).all(-1), np.isnan(state[pad]).all(-1))


@pytest.mark.slow
def test_transformers_decode_rows_record_ops(trace):
    inputs = with_response("transformers-decode")
    with Trace(trace("decode", "synthetic", inputs)) as ours, Trace(trace("transformers-decode", "synthetic",
                                                                          inputs)) as hf:
        decode = hf.rows["phase"] == 1
        assert decode.sum() >= 3
        for name in hf.ops["recorded"]:
            a, b = ours.layer(1).op(name)[()], hf.layer(1).op(name)[()]
            assert not np.isnan(b[decode]).any(), name
            np.testing.assert_allclose(b[decode], a[decode], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.slow
def test_llamacpp_says_every_op_absent(trace):
    with Trace(trace("llama.cpp")) as t:
        ops = t.ops
        assert ops["recorded"] == [] and set(ops["absent"]) == set(OP_NAMES)
        assert ops["absent"]["q"].startswith("llama.cpp's graph")
        assert ops["absent"]["q_norm"] == "the model has no QK-norm"


@pytest.mark.slow
@pytest.mark.parametrize("source", ("reference", "transformers"))
def test_replay_on_its_own_float32_trace_is_bitwise(trace, source):
    t, out = replayed(trace(source), source)
    assert out.dtype == "float32" and set(out.not_replayed) == {"q_norm", "k_norm"}
    assert "no QK-norm" in out.not_replayed["q_norm"]
    shares = shares_equal(t, out)
    assert len(shares) == 4 * (len(OP_NAMES) - 2)
    assert all(v == 1.0 for v in shares.values()), {k: v for k, v in shares.items() if v < 1}


@pytest.mark.slow
def test_our_replay_on_a_transformers_trace_is_close(trace):
    t, out = replayed(trace("transformers", "synthetic:qwen3"), "reference", "synthetic:qwen3")
    assert not out.not_replayed and len(out.out) == 4 * len(OP_NAMES)
    for (layer, name), rows in out.out.items():
        for s, r in enumerate(rows):
            np.testing.assert_allclose(r, t.layer(layer).op(name)[s][t.cells(s)[0]], rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_transformers_bf16_replay_on_its_own_trace_is_bitwise(trace):
    t, out = replayed(trace("transformers-bf16", "synthetic:qwen3"), "transformers-bf16", "synthetic:qwen3")
    assert out.dtype == "bfloat16" and not out.not_replayed
    shares = shares_equal(t, out)
    assert len(shares) == 4 * len(OP_NAMES) and all(v == 1.0 for v in shares.values())


@pytest.mark.slow
def test_replay_isolates_a_perturbed_weight(trace):
    """The reference's layer 1 k_proj weight is one ULP off (fault:stale-param): replaying the clean model on it,
    only layer 1's k differs; every op after it, fed the reference's inputs, is bitwise the reference's."""
    t, out = replayed(trace("fault:stale-param"), "reference")
    shares = shares_equal(t, out)
    parted = {k for k, v in shares.items() if v < 1.0}
    assert parted == {(1, "k")}
    assert 0.9 < shares[(1, "k")] < 1.0


def test_replay_says_what_the_reference_lacks(tmp_path):
    """An op whose input the reference did not record is not replayed, with the missing input named."""
    prep = prepare_side("reference", ModelSpec("synthetic"))
    x = np.ones((3, prep.snapshot.args.dim), dtype=np.float32)
    sample = ReplaySample(0, np.arange(3), np.arange(3), np.zeros(3, np.uint8))
    given = ReplayInput([sample], [0], "float32", lambda layer, name, i: x if name == "layer_input" else None)
    out = prep.side.run.info.replayer().replay_ops(prep, given)
    assert list(out.out) == [(0, "attn_norm")]
    assert out.not_replayed["q"] == "the reference recorded no attn_norm (layer 0)"
    assert out.not_replayed["attn_core"] == "the reference recorded no q_rope or k_rope or v (layer 0)"
    norm = prep.engine.model.layers[0].attention_norm
    np.testing.assert_array_equal(out.out[(0, "attn_norm")][0], norm(torch.from_numpy(x)).detach().numpy())
