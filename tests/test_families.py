"""The dense families our engine implements beyond Llama: every execution path, the faults, transformers' own
checkpoints, and a family difference seen as a model identity difference."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prefill_diff.jobs import run_lockstep
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.schema import layer_group
from prefill_diff.engine.shared.errors import ConfigError, ModelLoadError
from prefill_diff.engine.models.hub import args_from_hf_config
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.config import Inputs
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.verify.report import compare_traces

from conftest import TABLE

FAMILIES = ["synthetic:qwen3", "synthetic:llama-biased", "synthetic:olmo2", "synthetic:mistral",
            "synthetic:qwen2-window", "synthetic:granite", "synthetic:gemma2", "synthetic:gemma3", "synthetic:phi3"]
PATHS = ["batched-left", "batched-right", "packed", "prefix-reuse", "chunked", "paged", "kv-int8", "rotate-on-read",
         "sdpa", "tiled", "bf16", "fp16", "w8", "transformers", "transformers-sdpa"]


SOFTCAPPED = {("synthetic:gemma2", "sdpa"), ("synthetic:gemma2", "transformers-sdpa")}  # sdpa cannot soft-cap
# the quick loop runs every family and every path once (a diagonal of the matrix, and the refused soft-capped pair);
# the whole matrix (135 lockstep runs, about a minute and a half on 2 cores) is slow
QUICK = {(FAMILIES[i % len(FAMILIES)], path) for i, path in enumerate(PATHS)} | {("synthetic:gemma2", "sdpa")}
MATRIX = [pytest.param(family, path, marks=() if (family, path) in QUICK else pytest.mark.slow, id=f"{family}-{path}")
          for family in FAMILIES for path in PATHS]


@pytest.mark.parametrize("family,path", MATRIX)
def test_each_family_passes_on_each_execution_path(family, path):
    if (family, path) in SOFTCAPPED:
        with pytest.raises(ConfigError, match="sdpa|scaled_dot_product_attention"):
            run_lockstep("reference", path, model=ModelSpec(family))
        return
    rep = run_lockstep("reference", path, model=ModelSpec(family)).report
    assert rep.verdict == "pass", rep.verdict_line()
    assert len(rep.layers) == 4 and not rep.inconclusive and not rep.identity


@pytest.mark.slow
@pytest.mark.parametrize("family,path", [("synthetic:qwen3", "tp2"), ("synthetic:llama-biased", "tp2"),
                                         ("synthetic:qwen3", "compiled"), ("synthetic:olmo2", "compiled")])
def test_families_run_tensor_parallel_and_compiled(run_cli, family, path):
    res = run_cli("run", "reference", path, "--model", family, "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 4


@pytest.mark.parametrize("family,preset,words", [
    ("olmo2", "tp2", "QK-norm normalises the whole Q and K projections"),
    ("olmo2", "llama.cpp", "the GGUF writer emits llama, qwen2 and qwen3 only"),
    ("olmo2", "vllm", "vLLM has no OLMo 2 class of its own"),
    ("gemma3", "llama.cpp", "Gemma's (1 + w) norms"),
    ("mistral", "llama.cpp", "a sliding window (W=8"),
    ("granite", "llama.cpp", "Granite's multipliers"),
    ("gemma2", "sdpa", "kernel sdpa cannot soft-cap"),
    ("gemma2", "transformers-sdpa", "no soft-capping")])
def test_what_an_engine_cannot_run_of_a_family_is_refused_in_one_line(run_cli, family, preset, words):
    res = run_cli("run", "reference", preset, "--model", f"synthetic:{family}")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and words in res.output, res.output


@pytest.mark.slow
@pytest.mark.parametrize("family", ["synthetic:qwen3", "synthetic:gemma3"])
@pytest.mark.parametrize("fault", sorted(TABLE))
def test_faults_are_localised_on_qwen3_and_gemma3(fault, family):
    """On Gemma 3 layer 2 (skip-kv's) is a sliding-window layer: both sides keep the whole prompt there, so the
    lengths are compared whole."""
    (stage, layer, kind), row = TABLE[fault]
    rep = run_lockstep("reference", fault, model=ModelSpec(family)).report
    fb = rep.first_break
    assert (fb.stage, fb.layer, fb.kind) == (stage, layer, kind), rep.verdict_line()
    assert f"§2.11 {row}" in rep.diagnosis, rep.diagnosis


@pytest.mark.slow
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
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, Olmo2Config,
                              Phi3Config, Qwen2Config, Qwen3Config)
    sizes = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)
    gemma = dict(sizes, head_dim=32, sliding_window=4, query_pre_attn_scalar=48, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=True)
    return {"mistral sliding_window": MistralConfig(head_dim=32, sliding_window=4, **sizes),
            "qwen2 use_sliding_window": Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                                    **sizes),
            "granite": GraniteConfig(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.1,
                                     logits_scaling=5.0, **sizes),
            "gemma2": Gemma2Config(attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], **gemma),
            "gemma3": Gemma3TextConfig(layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                       rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}}, **gemma),
            "phi3 longrope": Phi3Config(max_position_embeddings=64, original_max_position_embeddings=8,
                                        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                                                         "long_factor": [2.0 + 0.3 * i for i in range(16)]},
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes),
            "phi3 sliding_window": Phi3Config(sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                              **sizes),
            "qwen3": Qwen3Config(head_dim=32, **sizes),
            "qwen3 attention_bias": Qwen3Config(attention_bias=True, head_dim=32, **sizes),
            "llama attention_bias mlp_bias": LlamaConfig(attention_bias=True, mlp_bias=True, head_dim=32, **sizes),
            "olmo2": Olmo2Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes),
            "olmo2 attention_bias": Olmo2Config(attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                **sizes)}


CHECKPOINTS = ["qwen3", "qwen3 attention_bias", "llama attention_bias mlp_bias", "olmo2", "olmo2 attention_bias",
               "mistral sliding_window", "qwen2 use_sliding_window", "granite", "gemma2", "gemma3", "phi3 longrope",
               "phi3 sliding_window"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_transformers_checkpoint_of_each_family_agrees_with_transformers(name, run_cli, tmp_path):
    """Prompts of 9 and 3 tokens: longer and shorter than the window-4 families' window."""
    d = _save(_configs()[name], tmp_path / "m")
    res = run_cli("run", "reference", "transformers", "--model", f"hf:{d}", "--tokens", "5,6,7,8,9,10,11,12,13",
                  "--tokens", "40,41,42", "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 3 and all(lr["passed"] for lr in rep["layers"])
    assert rep["final"]["tensors"]["logits"]["max_abs"] < 1e-4  # float32 agreement with transformers' own


def test_a_bias_the_config_asks_for_and_the_weights_lack_is_refused(tmp_path):
    from prefill_diff.engine.models.sources import load_source
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
    from transformers import Gemma2Config, Qwen3Config
    cfg = Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(ModelLoadError, match="rope_parameters"):
        args_from_hf_config(cfg, "x")
    cfg = Gemma2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_activation="relu").to_dict()
    cfg["architectures"] = ["Gemma2ForCausalLM"]
    with pytest.raises(ModelLoadError, match="hidden_activation"):
        args_from_hf_config(cfg, "x")


def test_family_presets_differ_only_in_their_family_fields():
    base = MODEL_PRESETS["synthetic"].as_dict()
    for name in ("synthetic:qwen2", "synthetic:qwen3", "synthetic:llama-biased", "synthetic:olmo2", "synthetic:mistral",
                 "synthetic:qwen2-window", "synthetic:granite", "synthetic:gemma2", "synthetic:gemma3"):
        d = MODEL_PRESETS[name].as_dict()
        assert {k for k in d if d[k] != base[k]} <= {"qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_placement",
                                                     "norm_scale", "arch", "sliding_window", "layer_types",
                                                     "attention_multiplier", "embedding_multiplier",
                                                     "residual_multiplier", "logits_scaling", "hidden_act",
                                                     "embed_scale", "attn_softcap", "final_softcap", "rope_theta",
                                                     "rope_local_theta", "tie_embeddings"}, name


WINDOWED = {"synthetic:mistral": 0, "synthetic:qwen2-window": 1, "synthetic:gemma2": 0, "synthetic:gemma3": 0}


@pytest.mark.slow
@pytest.mark.parametrize("family,layer", sorted(WINDOWED.items()))
def test_a_window_applied_off_by_one_breaks_at_the_first_window_layer(family, layer):
    rep = run_lockstep("reference", "fault:window-off-by-one", model=ModelSpec(family)).report
    fb = rep.first_break
    assert rep.verdict == "fail" and (fb.stage, fb.layer) == ("layer", layer), rep.verdict_line()
    assert fb.tensor in ("attn_heads", "attn_update"), rep.verdict_line()


def test_a_window_off_by_one_on_prompts_within_the_window_cannot_show():
    rep = run_lockstep("reference", "fault:window-off-by-one", model=ModelSpec("synthetic:mistral"),
                       inputs=Inputs(token_ids=((1, 2, 3, 4, 5),))).report
    assert rep.verdict == "pass" and any("no prompt is longer than the window" in i for i in rep.inconclusive)


@pytest.mark.slow
def test_transformers_keeps_only_the_window_and_the_comparison_reads_the_window(tmp_path):
    """transformers' sliding layers keep the last W - 1 tokens, ours the whole prompt: the traces differ in length
    there and agree on the window; a full layer keeps everything on both sides."""
    r = record_side(prepare_side("reference", ModelSpec("synthetic:qwen2-window")), tmp_path / "r.h5")
    c = record_side(prepare_side("transformers", ModelSpec("synthetic:qwen2-window")), tmp_path / "c.h5")
    with Trace(r) as rt, Trace(c) as ct:
        for layer in range(4):
            rl, cl = rt.layer(layer).cache_lengths, ct.layer(layer).cache_lengths
            if layer % 2:  # sliding
                assert (cl == np.minimum(rl, 7)).all() and (rl > 7).any()
            else:
                assert (cl == rl).all()
        assert compare_traces(rt, ct).verdict == "pass"


@pytest.mark.slow
def test_a_wrong_value_inside_the_window_fails_and_outside_it_is_not_read(tmp_path):
    """The candidate's sliding layer 1 cache: a key inside the last W - 1 slots changed -> FAILED there; one
    before them changed -> nothing the next token reads, and the comparison does not read it."""
    import h5py
    r = record_side(prepare_side("reference", ModelSpec("synthetic:qwen2-window")), tmp_path / "r.h5")
    for slot, verdict in ((-1, "fail"), (0, "pass")):
        c = tmp_path / f"c{slot}.h5"
        c.write_bytes(open(r, "rb").read())
        with h5py.File(c, "r+") as f:
            g = f[layer_group(1)]
            ds = g["cache/keys"]
            n = int(g["cache/lengths"][0])
            ds[0, 0, n - 1 if slot == -1 else slot] += 1.0
        with Trace(r) as rt, Trace(c) as ct:
            rep = compare_traces(rt, ct)
        assert rep.verdict == verdict, rep.verdict_line()
        if verdict == "fail":
            assert (rep.first_break.layer, rep.first_break.tensor) == (1, "cache_keys"), rep.verdict_line()


@pytest.mark.slow
@pytest.mark.parametrize("field,value", [("norm_scale", "activation"), ("hidden_act", "silu"), ("embed_scale", "none"),
                                         ("attention_multiplier", None), ("attn_softcap", None),
                                         ("final_softcap", None), ("sliding_window", None), ("layer_types", ()),
                                         ("norm_placement", "pre")])
def test_each_gemma2_field_changes_what_the_model_computes(field, value):
    from prefill_diff.engine.models.snapshot import Snapshot
    from prefill_diff.engine.models.synthetic import synthetic_state
    from prefill_diff.engine.native.prefill import Engine
    args = MODEL_PRESETS["synthetic:gemma2"]
    other = args.replace(**{field: value}, **({"layer_types": ()} if field == "sliding_window" else {}))
    ids = torch.arange(3, 23)[None]
    out = []
    for a in (args, other):
        state = synthetic_state(args, 0)
        state = {k: v for k, v in state.items() if k in synthetic_state(a, 0)} if a is other else state
        if field == "norm_placement":
            state = synthetic_state(a, 0)
        eng = Engine(Snapshot("synthetic:gemma2", a, state))
        out.append(eng.prefill(ids, torch.ones_like(ids), torch.arange(20)[None]).next_logits)
    assert not torch.allclose(out[0], out[1], atol=1e-4), field


def test_longrope_rotates_a_batch_by_its_longest_prompt_and_the_tool_sees_it(tmp_path):
    """LongRoPE picks its factors per forward by the longest position (transformers does so): a 2-token prompt
    batched with a 10-token one rotates with the long factors, alone with the short ones (the switch is at 3). Against the unbatched
    reference that is a break at layer 0 on the short sample; transformers batched the same way agrees with us."""
    inputs = Inputs(token_ids=((1, 2), tuple(range(4, 14))))
    rep = run_lockstep("reference", "batched-left", model=ModelSpec("synthetic:phi3"), inputs=inputs).report
    fb = rep.first_break
    assert rep.verdict == "fail" and (fb.layer, fb.sample) == (0, 0), rep.verdict_line()
    for name, engine in (("ours", "native"), ("theirs", "transformers")):
        (tmp_path / f"{name}.toml").write_text(f'[run]\nengine = "{engine}"\nbatching = "left"\n')
    rep = run_lockstep(str(tmp_path / "ours.toml"), str(tmp_path / "theirs.toml"), model=ModelSpec("synthetic:phi3"),
                       inputs=inputs).report
    assert rep.verdict == "pass", rep.verdict_line()


def test_phi3_fused_projections_split_and_fuse_back(tmp_path):
    from prefill_diff.engine.models.hf_names import hf_state_dict, unfused
    from prefill_diff.engine.models.sources import load_source
    d = _save(_configs()["phi3 longrope"], tmp_path / "m")
    snap = load_source(ModelSpec(f"hf:{d}"))
    from safetensors.torch import load_file
    saved = load_file(str(d / "model.safetensors"))
    back = hf_state_dict(snap.state, fused=True)
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        assert torch.equal(back[name], saved[name].float()), name
    with pytest.raises(ModelLoadError, match="qkv_proj.weight.*has shape"):
        unfused("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(5, 128), snap.args, "x")


def test_longrope_across_a_reused_prefix_is_seen(tmp_path):
    """A prefix of 2 tokens computed alone rotates with the short factors; the rest of the prompt, computed
    after it, with the long ones: the reused keys are not the unbatched prefill's, and the tool says so."""
    (tmp_path / "reuse.toml").write_text("[reuse]\nprefix_len = 2\n")
    rep = run_lockstep("reference", str(tmp_path / "reuse.toml"), model=ModelSpec("synthetic:phi3")).report
    fb = rep.first_break
    assert rep.verdict == "fail" and (fb.layer, fb.tensor) == (0, "cache_keys"), rep.verdict_line()
