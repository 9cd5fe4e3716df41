"""The command line: verdicts, exit statuses, JSON keys, bad input, help and README coverage."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prefill_diff.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
SPEC_KEYS = {"stage", "layer", "kind", "tensor", "sample", "position", "max_abs_error", "max_rel_error"}


def report_of(run_cli, *args, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", *args, "--json", out)
    return res, json.loads(out.read_text())


@pytest.mark.parametrize("cand", ["batched-left", "batched-right"])
def test_run_batched_passes(run_cli, tmp_path, cand):
    res, rep = report_of(run_cli, "reference", cand, tmp_path=tmp_path)
    assert res.exit_code == 0, res.output
    assert rep["verdict"] == "pass" and rep["first_break"] is None
    assert len(rep["layers"]) == 4 and all(row["passed"] for row in rep["layers"])
    assert "PASSED | 4/4 layers" in res.output


def test_run_unmasked_padding_breaks_layer_0_on_padded_samples_only(run_cli, tmp_path):
    res, rep = report_of(run_cli, "reference", "fault:unmasked-padding", tmp_path=tmp_path)
    assert res.exit_code == 1, res.output
    fb = rep["first_break"]
    assert SPEC_KEYS <= set(fb)
    assert (fb["stage"], fb["layer"], fb["kind"], fb["tensor"]) == ("layer", 0, "value", "attn_update")
    assert fb["max_abs_error"] > fb["atol"]
    # the built-in prompts have lengths 70, 45, 9: samples 1 and 2 are padded, sample 0 is not
    assert set(fb["samples"]) == {1, 2}
    layer0 = rep["layers"][0]["tensors"]["attn_update"]
    assert 0 not in layer0["bad_samples"]
    assert "FAILED | layer 0 attn_update" in res.output


def test_json_report_keys(run_cli, tmp_path):
    res, rep = report_of(run_cli, "reference", "fault:skip-kv", tmp_path=tmp_path)
    assert res.exit_code == 1
    assert {"verdict", "first_break", "layers"} <= set(rep)
    assert rep["first_break"]["kind"] == "cache_length"
    assert rep["first_break"]["layer"] == 2  # the middle layer of 4 skips the write
    for row in rep["layers"]:
        assert {"layer", "passed", "tensors", "first_break"} <= set(row)


def test_json_to_stdout_is_plain_json(run_cli):
    res = run_cli("run", "reference", "batched-left", "--json", "-")
    assert res.exit_code == 0
    assert "\x1b[" not in res.output
    assert json.loads(res.output)["verdict"] == "pass"


def test_run_bad_preset_exits_2(run_cli):
    res = run_cli("run", "reference", "no-such-preset")
    assert res.exit_code == 2
    assert "neither a preset nor a config file" in res.output
    assert "Traceback" not in res.output


def test_config_unknown_key_is_an_error(run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "batched-left"\n[run]\nbatchin = "left"\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2
    assert "unknown key [run] batchin" in res.output


@pytest.mark.parametrize("given, said", [
    ("batched-lft", "'batched-lft' is neither a preset nor a config file; did you mean batched-left?"),
    ("fault:gqa-maping", "did you mean fault:gqa-mapping?"),
    ('[run]\ndtpye = "bfloat16"\n', "unknown key [run] dtpye (did you mean dtype?)"),
    ('[modle]\nseed = 3\n', "unknown key [top level] modle (did you mean model?)"),
    ('preset = "chunkd"\n', "(got 'chunkd'; did you mean chunked?)"),
])
def test_a_typo_in_a_preset_or_config_key_gets_did_you_mean(run_cli, tmp_path, given, said):
    if "\n" in given:
        (tmp_path / "c.toml").write_text(given)
        given = tmp_path / "c.toml"
    res = run_cli("run", "reference", given)
    assert res.exit_code == 2 and said in res.output, res.output
    res = run_cli("run", "reference", "zzzz")
    assert res.exit_code == 2 and "did you mean" not in res.output


def test_config_sets_model_inputs_and_sizes(run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "batched-right"\n[model]\nsource = "synthetic"\nn_layers = 2\ndim = 32\n'
                   'head_dim = 8\n[inputs]\ntoken_ids = [[1, 2, 3, 4], [5, 6]]\n')
    ref = tmp_path / "r.toml"
    ref.write_text('[model]\nsource = "synthetic"\nn_layers = 2\ndim = 32\nhead_dim = 8\n'
                   '[inputs]\ntoken_ids = [[1, 2, 3, 4], [5, 6]]\n')
    res, rep = report_of(run_cli, ref, cfg, tmp_path=tmp_path)
    assert res.exit_code == 0, res.output
    assert len(rep["layers"]) == 2
    assert rep["samples"] == [{"reference": 0, "candidate": 0}, {"reference": 1, "candidate": 1}]


def test_config_bad_toml_exits_2(run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run\n")
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and "not valid TOML" in res.output


def test_config_bad_value_exits_2(run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nn_heads = 6\nn_kv_heads = 4\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2
    assert "n_heads must be divisible by n_kv_heads (got n_heads=6, n_kv_heads=4)" in res.output


def test_tokens_option_and_precondition_exit_2(run_cli):
    res = run_cli("run", "reference", "batched-left", "--tokens", "1,2,3", "--tokens", "4,500")
    assert res.exit_code == 2
    assert "2.1(1)" in res.output and "id 500" in res.output


def test_ledger_default_is_the_seed_table(run_cli):
    res = run_cli("ledger")
    assert res.exit_code == 0
    assert "[1, 12, 8]" in res.output and "[1, 2, 12, 12]" in res.output
    assert re.search(r"\b192\b", res.output)
    assert "logits [20]" in res.output


def test_presets_lists_every_preset(run_cli):
    from prefill_diff.engine.presets import PRESETS
    res = run_cli("presets")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert len(lines) == len(PRESETS)  # one line each, never wrapped
    for line, (name, (desc, _)) in zip(lines, PRESETS.items()):
        assert line.split()[0] == name and line.endswith(desc)


def test_every_command_has_help_and_is_in_the_readme(run_cli):
    readme = (ROOT / "README.md").read_text()
    for name, cmd in cli.commands.items():
        res = run_cli(name, "--help")
        assert res.exit_code == 0
        assert "Example:" in res.output, name
        assert f"prefill-diff {name}" in readme, f"README lacks an example of {name}"


def _help_sections(text: str) -> dict:
    """--help's sections: heading -> the option names listed under it."""
    sections, current = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"[A-Z][A-Za-z ]+:", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and (m := re.match(r"  (?:-\w, )?(--[\w-]+)", line)):
            current.append(m.group(1))
    return sections


