"""Real models: SmolLM2-135M from its GGUF, a local Hugging Face checkpoint, transformers as the candidate."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.config import Inputs
from prefill_diff.engine.presets import PRESETS
from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.native.skeleton import build
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

from conftest import decoding_presets, spawning_presets, with_response  # noqa: E402

import gguf  # noqa: E402,F401  (the test extras install both; a missing one must fail, never skip)
import transformers  # noqa: E402,F401

pytestmark = pytest.mark.slow  # SmolLM2 and real checkpoints through every engine

SMOL = ModelSpec("smollm2")
FRANCE = Inputs(prompts=("The capital of France is",))
THREE = Inputs(prompts=("The capital of France is", "Hello, my name is", "In 1969, the first man on the moon was"))


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("smol")


def record(source, d, name, model=SMOL, inputs=FRANCE):
    return record_side(prepare_side(source, model, inputs), d / f"{name}.h5")


def test_smollm2_tokenizer_and_weights():
    snap = load_snapshot(SMOL)
    a = snap.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim, a.vocab_size) == \
        (576, 30, 9, 3, 64, 1536, 49152)
    assert a.rope_theta == 100000.0 and a.tie_embeddings
    assert snap.tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    n = sum(t.numel() for k, t in snap.state.items() if k != "output.weight")
    assert n == 134_515_008  # 134.5 M parameters, the tied head counted once


def test_smollm2_ours_and_transformers_agree_and_say_paris(smol_dir):
    ours = record("reference", smol_dir, "ours")
    theirs = record("transformers", smol_dir, "theirs")
    with Trace(ours) as a, Trace(theirs) as b:
        rep = compare_traces(a, b)
        assert rep, rep.verdict_line()
        assert len(rep.layers) == 30 and rep.policy.name == "float32"
        for t in (a, b):
            z = t.final["logits"][0].astype(np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            top = int(np.argmax(z))
            assert t.meta["token_text"][str(top)] == " Paris"
            assert p[top] == pytest.approx(0.7725, abs=2e-3)
        assert a.meta["texts"] == ["The capital of France is"]


def test_smollm2_left_padded_batch_of_three_against_transformers(smol_dir):
    ours = record("batched-left", smol_dir, "ours3", inputs=THREE)
    cfg = smol_dir / "hf-left.toml"
    cfg.write_text('preset = "transformers"\n[run]\nbatching = "left"\n')
    theirs = record(str(cfg), smol_dir, "theirs3", inputs=THREE)
    with Trace(ours) as a, Trace(theirs) as b:
        rep = compare_traces(a, b)
        assert rep, rep.verdict_line()
        assert a.inputs["valid_mask"].sum(1).tolist() == [len(p) for p in a.samples]
        assert a.pad_cols(0).size > 0  # the shortest prompt is padded on the left
        assert a.meta["token_text"][str(int(a.final["topk_ids"][0, 0]))] == " Paris"


def test_gguf_unpermutation_matches_transformers_own_gguf_load():
    from prefill_diff.engine.models.gguf_loader import smollm2_path
    from transformers import AutoModelForCausalLM
    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf_state = hf.state_dict()
    ours = load_snapshot(SMOL).state
    for layer in (0, 17, 29):
        for mine, theirs in (("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
                             ("attention.wv", "self_attn.v_proj")):
            a = ours[f"layers.{layer}.{mine}.weight"]
            b = hf_state[f"model.layers.{layer}.{theirs}.weight"]
            assert torch.equal(a, b.float()), (layer, mine)
    from prefill_diff.engine.models.gguf_loader import unpermute
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # the permutation itself is a bijection
    assert sorted(unpermute(w, 2).ravel().tolist()) == sorted(w.ravel().tolist())
    assert not np.array_equal(unpermute(w, 2), w)


def _write_gguf(path, model, arch: str, extra: dict | None = None, extra_tensors: dict | None = None):
    """Write a Hugging Face model to GGUF as llama.cpp's converter does (Q/K rows permuted for "llama" only),
    with SmolLM2's tokenizer metadata (the loader builds the GGUF's own tokenizer); ``extra`` adds metadata
    keys (name -> int/float/str value), ``extra_tensors`` tensors (GGUF name -> array)."""
    from prefill_diff.engine.models.gguf_loader import smollm2_path
    cfg = model.config
    smol = gguf.GGUFReader(smollm2_path())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, value in (extra or {}).items():
        kind = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
                str: gguf.GGUFValueType.STRING}[type(value)]
        w.add_key_value(name, value, kind)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    for name, f in smol.fields.items():
        if name.startswith("tokenizer."):
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
            else:
                w.add_key_value(name, f.contents(), f.types[0])

    def permute(x, n_head):  # llama.cpp's LlamaModel.permute
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for k, v in model.state_dict().items():
        v = v.detach().numpy().astype(np.float32)
        if k in top:
            w.add_tensor(top[k], v)
            continue
        _, _, i, *rest = k.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if arch == "llama" and module == "self_attn.q_proj":
            v = permute(v, cfg.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            v = permute(v, cfg.num_key_value_heads)
        w.add_tensor(f"blk.{i}.{per_layer[module]}.{kind}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_loads_the_same_weights_as_the_checkpoint_it_was_converted_from(arch, tmp_path):
    """Q/K rows are un-permuted for llama files only: llama.cpp leaves qwen2's in Hugging Face's order."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config, cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(1)
    model = cls(config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                       max_position_embeddings=512, rms_norm_eps=1e-6))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "hf")
    _write_gguf(tmp_path / "m.gguf", model, arch)
    hf, gg = load_snapshot(ModelSpec(f"hf:{tmp_path / 'hf'}")), load_snapshot(ModelSpec(f"gguf:{tmp_path / 'm.gguf'}"))
    assert gg.args.arch == arch and set(gg.state) == set(hf.state)
    for k in hf.state:
        assert torch.equal(gg.state[k], hf.state[k]), k
    inputs = Inputs(token_ids=((5, 17, 33, 250, 7, 9, 11), (2, 3, 4)))
    ref = record_side(prepare_side("reference", ModelSpec(f"hf:{tmp_path / 'hf'}"), inputs), tmp_path / "a.h5")
    cand = record_side(prepare_side("reference", ModelSpec(f"gguf:{tmp_path / 'm.gguf'}"), inputs), tmp_path / "b.h5")
    with Trace(ref) as a, Trace(cand) as b:
        rep = compare_traces(a, b)
        assert rep, "same weights, same engine: must agree"
        # the GGUF stores rms_norm_eps 1e-6 as float32 (9.99999997e-07): the same value as the config's
        assert a.args["norm_eps"] != b.args["norm_eps"] and not rep.identity


