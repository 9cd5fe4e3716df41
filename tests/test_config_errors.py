"""Config and tolerance-file errors: one line naming the file, the section and key, the value, what is allowed and
the closest match; a missing file is "no such file"."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

BAD_VALUES = {
    '[run]\ndtype = "bf16"': "[run] dtype must be one of float64, float32, bfloat16, float16 (got 'bf16'; did you "
                             "mean bfloat16?)",
    '[run]\ndtype = "fp16"': "(got 'fp16'; did you mean float16?)",
    '[run]\ndtype = "int4"': "[run] dtype must be one of float64, float32, bfloat16, float16 (got 'int4')",
    '[run]\nkernel = "sdp"': "[run] kernel must be one of eager, sdpa, tiled (got 'sdp'; did you mean sdpa?)",
    '[run]\nweight_quant = "int4"': "[run] weight_quant must be one of none, int8 (got 'int4'; did you mean int8?)",
    '[run]\nbatching = "lft"': "[run] batching must be one of unbatched, left, right, packed (got 'lft'; did you "
                               "mean left?)",
    '[cache]\ndtype = "bf16"': "[cache] dtype must be one of float64, float32, bfloat16, float16, int8, fp8_e4m3, "
                               "fp8_e5m2 (got 'bf16'; did you mean bfloat16?)",
    '[cache]\nkind = "page"': "[cache] kind must be one of contiguous, paged (got 'page'; did you mean paged?)",
    '[fault]\nname = "gqa-maping"': "[fault] name must be one of",
    '[reuse]\nprefix_len = 0': "[reuse] prefix_len must be a positive integer (got 0)",
    '[model]\nsource = "synthetic:qwn2"': "[model] source must be one of seed-2.8, synthetic, synthetic:qwen2",
    '[model]\nn_kv_heads = 3': "[model] n_heads must be divisible by n_kv_heads (got n_heads=4, n_kv_heads=3)",
    '[model]\nsource = "smollm2"\nn_layers = 2': "[model] size overrides apply to synthetic models only",
}


@pytest.mark.parametrize("body", sorted(BAD_VALUES))
def test_record_a_bad_config_value_names_the_file_and_section(run_cli, tmp_path, body):
    cfg = tmp_path / "c.toml"
    cfg.write_text(body + "\n")
    res = run_cli("record", cfg, "-o", tmp_path / "t.h5")
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and f"Error: {cfg}: " in error[0] and BAD_VALUES[body] in error[0], res.output
    assert "Traceback" not in res.output and not (tmp_path / "t.h5").exists()


def test_run_a_bad_model_flag_gets_did_you_mean(run_cli):
    res = run_cli("run", "reference", "batched-left", "--model", "synthetic:gema2")
    assert res.exit_code == 2
    assert "--model must be one of seed-2.8, synthetic, synthetic:qwen2" in res.output
    assert "(got 'synthetic:gema2'; did you mean synthetic:gemma2?)" in res.output


TOLERANCE_TYPOS = {
    "atoll = 1e-5": "unknown key atoll (did you mean atol?) (keys: base, equal_nan, topk, name, atol, rtol, ntol, "
                    "row_rtol; tables: [residual], [attn_update], [mlp_update]",
    "[attn_updte]\natol = 1e-5": "unknown table [attn_updte] (did you mean [attn_update]?) (tables: [residual], "
                                 "[attn_update]",
    "[residual]\nrtoll = 1e-5": "unknown key [residual] rtoll (did you mean rtol?) (keys: atol, rtol, ntol, row_rtol)",
    "bogus = 1": "unknown key bogus (keys: base,",
}


@pytest.mark.parametrize("body", sorted(TOLERANCE_TYPOS))
def test_record_a_tolerance_file_typo_is_one_line_with_the_closest_key(run_cli, tmp_path, body):
    tol = tmp_path / "tol.toml"
    tol.write_text(body + "\n")
    res = run_cli("record", "reference", "-o", tmp_path / "t.h5", "--tolerance", tol)
    assert res.exit_code == 2, res.output
    assert res.output.strip().count("\n") == 0, res.output  # one line
    assert f"Error: {tol}: {TOLERANCE_TYPOS[body]}" in res.output, res.output
    assert "[" + "'" not in res.output  # no Python list
    if "bogus" in body:
        assert "did you mean" not in res.output


@pytest.mark.parametrize("missing", ["missing.h5", "missing.hdf5", "missing.toml", "sub/missing"])
def test_compare_a_missing_candidate_file_says_no_such_file(run_cli, tmp_path, missing):
    base = tmp_path / "base.h5"
    shutil.copy(DATA / "trace-v1.2.h5", base)
    res = run_cli("compare", base, tmp_path / missing)
    assert res.exit_code == 2
    assert f"no such file: {tmp_path / missing}" in res.output, res.output
    assert "neither a preset nor a config file" not in res.output


def test_run_a_missing_config_says_no_such_file_and_a_bare_word_is_still_a_preset_typo(run_cli, tmp_path):
    res = run_cli("run", "reference", "configs/candidate.toml")
    assert res.exit_code == 2 and "no such file: configs/candidate.toml" in res.output, res.output
    res = run_cli("run", "reference", "batched-lft")
    assert res.exit_code == 2 and "neither a preset nor a config file; did you mean batched-left?" in res.output


def test_run_a_trace_given_as_a_side_is_named_a_trace(run_cli, tmp_path):
    trace = tmp_path / "t.h5"
    shutil.copy(DATA / "trace-v1.2.h5", trace)
    res = run_cli("run", "reference", trace)
    assert res.exit_code == 2
    assert f"{trace}: a trace file, not a preset or a config file" in res.output, res.output
