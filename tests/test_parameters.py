"""Per-parameter digests (engine/models/param_digests.py, meta.parameters) and their comparison
(verify/parameters.py): an identity failure names the first parameter that differs and any buffer whose dtype
differs; the fault stale-param changes one parameter by one ULP after loading."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch

from prefill_diff.engine.models.param_digests import module_digests, stale_param, tensor_digest
from prefill_diff.verify import identity, parameters

DATA = Path(__file__).parent / "data"
K1 = "model.layers.1.self_attn.k_proj.weight"


def _independent(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes computed apart from the engine's code: numpy's bytes of an integer view."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
    return hashlib.sha256(t.contiguous().view(ints[t.dtype]).numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_digest_is_sha256_of_the_tensor_bytes(dtype):
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert tensor_digest(t) == _independent(t)
    assert tensor_digest(t.t()) == _independent(t.t().contiguous())  # row-major bytes of what it holds
    u = t.clone()
    u.view(-1)[-1] = -u.view(-1)[-1]
    assert tensor_digest(u) != tensor_digest(t)


def test_our_engine_reports_every_parameter_under_hf_names_tied_weights_once():
    from prefill_diff.engine.config import load_side
    from prefill_diff.engine.native.engine import parameter_digests
    from prefill_diff.engine.prepared import prepare
    from prefill_diff.engine.models.spec import ModelSpec
    prep = prepare(load_side("reference", ModelSpec(source="synthetic", overrides=(("tie_embeddings", True),))))
    got = parameter_digests(prep)
    names = [t["name"] for t in got["tensors"]]
    assert got["naming"] == "hf" and names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names
    assert K1 in names and len(names) == len(set(names))
    state = prep.engine.model.state_dict()
    wk = state["layers.1.attention.wk.weight"]
    row = next(t for t in got["tensors"] if t["name"] == K1)
    assert row == {"name": K1, "kind": "parameter", "dtype": "float32", "shape": list(wk.shape),
                   "sha256": _independent(wk)}


def test_stale_param_moves_one_element_by_one_ulp_in_a_copy():
    lin = torch.nn.Linear(4, 3)
    shared = lin.weight.data  # a snapshot's tensor the model was loaded from
    before = shared.clone()
    stale_param(lin, "weight")
    w = lin.weight.detach()
    assert torch.equal(shared, before)  # the snapshot other sides read is untouched
    assert w.view(-1)[0] == torch.nextafter(before.view(-1)[0], torch.tensor(torch.inf) * before.view(-1)[0].sign())
    assert torch.equal(w.view(-1)[1:], before.view(-1)[1:])
    with pytest.raises(KeyError, match="no parameter 'wieght'"):
        stale_param(lin, "wieght")


def _meta(rows, dtype="float32"):
    return {"parameters": {"naming": "hf", "tensors": rows}, "side": {"run": {"dtype": dtype, "weight_quant": "none"}},
            "engine": {"name": "native", "dtype": dtype}}


def _row(name, sha="a" * 16, dtype="float32", shape=(2, 2), kind="parameter"):
    return {"name": name, "kind": kind, "dtype": dtype, "shape": list(shape), "sha256": sha}


def test_the_first_parameter_that_differs_is_named_in_model_order():
    ref = [_row("model.embed_tokens.weight"), _row("model.layers.0.mlp.up_proj.weight"), _row(K1)]
    cand = [_row("model.embed_tokens.weight"), _row("model.layers.0.mlp.up_proj.weight", sha="b" * 16),
            _row(K1, sha="c" * 16)]
    d = identity.differences(_meta(ref), _meta(cand))
    assert [x["key"] for x in d] == ["parameter"]
    assert d[0]["says"] == f"parameter model.layers.0.mlp.up_proj.weight differs (sha256 {'a' * 16} vs {'b' * 16})"
    d = identity.differences(_meta(ref), _meta(ref[:2] + [_row(K1, shape=(2, 3))]))
    assert d[0]["says"] == f"parameter {K1} differs (shape (2, 2) vs (2, 3))"
    assert identity.differences(_meta(ref), _meta(copy.deepcopy(ref))) == []


def test_a_parameter_dtype_differs_only_at_the_same_precisions():
    """A bfloat16 candidate holds every weight in bfloat16 on purpose: not an identity difference; at the same
    precisions a weight in another dtype is one."""
    ref, cand = [_row(K1)], [_row(K1, dtype="bfloat16", sha="b" * 16)]
    assert identity.differences(_meta(ref), _meta(cand, "bfloat16")) == []
    d = identity.differences(_meta(ref), _meta(cand))
    assert d[0]["says"] == f"parameter {K1} differs (dtype float32 vs bfloat16)"


def test_names_on_one_side_only_are_listed_and_are_not_a_difference():
    ref = [_row("model.embed_tokens.weight"), _row(K1), _row("layers.0.attention.wq.base.weight")]
    cand = [_row("model.embed_tokens.weight"), _row(K1),
            _row("model.rotary_emb.inv_freq", dtype="float32", shape=(4,), kind="buffer")]
    assert identity.differences(_meta(ref), _meta(cand)) == []
    assert parameters.notes(_meta(ref), _meta(cand)) == [
        "per-parameter digests: 2 of 3 reference tensors matched by name; reference only: "
        "layers.0.attention.wq.base.weight; candidate only: model.rotary_emb.inv_freq (named on one side only: not "
        "compared)"]
    assert parameters.notes(_meta(ref), _meta(ref)) == []


def test_a_side_without_digests_is_said_and_compares_nothing():
    vllm = {"engine": {"name": "vllm", "dtype": "float32"}}
    assert identity.differences(_meta([_row(K1)]), vllm) == []
    assert parameters.notes(_meta([_row(K1)]), vllm) == [
        "per-parameter digests: the candidate's are not reported by this engine (vllm); the weights are compared by "
        "their source digest only"]
    assert parameters.notes({}, {}) == []


@pytest.mark.slow
def test_a_model_loaded_in_float32_then_cast_names_the_inv_freq_buffer():
    """The loader trap: transformers' model built in float32 then ``.to(bfloat16)`` casts RoPE's inv_freq too; one
    built with dtype=bfloat16 from the same weights keeps it in float32. Parameters equal; the buffer is named."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(cfg)
    cast = copy.deepcopy(fp32).to(torch.bfloat16)
    loaded = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    loaded.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()
                            if "rotary" not in k}, strict=False)
    loaded.tie_weights()
    ref, cand = module_digests(loaded, "hf"), module_digests(cast, "hf")
    def meta(p):
        return {"parameters": p, "side": {"run": {"dtype": "bfloat16", "weight_quant": "none"}}}
    d = identity.differences(meta(ref), meta(cand))
    assert [(x["key"], x["what"]) for x in d] == [("buffer", "model.rotary_emb.inv_freq")] + (
        [("buffer", "model.rotary_emb.original_inv_freq")] if len(d) > 1 else [])
    assert d[0]["says"] == ("buffer model.rotary_emb.inv_freq: float32 in the reference, bfloat16 in the candidate "
                            "(a model loaded in float32 then cast casts RoPE's inv_freq too)")


