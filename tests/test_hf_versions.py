"""The transformers engine on each release pyproject's [hf] extra accepts (5.0 to the newest), against our engine.

CI runs this file twice: in the main environment (the newest transformers) and in a small one with the lowest
release the extra declares (.ci/run, .ci-venv-lowest). What differs between releases is tested by what the
installed release does, or by giving it the other release's behaviour (a monkeypatched class attribute).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from prefill_diff.engine.foreign import hf_engine
from prefill_diff.engine.models.sources import load_source
from prefill_diff.engine.models.spec import ModelSpec

PROMPTS = ("--tokens", "5,6,7,8,9,10,11,12,13", "--tokens", "40,41,42")  # 9 tokens: past Phi-3's original 8


def _json(res) -> dict:
    return json.loads(res.output[res.output.index("{"):])


def _one_line_refusal(res, *words):
    text = res.output.strip()
    assert res.exit_code == 2 and "\n" not in text, (res.exit_code, text)
    assert "Traceback" not in text and "internal error" not in text, text
    for w in words:
        assert w in text, (w, text)


def _checkpoint(config, d, seed=0):
    """A tiny random checkpoint as transformers itself writes it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(d)
    return d


def _rewrite_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


# -- the KV cache transformers returns ----------------------------------------------------------------------

@dataclass
class _Before524:
    logits: object = None
    past_key_values: object = None


@dataclass
class _From524:
    logits: object = None
    cache: object = None


def test_the_returned_cache_is_read_under_the_name_each_release_gives_it():
    assert hf_engine.returned_cache(_Before524(past_key_values="kv")) == "kv"
    assert hf_engine.returned_cache(_From524(cache="kv")) == "kv"


@pytest.mark.parametrize("family", ["synthetic", "synthetic:qwen3"])
def test_the_transformers_engine_agrees_with_ours_on_this_release(family, run_cli):
    res = run_cli("run", "reference", "transformers", "--model", family, "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output[-2000:]
    assert rep["final"]["tensors"]["logits"]["max_abs"] < 1e-4


def test_a_transformers_checkpoint_agrees_with_ours_on_this_release(run_cli, tmp_path):
    from transformers import Qwen3Config
    d = _checkpoint(Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=False), tmp_path / "m")
    res = run_cli("run", "reference", "transformers", "--model", f"hf:{d}", *PROMPTS, "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output[-2000:]


def test_a_release_below_the_lowest_the_extra_declares_is_refused_in_one_line(run_cli, monkeypatch):
    monkeypatch.setattr(hf_engine, "release", lambda: "4.57.1")
    res = run_cli("run", "reference", "transformers")
    _one_line_refusal(res, "transformers 5.0 or later", "found transformers 4.57.1", "prefill-diff[hf]")


def test_the_bookkeeping_field_transformers_5_0_saves_for_phi3_is_read(tmp_path):
    """Phi3Config of transformers 5.0 saves ignore_keys_at_rope_validation (null): the RoPE keys its own validation
    skips, nothing the model computes. Our engine runs the checkpoint, not only transformers."""
    d = _phi3(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "ignore_keys_at_rope_validation": None}))
    snap = load_source(ModelSpec(f"hf:{d}"))
    assert snap.foreign is None and snap.state


# -- Gemma 2 under sdpa -------------------------------------------------------------------------------------

def _gemma2(tmp_path, softcap=3.0):
    from transformers import Gemma2Config
    return _checkpoint(Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    query_pre_attn_scalar=32, sliding_window=4, attn_logit_softcapping=softcap,
                                    final_logit_softcapping=4.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                       tmp_path / "gemma2")


def test_gemma2_under_sdpa_is_refused_as_transformers_refuses_it(run_cli, tmp_path, monkeypatch):
    """transformers 5.21 and later refuse sdpa for Gemma 2 (any config); an earlier release is given that
    behaviour. The refusal is the attention's, not a checkpoint transformers cannot load."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel
    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", False)
    d = _gemma2(tmp_path, softcap=None)
    res = run_cli("run", "reference", "transformers-sdpa", "--model", f"hf:{d}")
    _one_line_refusal(res, "transformers refuses sdpa for Gemma 2 (no soft-capping)", 'attn_implementation = "eager"')
    assert "cannot load" not in res.output


def test_gemma2_on_a_release_whose_sdpa_drops_the_soft_cap_is_refused(run_cli, monkeypatch):
    """Before 5.21 transformers runs Gemma 2 under sdpa and leaves attn_logit_softcapping out (another function);
    the newest release is given that behaviour."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel
    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)
    res = run_cli("run", "reference", "transformers-sdpa", "--model", "synthetic:gemma2")
    _one_line_refusal(res, "transformers' sdpa has no soft-capping", "without its attn_logit_softcapping=")