def test_smollm2_bf16_error_growth_over_30_layers(run_cli, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "bf16", "--model", "smollm2", "--prompt", "The capital of France is",
                  "--json", out)
    rep = json.loads(out.read_text())
    assert len(rep["layers"]) == 30
    errs = [max(float(t["max_row_rel"]) for t in row["tensors"].values()) for row in rep["layers"]]
    assert errs[-1] > errs[0] > 0  # error grows with depth
    assert rep["policy"]["name"] == "bfloat16"
    assert res.exit_code == (0 if rep["verdict"] == "pass" else 1)
    res = run_cli("run", "reference", "bf16", "--model", "smollm2", "--prompt", "The capital of France is")
    spark = next(l for l in res.output.splitlines() if l.startswith("error growth"))
    assert len(spark.split(": ", 1)[1].strip()) == 30


# -- a local Hugging Face checkpoint, made here -----------------------------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=50000.0,
                      tie_word_embeddings=False, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random biases, so the QKV bias really matters
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    d = tmp_path_factory.mktemp("qwen")
    model.save_pretrained(d, safe_serialization=True)
    return d


def test_hf_checkpoint_loads_and_agrees_with_transformers(qwen_dir, tmp_path):
    spec = ModelSpec(f"hf:{qwen_dir}")
    snap = load_snapshot(spec)
    assert snap.args.qkv_bias and not snap.args.tie_embeddings and snap.args.rope_theta == 50000.0
    assert snap.args.arch == "qwen2"
    inputs = Inputs(token_ids=((5, 17, 33, 250, 7, 9, 11), (2, 3, 4)))
    ours = record_side(prepare_side("batched-left", spec, inputs), tmp_path / "o.h5")
    theirs = record_side(prepare_side("transformers", spec, inputs), tmp_path / "t.h5")
    with Trace(ours) as a, Trace(theirs) as b:
        rep = compare_traces(a, b)
        assert rep, rep.verdict_line()
        assert b.meta["engine"]["name"] == "transformers"


