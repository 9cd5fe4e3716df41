"""The model's whole identity: a difference beyond the shapes is a failure (an ``identity`` break), the layers are
still compared, and --allow-identity-difference turns it back into a note."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ALLOW = "--allow-identity-difference"


def _run(run_cli, tmp_path, cand_toml: str, ref: str = "reference", *flags):
    cfg = tmp_path / "cand.toml"
    cfg.write_text(cand_toml)
    out = tmp_path / "r.json"
    res = run_cli("run", ref, cfg, "--json", out, *flags)
    return res, json.loads(out.read_text())


@pytest.mark.slow
def test_rope_theta_difference_is_an_identity_failure_and_the_layers_are_still_compared(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nrope_theta = 20000.0\n')
    assert res.exit_code == 1
    fb = rep["first_break"]
    assert (fb["stage"], fb["kind"], fb["layer"]) == ("metadata", "identity", None), rep["verdict_line"]
    assert "rope_theta (RoPE base) 10000.0 in the reference, 20000.0 in the candidate" in fb["message"]
    assert rep["verdict_line"].startswith("FAILED | identity | ")
    assert [d["key"] for d in rep["identity_differences"]] == ["rope_theta"]
    # the layers are compared and shown as for coverage: layer 0's own break is where the difference shows
    assert len(rep["layers"]) == 4
    lb = rep["layers"][0]["first_break"]
    assert (lb["layer"], lb["tensor"]) == (0, "cache_keys")
    assert "rope_theta differs (reference 10000.0 vs candidate 20000.0): consistent with the layer-0 cache_keys " \
           "break" in rep["diagnosis"], rep["diagnosis"]
    assert ALLOW in rep["diagnosis"] and "numeric drift" not in rep["diagnosis"]
    assert "per-layer max abs error" in res.output  # the table is shown


def test_allowing_the_difference_restores_the_note(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nrope_theta = 20000.0\n', "reference", ALLOW)
    assert res.exit_code == 1
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"], fb["kind"]) == (0, "cache_keys", "value")
    assert rep["notes"][0].startswith("MODEL IDENTITY DIFFERS: rope_theta")
    assert "consistent with the layer-0 cache_keys break" in rep["diagnosis"] and ALLOW not in rep["diagnosis"]
    assert "MODEL IDENTITY DIFFERS: rope_theta" in res.output


def test_adapter_difference_fails_and_the_hint_does_not_blame_numerics(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model.adapter]\nid = "customer-7"\nrank = 4\n')
    assert res.exit_code == 1
    assert rep["first_break"]["kind"] == "identity"
    adapter = next(d for d in rep["identity_differences"] if d["key"] == "adapter")
    assert adapter["reference"] == "none" and "'customer-7'" in adapter["candidate"]
    assert "adapter differs (reference none vs candidate 'customer-7'" in rep["diagnosis"], rep["diagnosis"]
    assert "numeric drift" not in rep["diagnosis"]
    assert rep["layers"][0]["first_break"]["layer"] == 0


@pytest.mark.slow
def test_two_adapters_with_the_same_id_but_other_weights_differ_by_digest(run_cli, tmp_path):
    ref = tmp_path / "ref.toml"
    ref.write_text('preset = "reference"\n[model.adapter]\nid = "a"\nseed = 1\n')
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model.adapter]\nid = "a"\nseed = 2\n', str(ref), ALLOW)
    assert res.exit_code == 1
    assert any(n.startswith("MODEL IDENTITY DIFFERS: adapter") and "digest" in n for n in rep["notes"])


@pytest.mark.slow
def test_other_weights_are_an_identity_failure(run_cli, tmp_path):
    """Another seed: the same shapes and settings, other weights (the weights digest differs)."""
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nseed = 1\n')
    assert res.exit_code == 1
    fb = rep["first_break"]
    assert fb["kind"] == "identity" and "weights_digest (weights) sha256:" in fb["message"], fb["message"]


@pytest.mark.slow
def test_a_difference_too_small_to_break_tolerance_still_fails(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nnorm_eps = 1.0000001e-5\n')
    assert res.exit_code == 1 and rep["verdict"] == "fail"
    assert all(lr["passed"] for lr in rep["layers"]) and rep["final"]["passed"]
    assert "no layer or final check broke tolerance" in rep["diagnosis"]
    res, rep = _run(run_cli, tmp_path, 'preset = "reference"\n[model]\nnorm_eps = 1.0000001e-5\n', "reference", ALLOW)
    assert rep["verdict"] == "pass" and res.exit_code == 0
    assert "norm_eps" in rep["notes"][0] and "the model identity differs" in rep["verdict_line"]


@pytest.mark.slow
def test_identical_models_have_no_identity_difference(run_cli, tmp_path):
    res, rep = _run(run_cli, tmp_path, 'preset = "sdpa"\n')
    assert res.exit_code == 0 and not rep["identity_differences"]
    assert not any("IDENTITY" in n for n in rep["notes"])


@pytest.mark.slow
def test_another_family_of_the_same_sizes_is_an_identity_failure_other_sizes_are_not_comparable(run_cli, tmp_path):
    """The README's Exit status: synthetic against synthetic:qwen3 (the same sizes) is compared and fails with an
    identity break, exit 1; against seed-2.8 (other sizes) it is a metadata break, nothing compared, exit 2."""
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert "(`--model synthetic` against `synthetic:qwen3`) are compared and fail with an `identity` break, " \
           "status 1" in readme
    for model in ("synthetic", "synthetic:qwen3", "seed-2.8"):
        assert run_cli("record", "reference", "--model", model, "-o", tmp_path / f"{model}.h5").exit_code == 0

    def compare(cand):
        out = tmp_path / f"{cand}.json"
        res = run_cli("compare", tmp_path / "synthetic.h5", tmp_path / f"{cand}.h5", "--json", out)
        return res, json.loads(out.read_text())

    res, rep = compare("synthetic:qwen3")
    assert res.exit_code == 1 and rep["first_break"]["kind"] == "identity", rep["verdict_line"]
    assert rep["verdict_line"].startswith("FAILED | identity | arch (architecture family) 'llama' in the reference, "
                                          "'qwen3' in the candidate; qk_norm (QK-norm) 'none' in the reference, "
                                          "'head' in the candidate; weights_digest")
    assert len(rep["layers"]) == 4  # compared and shown
    res, rep = compare("seed-2.8")
    assert res.exit_code == 2 and rep["first_break"]["kind"] == "metadata", rep["verdict_line"]
    assert rep["verdict_line"].startswith("FAILED | metadata | traces are not comparable: architectures differ "
                                          "(dim 128 vs 8; n_layers 4 vs 2;")
    assert rep["layers"] == []


def _meta(source: str, **args) -> dict:
    return {"model": {"source": source, "spec": {"source": source}, "args": args}}


def test_values_are_compared_at_the_precision_their_source_stores_them():
    """A GGUF stores norm_eps (and rope_theta) as float32: 1e-5 from a config.json and the 9.999999747e-06 a
    GGUF holds are one value; between two float64 sources they are not."""
    from prefill_diff.verify.identity import differences
    gguf = float(__import__("numpy").float32(1e-5))
    assert gguf != 1e-5
    assert differences(_meta("gguf:/m.gguf", norm_eps=gguf, rope_theta=100000.0),
                       _meta("hf:/m", norm_eps=1e-5, rope_theta=100000.0)) == []
    assert differences(_meta("smollm2", norm_eps=gguf), _meta("hf:/m", norm_eps=1e-5)) == []
    assert [d["key"] for d in differences(_meta("hf:/a", norm_eps=1.00000001e-5), _meta("hf:/b", norm_eps=1e-5))] \
        == ["norm_eps"]
    # a real difference still shows at float32
    assert [d["key"] for d in differences(_meta("gguf:/m.gguf", rope_theta=100000.0),
                                          _meta("hf:/m", rope_theta=50000.0))] == ["rope_theta"]


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


def test_the_activation_is_recorded_and_only_those_implemented_are_accepted(run_cli, tmp_path):
    out = tmp_path / "t.h5"
    assert run_cli("record", "reference", "-o", out).exit_code == 0
    from prefill_diff.dumps.reader import Trace
    with Trace(out) as t:
        assert t.args["hidden_act"] == "silu"
    cfg = tmp_path / "gelu.toml"
    cfg.write_text('preset = "reference"\n[model]\nhidden_act = "gelu"\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and "hidden_act must be one of silu, gelu_pytorch_tanh" in res.output \
        and "'gelu'" in res.output


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """A Llama checkpoint and a copy whose layer-3 o_proj is scaled by 1.3."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d / "ref", safe_serialization=True)
    with torch.no_grad():
        model.model.layers[3].self_attn.o_proj.weight.mul_(1.3)
    model.save_pretrained(d / "cand", safe_serialization=True)
    return d