def _run(run_cli, tmp_path, cand, *extra):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", cand, "--json", out, *extra)
    return res, json.loads(out.read_text())


@pytest.mark.slow
def test_run_stale_param_is_an_identity_failure_naming_that_parameter(run_cli, tmp_path):
    """Exit 1, the verdict names layer 1's k_proj weight, and the layers show where values part: layer 0 bitwise
    equal, layer 1's keys not."""
    res, rep = _run(run_cli, tmp_path, "fault:stale-param")
    assert res.exit_code == 1, res.output
    line = [x for x in res.output.splitlines() if x.startswith("FAILED")][0]
    assert line.startswith(f"FAILED | identity | parameter {K1} differs (sha256 ")
    assert [d["what"] for d in rep["identity_differences"]] == [K1]
    layers = {lr["layer"]: lr["tensors"] for lr in rep["layers"]}
    assert all(t["max_abs"] == 0 for t in layers[0].values())
    assert layers[1]["layer_input"]["max_abs"] == 0 and layers[1]["cache_keys"]["max_abs"] > 0
    res, rep = _run(run_cli, tmp_path, "fault:stale-param", "--allow-identity-difference")
    assert res.exit_code == 0 and any(K1 in n for n in rep["notes"]), res.output


@pytest.mark.slow
def test_transformers_stale_param_names_the_same_parameter(run_cli, tmp_path):
    """transformers' engine reports its own module paths; its stale-param (layer 0 here) is named, and our engine's
    digests match transformers' for every other weight (no other parameter is named)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nengine = "transformers"\n[fault]\nname = "stale-param"\nlayer = 0\n')
    res, rep = _run(run_cli, tmp_path, cfg)
    assert res.exit_code == 1, res.output
    assert rep["first_break"]["message"].endswith(
        f"parameter model.layers.0.self_attn.k_proj.weight differs (sha256 {rep['identity_differences'][0]['reference']}"
        f" vs {rep['identity_differences'][0]['candidate']})")
    assert any("candidate only: model.rotary_emb.inv_freq" in n for n in rep["notes"])


def test_old_traces_without_digests_still_compare(run_cli, tmp_path):
    """Format 1.0 and 1.2 traces carry no meta.parameters: compared as before, no parameter note."""
    for name in ("trace-v1.0.h5", "trace-v1.2.h5"):
        out = tmp_path / f"{name}.json"
        res = run_cli("compare", DATA / name, DATA / name, "--json", out)
        assert res.exit_code == 0, res.output
        rep = json.loads(out.read_text())
        assert rep["verdict"] == "pass" and not [n for n in rep["notes"] if "per-parameter" in n], name