@pytest.mark.parametrize("preset", [p for p in PRESETS if not p.startswith("fault:") and p not in spawning_presets()])
def test_every_preset_runs_on_a_hf_checkpoint(qwen_dir, tmp_path, preset):
    spec = ModelSpec(f"hf:{qwen_dir}")
    inputs = with_response(preset, Inputs(token_ids=((5, 17, 33, 250, 7, 9, 11, 12), (2, 3, 4, 5, 6),
                                                     (8, 9, 10, 11, 12, 13))))
    ref = record_side(prepare_side("reference", spec, inputs), tmp_path / "r.h5")
    cand = record_side(prepare_side(preset, spec, inputs), tmp_path / "c.h5")
    with Trace(ref) as a, Trace(cand) as b:
        rep = compare_traces(a, b)
    assert rep, f"{preset}: {rep.verdict_line()}"


STALE = "parameter model.layers.1.self_attn.k_proj.weight differs"  # fault:stale-param, as the identity names it


@pytest.mark.parametrize("fault", [p for p in PRESETS if p.startswith("fault:") and p not in spawning_presets()])
def test_every_fault_is_caught_on_a_hf_checkpoint(qwen_dir, tmp_path, fault):
    spec = ModelSpec(f"hf:{qwen_dir}")
    inputs = with_response(fault, Inputs(token_ids=((5, 17, 33, 250, 7, 9, 11, 12), (2, 3, 4, 5, 6),
                                                    (8, 9, 10, 11, 12, 13))))
    ref = record_side(prepare_side("reference", spec, inputs), tmp_path / "r.h5")
    cand = record_side(prepare_side(fault, spec, inputs), tmp_path / "c.h5")
    with Trace(ref) as a, Trace(cand) as b:
        rep = compare_traces(a, b)
    if fault in CANNOT_SHOW_ON_DENSE:  # this Qwen2 has neither (tests/test_families.py, tests/test_moe.py have)
        assert rep.first_break is None and "INCONCLUSIVE" in rep.verdict_line(), rep.verdict_line()
        assert any(CANNOT_SHOW_ON_DENSE[fault] in note for note in rep.inconclusive), rep.inconclusive
    elif fault == "fault:stale-param":  # a weight, not the execution: the identity names it
        assert rep.first_break.kind == "identity" and STALE in rep.verdict_line(), rep.verdict_line()
    else:
        assert not rep and ("decode step" if fault in decoding_presets() else "§2.11") in rep.diagnosis, \
            rep.verdict_line()


def test_unsupported_architecture_is_refused(tmp_path, run_cli):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    res = run_cli("run", "reference", "batched-left", "--model", f"hf:{d}")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "GPT2LMHeadModel" in res.output and "supported: LlamaForCausalLM, MistralForCausalLM, " \
        "Qwen2ForCausalLM" in res.output
    assert "no *.safetensors files" in res.output  # nor could transformers run it: both reasons are given


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small Llama checkpoint as transformers saves it (its own config.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=False, max_position_embeddings=512))
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d, safe_serialization=True)
    return d, model


def _edited(src, dst, **changes):
    """A copy of checkpoint ``src`` with config.json fields changed (None: removed)."""
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_gelu_llama_is_refused_naming_the_field(llama_dir, tmp_path, run_cli):
    """A Llama with hidden_act="gelu" used to load and run as SiLU: a native-vs-native comparison passed."""
    d = _edited(llama_dir[0], tmp_path / "gelu", hidden_act="gelu")
    res = run_cli("run", "reference", "batched-left", "--model", f"hf:{d}")
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert "hidden_act='gelu'" in line and "supported: 'silu'" in line, line
    assert "Traceback" not in res.output