def test_a_checkpoint_transformers_refuses_an_attention_for_is_not_called_unloadable(run_cli, tmp_path,
                                                                                      monkeypatch):
    """Whatever family transformers refuses an attention implementation for, the line says so."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    d = _checkpoint(Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16), tmp_path / "m")

    def refuse(*args, **kwargs):  # the message transformers 5.25 gives for Gemma 2
        raise ValueError("Qwen3ForCausalLM does not support an attention implementation through "
                         "torch.nn.functional.scaled_dot_product_attention yet.\nPlease request the support")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    res = run_cli("run", "reference", "transformers-sdpa", "--model", f"hf:{d}")
    _one_line_refusal(res, "transformers cannot build it with attn_implementation='sdpa'", "Qwen3ForCausalLM")


# -- Phi-3's legacy RoPE types --------------------------------------------------------------------------------

def _phi3(tmp_path):
    from transformers import Phi3Config
    return _checkpoint(Phi3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  max_position_embeddings=64, original_max_position_embeddings=8,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                   "short_factor": [1.0 + 0.1 * i for i in range(16)],
                                                   "long_factor": [2.0 + 0.3 * i for i in range(16)]},
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2), tmp_path / "phi3")


def _legacy(d, kind):
    """The checkpoint's config as Phi-3's first releases wrote it: rope_scaling with a legacy type, rope_theta
    beside it."""
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg["rope_parameters"]
    _rewrite_config(d, rope_parameters=None, rope_theta=rope["rope_theta"],
                    rope_scaling={"type": kind, "short_factor": rope["short_factor"],
                                  "long_factor": rope["long_factor"]})


def _transformers_reads(d) -> str | None:
    """None when the installed transformers loads the checkpoint's config, else its complaint."""
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(d, local_files_only=True)
    except (KeyError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["su", "yarn"])
def test_phi3_legacy_rope_types_are_longrope_as_transformers_reads_them(kind, run_cli, tmp_path):
    """transformers' Phi3Config reads rope_scaling type "su" and "yarn" as longrope; our engine runs such a
    checkpoint as the same LongRoPE model, and agrees with transformers on it wherever the installed release
    loads it (5.0 refuses "su": the transformers side then says so in one line)."""
    d = _phi3(tmp_path)
    want = load_source(ModelSpec(f"hf:{d}")).args
    _legacy(d, kind)
    got = load_source(ModelSpec(f"hf:{d}")).args
    assert dict(got.rope_scaling)["rope_type"] == "longrope" and got == want
    res = run_cli("run", "reference", "transformers", "--model", f"hf:{d}", *PROMPTS, "--json", "-")
    if _transformers_reads(d) is not None:
        _one_line_refusal(res, f"transformers {hf_engine.release()} cannot load it")
        return
    rep = _json(res)
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output[-2000:]
    assert rep["final"]["tensors"]["logits"]["max_abs"] < 1e-4


def test_phi3_yarn_without_longrope_factors_is_refused_naming_what_transformers_reads(run_cli, tmp_path):
    d = _phi3(tmp_path)
    _rewrite_config(d, rope_parameters=None, rope_theta=1e4,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    res = run_cli("run", "reference", "reference", "--model", f"hf:{d}")
    _one_line_refusal(res, "rope_scaling", "'yarn' (which transformers' phi3 reads as 'longrope')", "long_factor")


def test_tensor_parallelism_on_a_release_whose_distributed_config_has_no_tp_size_is_refused(run_cli, monkeypatch):
    """Before 5.13 DistributedConfig has no tp_size, and the sharded attention's o_proj reads every head (5.0
    measured): refused before any process starts."""
    import importlib
    distributed = importlib.import_module("transformers.distributed")

    class Before513:  # transformers 5.0 to 5.12
        def __init__(self, enable_expert_parallel: bool = False):
            self.enable_expert_parallel = enable_expert_parallel
    monkeypatch.setattr(distributed, "DistributedConfig", Before513)
    res = run_cli("run", "reference", "transformers-tp2", "--model", "synthetic")
    _one_line_refusal(res, "transformers' tensor parallelism needs transformers 5.13 or later",
                      f"found transformers {hf_engine.release()}")
