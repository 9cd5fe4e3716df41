"""The dense families our engine implements beyond Llama: every execution path, the faults, transformers' own
checkpoints, and a family difference seen as a model identity difference."""
from __future__ import annotations

import json

import pytest
import torch

from prefill_diff.cli.jobs import run_lockstep
from prefill_diff.cli.recording import prepare_side, record_side
from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.errors import ModelLoadError
from prefill_diff.engine.hub import args_from_hf_config
from prefill_diff.engine.model import MODEL_PRESETS
from prefill_diff.engine.spec import ModelSpec
from prefill_diff.verify.report import compare_traces

from conftest import TABLE

FAMILIES = ["synthetic:qwen3", "synthetic:llama-biased", "synthetic:olmo2"]
PATHS = ["batched-left", "batched-right", "packed", "prefix-reuse", "chunked", "paged", "kv-int8", "rotate-on-read",
         "sdpa", "tiled", "bf16", "fp16", "w8", "transformers", "transformers-sdpa"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_passes_on_each_execution_path(family, path):
    rep = run_lockstep("reference", path, model=ModelSpec(family)).report
    assert rep.verdict == "pass", rep.verdict_line()
    assert len(rep.layers) == 4 and not rep.inconclusive and not rep.identity


@pytest.mark.parametrize("family,path", [("synthetic:qwen3", "tp2"), ("synthetic:llama-biased", "tp2"),
                                         ("synthetic:qwen3", "compiled"), ("synthetic:olmo2", "compiled")])
def test_families_run_tensor_parallel_and_compiled(run_cli, family, path):
    res = run_cli("run", "reference", path, "--model", family, "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 4


@pytest.mark.parametrize("preset,words", [
    ("tp2", "QK-norm normalises the whole Q and K projections"),
    ("llama.cpp", "the GGUF writer emits llama, qwen2 and qwen3 only"),
    ("vllm", "post-norm layers are not read yet")])
def test_what_an_engine_cannot_run_of_olmo2_is_refused_in_one_line(run_cli, preset, words):
    res = run_cli("run", "reference", preset, "--model", "synthetic:olmo2")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and words in res.output, res.output


@pytest.mark.parametrize("fault", sorted(TABLE))
def test_faults_are_localised_on_qwen3(fault):
    (stage, layer, kind), row = TABLE[fault]
    rep = run_lockstep("reference", fault, model=ModelSpec("synthetic:qwen3")).report
    fb = rep.first_break
    assert (fb.stage, fb.layer, fb.kind) == (stage, layer, kind), rep.verdict_line()
    assert f"§2.11 {row}" in rep.diagnosis, rep.diagnosis


@pytest.mark.parametrize("fam,other,key", [("synthetic:qwen3", "synthetic", "qk_norm"),
                                           ("synthetic:llama-biased", "synthetic:qwen2", "o_bias")])
def test_another_family_is_an_identity_difference(fam, other, key, tmp_path):
    """The same sizes, another family: FAILED, with an identity break naming the family's field."""
    r = record_side(prepare_side("reference", ModelSpec(fam)), tmp_path / "r.h5")
    c = record_side(prepare_side("reference", ModelSpec(other)), tmp_path / "c.h5")
    with Trace(r) as rt, Trace(c) as ct:
        rep = compare_traces(rt, ct)
    assert rep.verdict == "fail"
    assert key in {d["key"] for d in rep.identity}, rep.identity


def _save(config, tmp_path, seed=0):
    """A tiny random checkpoint as transformers itself writes it (its own initialisation)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    for name, p in model.named_parameters():  # norm weights away from 1 and biases away from 0: every one matters
        if name.endswith("norm.weight") or name.endswith("bias"):
            with torch.no_grad():
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return tmp_path


def _configs():
    from transformers import LlamaConfig, Olmo2Config, Qwen3Config
    sizes = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)
    return {"qwen3": Qwen3Config(head_dim=32, **sizes),
            "qwen3 attention_bias": Qwen3Config(attention_bias=True, head_dim=32, **sizes),
            "llama attention_bias mlp_bias": LlamaConfig(attention_bias=True, mlp_bias=True, head_dim=32, **sizes),
            "olmo2": Olmo2Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes),
            "olmo2 attention_bias": Olmo2Config(attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                **sizes)}


@pytest.mark.parametrize("name", ["qwen3", "qwen3 attention_bias", "llama attention_bias mlp_bias", "olmo2",
                                  "olmo2 attention_bias"])
def test_a_transformers_checkpoint_of_each_family_agrees_with_transformers(name, run_cli, tmp_path):
    d = _save(_configs()[name], tmp_path / "m")
    res = run_cli("run", "reference", "transformers", "--model", f"hf:{d}", "--tokens", "5,6,7,8,9,10,11,12,13",
                  "--tokens", "40,41,42", "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 3 and all(lr["passed"] for lr in rep["layers"])
    assert rep["final"]["tensors"]["logits"]["max_abs"] < 1e-4  # float32 agreement with transformers' own


def test_a_bias_the_config_asks_for_and_the_weights_lack_is_refused(tmp_path):
    from prefill_diff.engine.sources import load_source
    d = _save(_configs()["qwen3"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(ModelLoadError, match="missing tensors.*q_proj.bias|missing tensors.*wq.bias"):
        load_source(ModelSpec(f"hf:{d}"))


@pytest.mark.parametrize("family", ["synthetic:qwen3", "synthetic:llama-biased"])
def test_llama_cpp_runs_each_family(family, run_cli):
    """Written as llama.cpp's qwen3 and llama (with biases) graphs, computed by llama.cpp."""
    res = run_cli("run", "reference", "llama.cpp", "--model", family, "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 4


def test_what_a_family_field_asks_that_is_not_implemented_is_refused_by_name():
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_sliding_window=True,
                      sliding_window=16).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        args_from_hf_config(cfg, "x")


def test_family_presets_differ_only_in_their_family_fields():
    base = MODEL_PRESETS["synthetic"].as_dict()
    for name in ("synthetic:qwen2", "synthetic:qwen3", "synthetic:llama-biased", "synthetic:olmo2"):
        d = MODEL_PRESETS[name].as_dict()
        assert {k for k in d if d[k] != base[k]} <= {"qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_placement",
                                                     "norm_scale", "arch"}, name