# faults that need a sliding window or experts: on a dense model without a window they say why they cannot show
CANNOT_SHOW_ON_DENSE = {"fault:window-off-by-one": "no sliding-window layer",
                        "fault:router-norm-topk": "no mixture of experts",
                        "fault:router-topk-off-by-one": "no mixture of experts",
                        "fault:shared-gate-dropped": "no mixture of experts"}

UNSUPPORTED = [  # (field, value, words the refusal must contain)
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("use_qk_norm", True, "use_qk_norm=true"),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}, "rope_parameters="),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "linear"}, "with ['factor']"),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
     "partial_rotary_factor 1.0"),
    ("rope_interleaved", True, "rope_interleaved=true"),
    ("sliding_window", 128, "sliding_window=128"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types="),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}, "quantization_config="),
    ("model_type", "qwen3", "model_type='qwen3'"),
    ("pruned_heads", {"0": [1]}, "pruned_heads="),
]


@pytest.mark.parametrize("field,value,words", UNSUPPORTED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(UNSUPPORTED)])
def test_every_unsupported_config_field_is_refused(llama_dir, tmp_path, field, value, words):
    """Our engine refuses, by name, a field it does not compute: the checkpoint is then only described (for the
    transformers engine, which runs its own classes) and building it for our engine raises the refusal."""
    from prefill_diff.engine.shared.errors import UnsupportedModel
    d = _edited(llama_dir[0], tmp_path / "x", **{field: value})
    snap = load_snapshot(ModelSpec(f"hf:{d}"))
    assert snap.foreign is not None and not snap.state, "described, no weight read"
    with pytest.raises(UnsupportedModel, match="supported") as e:
        build(snap)
    assert words in str(e.value) and str(d) in str(e.value), str(e.value)


def test_an_unsupported_field_is_refused_by_every_engine_but_transformers(llama_dir, tmp_path, run_cli):
    d = _edited(llama_dir[0], tmp_path / "x", rope_interleaved=True)
    res = run_cli("run", "reference", "batched-left", "--model", f"hf:{d}")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "rope_interleaved=true" in res.output and "only the transformers engine" in res.output


@pytest.mark.parametrize("field,value,words", [("head_dim", 0, "head_dim=0 is not valid (it must be a positive"),
                                               ("num_key_value_heads", -2, "num_key_value_heads=-2 is not valid")])
def test_a_malformed_size_is_an_error_not_a_foreign_model(llama_dir, tmp_path, field, value, words):
    from prefill_diff.engine.shared.errors import ModelLoadError
    d = _edited(llama_dir[0], tmp_path / "x", **{field: value})
    with pytest.raises(ModelLoadError) as e:
        load_snapshot(ModelSpec(f"hf:{d}"))
    assert words in str(e.value), str(e.value)


def test_harmless_fields_and_real_world_configs_are_accepted(llama_dir, tmp_path):
    """Fields that cannot change a prefill load; configs shaped like SmolLM2's and Llama 3.1's own load."""
    from prefill_diff.engine.models.hub import args_from_hf_config
    d = _edited(llama_dir[0], tmp_path / "ok", torch_dtype="bfloat16", bos_token_id=1, use_cache=False,
                initializer_range=0.5, transformers_version="4.42.3", pretraining_tp=2, attention_dropout=0.1,
                temperature=0.7, attn_logit_softcapping=50.0)  # Gemma's field: Llama's code never reads it
    snap = load_snapshot(ModelSpec(f"hf:{d}"))
    assert snap.args.hidden_act == "silu" and not snap.args.tie_embeddings
    smol = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
            "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
            "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
            "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
            "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers.js_config": {"dtype": "q4"},
            "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152}
    a = args_from_hf_config(smol, "smol")
    assert (a.dim, a.n_heads, a.head_dim, a.rope_theta, a.tie_embeddings) == (576, 9, 64, 100000.0, True)
    llama31 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
               "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 64,
               "intermediate_size": 96, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
               "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192,
                                                       "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 300}
    a = args_from_hf_config(llama31, "llama31")
    assert dict(a.rope_scaling)["rope_type"] == "llama3" and a.rope_theta == 500000.0
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
              "intermediate_size": 96, "max_position_embeddings": 32768, "max_window_layers": 21,
              "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 300}
    assert args_from_hf_config(qwen25, "qwen25").qkv_bias