@pytest.mark.slow
def test_bf16_like_with_like_is_calibrated_and_a_scaled_projection_fails(run_cli, llama_pair, tmp_path):
    """Both sides bfloat16: the fixed bf16 envelope passed a 30% change of one projection. Now the weights
    digest fails the identity check, and compared on purpose the calibrated verdict breaks at layer 3."""
    sides = {}
    for name in ("ref", "cand"):
        sides[name] = tmp_path / f"{name}.toml"
        sides[name].write_text(f'[model]\nsource = "hf:{llama_pair / name}"\n[run]\ndtype = "bfloat16"\n'
                               '[inputs]\ntoken_ids = [[5, 9, 17, 33, 2, 8, 71, 4], [3, 1, 4, 1, 5]]\n')
    out = tmp_path / "r.json"
    res = run_cli("run", sides["ref"], sides["cand"], "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1 and rep["first_break"]["kind"] == "identity", rep["verdict_line"]
    assert rep["rule"].startswith("calibrated:"), rep["rule"]
    res = run_cli("run", sides["ref"], sides["cand"], "--json", out, ALLOW)
    rep = json.loads(out.read_text())
    fb = rep["first_break"]
    assert res.exit_code == 1, rep["verdict_line"]
    assert (fb["layer"], fb["tensor"], fb["check"]) == (3, "attn_update", "change"), rep["verdict_line"]
    assert all(lr["passed"] for lr in rep["layers"][:3])


def test_every_model_field_is_an_identity_key_or_says_why_not():
    """A field that changes what a prefill computes joins the model identity: a new ModelArgs field must be
    listed in one of the two tables, or this fails."""
    from dataclasses import fields
    from prefill_diff.engine.models.args import ModelArgs
    from prefill_diff.verify.identity import IDENTITY_KEYS, NOT_IDENTITY
    names = {f.name for f in fields(ModelArgs)}
    assert names == set(IDENTITY_KEYS) | NOT_IDENTITY and not set(IDENTITY_KEYS) & NOT_IDENTITY


@pytest.mark.slow
@pytest.mark.parametrize("key,value", [("attn_softcap", 5.0), ("embed_scale", "none"), ("final_softcap", 9.0),
                                       ("rope_local_theta", 5e4)])
def test_a_gemma_field_difference_is_named(key, value, tmp_path):
    from prefill_diff.jobs.sides import prepare_side, record_side
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.engine.models.spec import ModelSpec
    from prefill_diff.verify.report import compare_traces
    r = record_side(prepare_side("reference", ModelSpec("synthetic:gemma3" if key == "rope_local_theta"
                                                        else "synthetic:gemma2")), tmp_path / "r.h5")
    spec = ModelSpec("synthetic:gemma3" if key == "rope_local_theta" else "synthetic:gemma2",
                     overrides=((key, value),))
    c = record_side(prepare_side("reference", spec), tmp_path / "c.h5")
    with Trace(r) as rt, Trace(c) as ct:
        rep = compare_traces(rt, ct)
    assert rep.verdict == "fail" and key in {d["key"] for d in rep.identity}, rep.identity
