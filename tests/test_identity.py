"""The model's whole identity: differences beyond the shapes are named, and the hint uses them."""
from __future__ import annotations

import json

import pytest


def _run(run_cli, tmp_path, cand_toml: str, ref: str = "reference"):
    cfg = tmp_path / "cand.toml"
    cfg.write_text(cand_toml)
    out = tmp_path / "r.json"
    res = run_cli("run", ref, cfg, "--json", out)
    return res, json.loads(out.read_text())


def test_rope_theta_difference_is_a_note_and_the_hint_cites_it(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nrope_theta = 20000.0\n')
    assert res.exit_code == 1
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"]) == (0, "cache_keys")
    assert any("rope_theta" in n and "10000.0" in n and "20000.0" in n for n in rep["notes"]), rep["notes"]
    assert rep["notes"][0].startswith("MODEL IDENTITY DIFFERS: rope_theta")
    assert "rope_theta differs (reference 10000.0 vs candidate 20000.0): consistent with the layer-0 cache_keys break" \
        in rep["diagnosis"], rep["diagnosis"]
    assert "numeric drift" not in rep["diagnosis"]
    assert "MODEL IDENTITY DIFFERS: rope_theta" in res.output


def test_adapter_difference_is_a_note_and_the_hint_does_not_blame_numerics(run_cli, tmp_path):
    """Before: notes were empty and the hint blamed 'numeric drift of the candidate's precision or kernel'."""
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model.adapter]\nid = "customer-7"\nrank = 4\n')
    assert res.exit_code == 1
    notes = [n for n in rep["notes"] if n.startswith("MODEL IDENTITY DIFFERS: adapter")]
    assert notes and "'customer-7'" in notes[0] and "none in the reference" in notes[0], rep["notes"]
    assert "adapter differs (reference none vs candidate 'customer-7'" in rep["diagnosis"], rep["diagnosis"]
    assert "numeric drift" not in rep["diagnosis"]
    assert rep["first_break"]["layer"] == 0


def test_two_adapters_with_the_same_id_but_other_weights_differ_by_digest(run_cli, tmp_path):
    ref = tmp_path / "ref.toml"
    ref.write_text('preset = "reference"\n[model.adapter]\nid = "a"\nseed = 1\n')
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model.adapter]\nid = "a"\nseed = 2\n', ref=str(ref))
    assert res.exit_code == 1
    assert any(n.startswith("MODEL IDENTITY DIFFERS: adapter") and "digest" in n for n in rep["notes"])


def test_a_difference_too_small_to_break_still_shows_in_the_verdict_line(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nnorm_eps = 1.0000001e-5\n')
    assert rep["verdict"] == "pass" and res.exit_code == 0
    assert "norm_eps" in rep["notes"][0] and "the model identity differs" in rep["verdict_line"]


def test_identical_models_have_no_identity_note(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "sdpa"\n')
    assert res.exit_code == 0 and not any("IDENTITY" in n for n in rep["notes"])


@pytest.mark.parametrize("key,first", [("hidden_act", "mlp_update"), ("lm_head_bias", "final")])
def test_hint_says_when_the_break_is_not_where_the_difference_first_shows(key, first):
    from prefill_diff.verify.breaks import Break
    from prefill_diff.verify.identity import differences, hint
    ref = {"model": {"args": {"hidden_act": "silu", "lm_head_bias": False}}}
    cand = {"model": {"args": {"hidden_act": "gelu\x1b[31m", "lm_head_bias": True}}}
    diffs = [d for d in differences(ref, cand) if d["key"] == key]
    assert diffs
    fb = Break(stage="layer", kind="value", message="m", layer=2, tensor="attn_update")
    text = hint(diffs, fb)
    assert "it would first show at" in text and "the first break is the layer-2 attn_update break" in text
    assert "\x1b" not in text  # foreign text is escaped


def test_the_activation_is_recorded_and_only_silu_is_accepted(run_cli, tmp_path):
    out = tmp_path / "t.h5"
    assert run_cli("record", "reference", "-o", out).exit_code == 0
    from prefill_diff.dumps.reader import Trace
    with Trace(out) as t:
        assert t.args["hidden_act"] == "silu"
    cfg = tmp_path / "gelu.toml"
    cfg.write_text('preset = "reference"\n[model]\nhidden_act = "gelu"\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and "hidden_act must be 'silu'" in res.output and "'gelu'" in res.output