def test_untied_checkpoint_without_lm_head_and_stray_tensors_are_refused(llama_dir, tmp_path):
    """tie_word_embeddings=false with no lm_head used to be tied silently; a tensor the model does not use
    (an o_proj bias, an MLP bias) used to be dropped silently by the non-strict state-dict load."""
    from safetensors.torch import load_file, save_file
    from prefill_diff.engine.shared.errors import ModelLoadError
    src = llama_dir[0]
    d = _edited(src, tmp_path / "nohead")
    st = next(d.glob("*.safetensors"))
    state = load_file(str(st))
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(st))
    with pytest.raises(ModelLoadError, match="tie_word_embeddings is false but the checkpoint has no lm_head"):
        load_snapshot(ModelSpec(f"hf:{d}"))
    d = _edited(src, tmp_path / "headbias")
    st = next(d.glob("*.safetensors"))
    save_file({**state, "lm_head.bias": torch.zeros(300)}, str(st))
    with pytest.raises(ModelLoadError, match="'output.bias' is not part of the model"):
        load_snapshot(ModelSpec(f"hf:{d}"))


@pytest.mark.parametrize("case", ["partial-rotary", "sliding-window", "rope-freqs-tensor", "qk-norm-tensor"])
def test_gguf_metadata_and_tensors_we_do_not_implement_are_refused(llama_dir, tmp_path, case):
    from prefill_diff.engine.shared.errors import ModelLoadError
    model = llama_dir[1]
    extra, tensors, words = {}, {}, ""
    if case == "partial-rotary":
        extra, words = {"llama.rope.dimension_count": 8}, "llama.rope.dimension_count=8 is not supported"
    elif case == "sliding-window":
        extra, words = {"llama.attention.sliding_window": 64}, "llama.attention.sliding_window=64"
    elif case == "rope-freqs-tensor":
        tensors, words = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}, "tensor 'rope_freqs.weight'"
    else:
        tensors, words = {"blk.0.attn_q_norm.weight": np.ones(16, dtype=np.float32)}, "'blk.0.attn_q_norm.weight'"
    _write_gguf(tmp_path / "m.gguf", model, "llama", extra, tensors)
    with pytest.raises(ModelLoadError) as e:
        load_snapshot(ModelSpec(f"gguf:{tmp_path / 'm.gguf'}"))
    assert words in str(e.value), str(e.value)


def test_missing_checkpoint_and_pickles_are_refused(tmp_path, run_cli):
    res = run_cli("run", "reference", "batched-left", "--model", f"hf:{tmp_path / 'nope'}")
    assert res.exit_code == 2 and "no config.json" in res.output
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                               "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "intermediate_size": 8, "vocab_size": 10}))
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    res = run_cli("run", "reference", "batched-left", "--model", f"hf:{d}")
    assert res.exit_code == 2 and "pickled .bin checkpoints are not loaded" in res.output


def test_text_prompt_on_a_model_without_tokenizer_is_refused(run_cli):
    res = run_cli("run", "reference", "batched-left", "--prompt", "hello")
    assert res.exit_code == 2 and "text prompts need a tokenizer" in res.output


@pytest.fixture(scope="module")
def smol_reference(smol_dir):
    return record("reference", smol_dir, "ref3", inputs=THREE)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in spawning_presets()])