def test_help_groups_the_shared_options_under_headings(run_cli):
    run = _help_sections(run_cli("run", "--help").output)
    assert list(run) == ["Options", "Model and prompts", "Tolerance", "Reports", "Calibration"]
    assert {"--out", "--fail-fast", "--help"} <= set(run["Options"])
    assert run["Model and prompts"][:2] == ["--ignore-memory-estimate", "--model"] and "--tokens" in \
        run["Model and prompts"]
    assert run["Tolerance"] == ["--policy", "--atol", "--rtol", "--ntol", "--row-rtol", "--tolerance"]
    assert {"--json", "--junit", "--quiet", "--verbose", "--strict"} <= set(run["Reports"])
    assert run["Calibration"][:3] == ["--calibrate", "--noise-factor", "--allow-subset"]
    assert list(_help_sections(run_cli("record", "--help").output)) == ["Options", "Model and prompts", "Tolerance"]


def test_record_help_speaks_of_one_trace_not_two_sides(run_cli):
    out = run_cli("record", "--help").output
    assert not re.search(r"\bsides?\b", out), out


def environment_read() -> set:
    """Every environment variable the package's code reads (not those it only sets for libraries)."""
    names = set()
    for pkg in ("cli", "engine", "dumps", "verify"):
        for f in (ROOT / pkg).rglob("*.py"):
            code = f.read_text(encoding="utf-8")
            names |= set(re.findall(r'environ(?:\.get\(|\[)\s*["\']([A-Z][A-Z0-9_]+)["\'](?!\]\s*=[^=])', code))
            names |= set(re.findall(r'^[A-Z_]+ = "([A-Z][A-Z0-9_]+)"$', code, re.M))  # ENV = "PREFILL_DIFF_…"
    return names


