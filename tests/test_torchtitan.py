"""The torchtitan engine: TorchTitan's own Qwen3 / Llama 3 model, recorded through hooks
(engine/foreign/torchtitan_engine.py). Its states, cache and logits are compared with transformers' own model on
the same weights (an independent implementation); the options and the refusals are unit-tested without a forward.

TorchTitan's flex attention compiles through inductor on its first forward (tens of seconds, then cached in the
process): the runs share one process and each family's run is made once (module-scoped fixtures)."""
from __future__ import annotations

import json

import pytest
import torch

from prefill_diff.engine.foreign import torchtitan_engine
from prefill_diff.engine.foreign.torchtitan_options import TorchTitanOptions
from prefill_diff.engine.shared.errors import ConfigError

QWEN3 = "synthetic:qwen3"


def _cli(*args):
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _report(tmp, *args) -> tuple[dict, object]:
    out = tmp / "report.json"
    res = _cli("run", *args, "--json", out, "--out", tmp)
    assert out.exists(), res.output[-2000:]
    return json.loads(out.read_text()), res


# -- options and refusals (no forward) ----------------------------------------------------------------------

@pytest.mark.parametrize("kw, says", [
    ({"attention": "sdpa"}, "attention must be one of flex, varlen (got 'sdpa')"),
    ({"attention": "varlen"}, "aten::_flash_attention_forward: CUDA only, no CPU kernel"),
    ({"compile": "yes"}, "compile must be true or false (got 'yes')"),
])
def test_options_are_validated_in_one_line(kw, says):
    with pytest.raises(ConfigError) as e:
        TorchTitanOptions(**kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_varlen_is_refused_from_a_config_with_exit_2(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "torchtitan"\n[run.torchtitan]\nattention = "varlen"\n')
    res = _cli("run", "transformers", cfg, "--model", QWEN3)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "varlen_attn" in res.output and 'use attention = "flex"' in res.output


@pytest.mark.parametrize("toml, model, says", [
    ('[run]\nbatching = "left"\n', QWEN3, "TorchTitan trains on packed documents without padding"),
    ('[run]\ndecode = true\n', QWEN3, "TorchTitan's trainer has no KV cache"),
    ('[run]\ndtype = "float16"\n', QWEN3, "TorchTitan's model runs float32 or bfloat16 here"),
    ('[reuse]\nprefix_len = 4\n', QWEN3, "prefix reuse"),
    ("", "synthetic:gemma2", "a model of the gemma2 family (TorchTitan's dense Qwen3 and Llama 3 only)"),
    ("", "synthetic:llama-biased", "not qkv_bias=true, o_bias=true, mlp_bias=true"),
])
def test_what_torchtitan_cannot_run_is_refused_in_one_line(toml, model, says, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "torchtitan"\n' + toml)
    res = _cli("run", "transformers", cfg, "--model", model)
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow  # imports TorchTitan (seconds)
def test_llama_keys_go_back_to_hugging_face_layout():
    """TorchTitan's adapter permutes Llama's q/k rows so that rotation pairs sit side by side; the cache is
    recorded in Hugging Face's layout: the inverse of the adapter's own permutation."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of d_h = 8, 3 inputs
    titan = Llama3StateDictAdapter._reverse_permute(None, w, 2)  # HF rows -> TorchTitan's rows
    x = torch.randn(3)
    k_titan = (titan @ x).reshape(2, 8)  # per head, TorchTitan's layout
    assert torch.equal(torchtitan_engine._interleaved_to_half(k_titan), (w @ x).reshape(2, 8))


# -- TorchTitan against transformers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_fp32(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tt-qwen3")
    return _report(tmp, "transformers", "torchtitan", "--model", QWEN3) + (tmp,)


@pytest.mark.slow
def test_qwen3_float32_passes_the_float32_rule(qwen3_fp32):
    rep, res, tmp = qwen3_fp32
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert rep["rule"].startswith("fixed float32 rule") and len(rep["layers"]) == 4
    seen = set(rep["layers"][0]["tensors"])
    assert {"layer_input", "attn_update", "mid", "mlp_update", "layer_output", "cache_keys", "cache_values",
            "attn_heads"} <= seen, seen
    worst = max(t["max_abs"] for lr in rep["layers"] for t in lr["tensors"].values())
    assert 0 < worst < 1e-5  # another implementation: not bitwise the same, within float32's noise


@pytest.mark.slow
def test_qwen3_bfloat16_passes_the_calibrated_verdict(tmp_path):
    rep, res = _report(tmp_path, "transformers", "torchtitan-bf16", "--model", QWEN3)
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert rep["rule"].startswith("calibrated:") and "bfloat16" in rep["rule"], rep["rule"]
    assert rep["policy"]["calibration"]["golden"] == "float64", rep["policy"]


@pytest.mark.slow
def test_a_perturbed_weight_fails_at_its_layer(tmp_path, monkeypatch):
    """One weight of layer 2's MLP changed after TorchTitan loaded it: FAILED, first at layer 2's mlp_update."""
    built = torchtitan_engine.build_model

    def perturbed(*a, **kw):
        model = built(*a, **kw)
        with torch.no_grad():
            model.layers["2"].feed_forward.w2.weight[0, 0] += 0.5
        return model
    monkeypatch.setattr(torchtitan_engine, "build_model", perturbed)
    rep, res = _report(tmp_path, "transformers", "torchtitan", "--model", QWEN3)
    fb = rep["first_break"]
    assert res.exit_code == 1 and rep["verdict"] == "fail", rep["verdict_line"]
    assert (fb["stage"], fb["layer"], fb["tensor"]) == ("layer", 2, "mlp_update"), fb


@pytest.mark.slow
def test_a_faulty_reference_fails_against_torchtitan(tmp_path):
    """The comparison is not vacuous: our engine with query head 0 reading the wrong KV head (fault row 4)
    against TorchTitan fails at layer 0."""
    rep, res = _report(tmp_path, "fault:gqa-mapping", "torchtitan", "--model", QWEN3)
    assert res.exit_code == 1 and rep["first_break"]["layer"] == 0, rep["verdict_line"]


@pytest.mark.slow
def test_llama_states_equal_transformers_within_float32(tmp_path):
    rep, res = _report(tmp_path, "transformers", "torchtitan", "--model", "synthetic")
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert rep["rule"].startswith("fixed float32 rule")
    keys = [lr["tensors"]["cache_keys"]["max_abs"] for lr in rep["layers"]]
    assert max(keys) < 1e-5, keys  # its keys, rotated in TorchTitan's pair layout, put back in HF's


@pytest.mark.slow
def test_unbatched_compiled_blocks_with_a_response_pass(tmp_path):
    """One forward per prompt, each block compiled as TorchTitan's trainer compiles it, and the response's
    logits (a trainer scoring a rollout) compared too."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "torchtitan"\n[run]\nbatching = "unbatched"\n[run.torchtitan]\ncompile = true\n')
    rep, res = _report(tmp_path, "transformers", cfg, "--model", QWEN3, "--response-ids", "31,32,33,34")
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    lp = rep["logprobs"]  # the log-probs of the 4 response tokens of each of the 3 prompts, both sides
    assert lp["tokens"] == 12 and lp["chosen_by"] == "given" and lp["max_abs_dlogp"] < 1e-5, lp
