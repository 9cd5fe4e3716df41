"""transformers as the truth for any decoder: a checkpoint our engine does not implement (GLM-4, a parallel-block
Phi) runs through transformers' own classes, described by its config's sizes and its files' digest; a state its
layers do not have is listed as not compared; every other engine refuses it by name."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.engine.shared.errors import UnsupportedModel
from prefill_diff.engine.models.sources import load_source
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.native.skeleton import build
from prefill_diff.verify.report import compare_traces

SIZES = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _save(config, path, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    for name, p in model.named_parameters():  # norm weights and biases away from their initial values
        if "norm" in name or name.endswith("bias"):
            with torch.no_grad():
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    from transformers import Glm4Config
    return _save(Glm4Config(num_key_value_heads=2, head_dim=32, **SIZES), tmp_path_factory.mktemp("glm4"))


@pytest.fixture(scope="module")
def phi2(tmp_path_factory):
    from transformers import PhiConfig
    return _save(PhiConfig(num_key_value_heads=4, **SIZES), tmp_path_factory.mktemp("phi2"))


def _report(res):
    return json.loads(res.output[res.output.index("{"):])


@pytest.mark.slow
def test_glm4_runs_through_transformers_with_every_state_compared(glm4, run_cli):
    """The done-test: GLM-4 (partial rotary, a post-norm on each sub-layer's output, fused gate/up) is not ours;
    transformers eager against transformers sdpa compares every state and the cache."""
    res = run_cli("run", "transformers", "transformers-sdpa", "--model", f"hf:{glm4}", "--json", "-")
    rep = _report(res)
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 3
    for lr in rep["layers"]:
        assert {"layer_input", "attn_update", "attn_heads", "mid", "mlp_update", "layer_output", "cache_keys",
                "cache_values"} <= {n for n, t in lr["tensors"].items() if t["level"] == "full"}, lr["tensors"]
    assert 0 < rep["final"]["tensors"]["logits"]["max_abs"] < 1e-4


@pytest.mark.slow
def test_glm4_updates_are_read_after_their_post_norms(glm4, tmp_path):
    """GLM-4 adds post_self_attn_layernorm(attention) and post_mlp_layernorm(MLP): the recorded updates are
    those norms' outputs, so that mid = layer_input + attn_update and layer_output = mid + mlp_update hold."""
    path = record_side(prepare_side("transformers", ModelSpec(f"hf:{glm4}")), tmp_path / "t.h5")
    with Trace(path) as t:
        meta = t.meta
        for layer in range(3):
            v = t.layer(layer)
            x, a, u, m, y = (v.state(n)[0] for n in ("layer_input", "attn_update", "mid", "mlp_update",
                                                     "layer_output"))
            assert torch.equal(torch.from_numpy(u), torch.from_numpy(x) + torch.from_numpy(a))
            assert torch.allclose(torch.from_numpy(y), torch.from_numpy(u) + torch.from_numpy(m), atol=1e-6)
    assert meta["model"]["args"]["arch"] == "glm4" and "qk_norm" not in meta["model"]["args"]
    assert meta["model"]["weights_digest"].startswith("sha256:") and meta["model"]["rope_inv_freq"] is None


@pytest.mark.parametrize("preset", ["reference", "vllm", "llama.cpp"])
def test_every_other_engine_refuses_a_model_only_transformers_runs(glm4, preset, run_cli):
    res = run_cli("run", preset, "transformers", "--model", f"hf:{glm4}")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "Glm4ForCausalLM" in res.output and "only the transformers engine or the fsdp2 engine runs" in res.output, res.output


@pytest.mark.slow
def test_a_parallel_block_has_no_mid_and_the_report_says_so(phi2, run_cli):
    res = run_cli("run", "transformers", "transformers-sdpa", "--model", f"hf:{phi2}", "--json", "-")
    rep = _report(res)
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    for lr in rep["layers"]:
        assert lr["tensors"]["mid"]["level"] == "none" and "parallel" in lr["tensors"]["mid"]["note"]
        assert lr["tensors"]["mlp_update"]["level"] == "full" and lr["tensors"]["attn_update"]["level"] == "full"
    assert any(s.startswith("mid: not compared") for s in rep["checks_not_done"]), rep["checks_not_done"]


@pytest.mark.slow
def test_other_weights_of_a_foreign_model_fail_as_values(glm4, tmp_path, run_cli):
    """Not a vacuous pass: the same architecture with other weights breaks at layer 0 (and is an identity
    difference, by the files' digest)."""
    from transformers import Glm4Config
    other = _save(Glm4Config(num_key_value_heads=2, head_dim=32, **SIZES), tmp_path / "other", seed=1)
    r = record_side(prepare_side("transformers", ModelSpec(f"hf:{glm4}")), tmp_path / "r.h5")
    c = record_side(prepare_side("transformers", ModelSpec(f"hf:{other}")), tmp_path / "c.h5")
    with Trace(r) as rt, Trace(c) as ct:
        rep = compare_traces(rt, ct)
        assert rep.verdict == "fail" and "weights_digest" in {d["key"] for d in rep.identity}, rep.verdict_line()
        rep = compare_traces(rt, ct, allow_identity=True)
    assert rep.verdict == "fail" and (rep.first_break.stage, rep.first_break.layer) == ("layer", 0), \
        rep.verdict_line()


def test_an_absent_state_the_schema_does_not_allow_is_refused(phi2, tmp_path):
    path = record_side(prepare_side("transformers", ModelSpec(f"hf:{phi2}")), tmp_path / "t.h5")
    with h5py.File(path, "r+") as f:
        meta = json.loads(bytes(f.attrs["meta"]).decode())
        meta["absent_states"] = {"layer_input": "x"}
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode())
    with pytest.raises(TraceError, match="absent_states"):
        with Trace(path):
            pass


def test_a_model_only_transformers_runs_is_described_not_loaded(glm4):
    snap = load_source(ModelSpec(f"hf:{glm4}"))
    assert snap.state == {} and "Glm4ForCausalLM" in snap.foreign
    assert (snap.args.dim, snap.args.n_layers, snap.args.n_kv_heads, snap.args.head_dim) == (128, 3, 2, 32)
    with pytest.raises(UnsupportedModel):
        build(snap)