TORCHRUN = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # record_this_rank (Python)


def test_top_level_help_lists_every_environment_variable_the_code_reads(run_cli):
    read = environment_read()
    assert {"PREFILL_DIFF_CACHE", "PREFILL_DIFF_DEBUG", "PREFILL_DIFF_NATIVE", "PREFILL_DIFF_MMAP", "COLUMNS",
            "SOURCE_DATE_EPOCH", "XDG_CACHE_HOME"} | TORCHRUN <= read  # the search finds what it must
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in read  # set for a library, never read
    out = run_cli("--help").output
    listed = set(re.findall(r"^    ([A-Z][A-Z0-9_]+) ", out.split("Environment variables:")[1], re.M))
    assert read - TORCHRUN <= listed, sorted(read - TORCHRUN - listed)


WRONG_TYPES = {
    '[model]\nseed = "abc"': "[model] seed must be int",
    "run = 3": "run must be a [run] table",
    "[model]\nrope_scaling = 3": "[model] rope_scaling must be a table",
    "[inputs]\nprompts = 3": "[inputs] prompts must be a list of strings",
    '[inputs]\ntoken_ids = [[1, 2]]\npad_id = "x"': "[inputs] pad_id must be int",
    '[run]\ndeterministic = "yes"': "[run] deterministic must be bool",
    '[model]\nnorm_eps = "x"': "[model] norm_eps must be float",
    "preset = 3": "preset must be a preset name",
    '[run]\nchunk_size = "4"': "[run] chunk_size must be int",
    "[cache]\npage_size = 2.5": "[cache] page_size must be int",
    '[reuse]\nprefix_len = "2"': "[reuse] prefix_len must be int",
    "[fault]\nname = 3": "[fault] name must be str",
    "[model]\nn_layers = 2.0": "[model] n_layers must be int",
    '[model.adapter]\nid = "a"\nrank = "x"': "[model.adapter] rank must be int",
    "[model.adapter]\nrank = 0": "adapter rank must be a positive integer",
    "[model]\nrope_theta = -1.0": "rope_theta must be positive",
    "[model]\nnorm_eps = -1e-5": "norm_eps must be positive",
    "[model]\ntokenizer_vocab_size = 0": "tokenizer_vocab_size must be a positive integer",
    '[run]\ninvariants = "maybe"': "invariants must be 'raise' or 'record'",
    "[inputs]\ntoken_ids = []": "[inputs] token_ids is empty",
}


@pytest.mark.parametrize("body", sorted(WRONG_TYPES))
def test_config_value_of_wrong_type_exits_2_naming_key_and_value(run_cli, tmp_path, body):
    cfg = tmp_path / "c.toml"
    cfg.write_text(body + "\n")
    res = run_cli("record", cfg, "-o", tmp_path / "t.h5")
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert WRONG_TYPES[body] in out and "internal error" not in out and "Traceback" not in out
    assert not (tmp_path / "t.h5").exists()


def test_record_says_the_trace_is_written_before_recording_its_golden_and_twin(run_cli, tmp_path):
    """An unknown --twin-of preset fails after the trace is complete: the trace is kept and the output says so."""
    out = tmp_path / "base.h5"
    res = run_cli("record", "reference", "-o", out, "--twin-of", "no-such-preset")
    assert res.exit_code == 2 and out.exists()
    assert res.output.index(f"wrote {out}") < res.output.index("no-such-preset")


def test_run_refuses_bad_tokens_before_creating_the_out_directory(run_cli, tmp_path):
    res = run_cli("run", "reference", "sdpa", "--tokens", "1,,2", "--out", tmp_path / "traces")
    assert res.exit_code == 2 and "id 1 is empty" in res.output
    assert not (tmp_path / "traces").exists()