def test_every_preset_runs_on_smollm2(smol_reference, tmp_path, preset):
    cand = record(preset, tmp_path, "c", inputs=with_response(preset, THREE))
    if with_response(preset, THREE) != THREE:  # a decoding preset: the reference prefills the same response
        smol_reference = record("reference", tmp_path, "r", inputs=with_response(preset, THREE))
    with Trace(smol_reference) as a, Trace(cand) as b:
        rep = compare_traces(a, b)
    if preset in CANNOT_SHOW_ON_DENSE:  # SmolLM2 has neither a window nor experts: it says so
        assert rep.first_break is None and "INCONCLUSIVE" in rep.verdict_line(), rep.verdict_line()
        assert any(CANNOT_SHOW_ON_DENSE[preset] in note for note in rep.inconclusive), rep.inconclusive
    elif preset == "fault:stale-param":
        assert rep.first_break.kind == "identity" and STALE in rep.verdict_line(), rep.verdict_line()
    elif preset.startswith("fault:"):
        assert not rep and ("decode step" if preset in decoding_presets() else "§2.11") in rep.diagnosis, \
            rep.verdict_line()
    else:
        assert rep, f"{preset}: {rep.verdict_line()}"


def test_fp32_engine_shares_the_snapshot_weights():
    """Loading keeps one float32 copy: a float32 engine uses the snapshot's tensors, not copies."""
    from prefill_diff.engine.native.prefill import Engine
    snap = load_snapshot(SMOL)
    eng = Engine(snap)
    assert eng.model.layers[3].attention.wq.weight.data_ptr() == snap.state["layers.3.attention.wq.weight"].data_ptr()
    assert eng.model.output.weight.data_ptr() == eng.model.tok_embeddings.weight.data_ptr()  # tied, once
    ptrs = [t.data_ptr() for k, t in snap.state.items() if k != "output.weight"]
    assert len(set(ptrs)) == len(ptrs)


def test_thirty_layer_run_reports_progress(smol_dir):
    from prefill_diff.jobs import run as run_pair
    seen = {}

    def progress(label):
        seen[label] = []
        return seen[label].append
    out = run_pair("reference", "sdpa", SMOL, FRANCE, progress=progress)
    assert out.report
    assert seen == {"reference": list(range(30)), "candidate": list(range(30))}


def test_reports_show_token_text_beside_ids(run_cli, tmp_path):
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    res = run_cli("run", "reference", "fault:unmasked-padding", "--model", "smollm2", "--prompt",
                  "The capital of France is", "--prompt", "Hi", "--json", out, "--junit", xml)
    assert res.exit_code == 1
    rep = json.loads(out.read_text())
    fb = rep["first_break"]
    assert (fb["sample"], fb["position"], fb["token_text"]) == (1, 0, "Hi") and fb["token_id"] == 26843
    assert "sample 1 pos 0 'Hi'" in rep["verdict_line"] and "sample 1 pos 0 'Hi'" in xml.read_text()
    top = rep["final"]["top"][0]
    assert top["reference_text"][0] == " Paris" and len(top["reference_text"]) == len(top["reference"])
    assert "7042:'␣Paris'" in res.output  # token text as one word: spaces shown as ␣


def test_transformers_side_never_falls_back_to_a_pickled_bin(qwen_dir, tmp_path):
    """A checkpoint holding both: the transformers engine must read the safetensors, as our loader does."""
    import shutil
    d = tmp_path / "both"
    shutil.copytree(qwen_dir, d)
    from safetensors.torch import load_file
    st = next(d.glob("*.safetensors"))
    other = {k: v + 1.0 for k, v in load_file(str(st)).items()}
    torch.save(other, d / "pytorch_model.bin")  # different weights, pickled
    spec, inputs = ModelSpec(f"hf:{d}"), Inputs(token_ids=((5, 17, 33, 250), (2, 3)))
    ours = record_side(prepare_side("reference", spec, inputs), tmp_path / "o.h5")
    theirs = record_side(prepare_side("transformers", spec, inputs), tmp_path / "t.h5")
    with Trace(ours) as a, Trace(theirs) as b:
        rep = compare_traces(a, b)
        assert rep, rep.verdict_line()
    st.rename(d / "weights-00001.safetensors")  # a name our loader reads and transformers does not look for
    from prefill_diff.engine.shared.errors import PrefillDiffError
    with pytest.raises(PrefillDiffError, match="safetensors"):  # refused, never read from the .bin
        record_side(prepare_side("transformers", spec, inputs), tmp_path / "t2.h5")
