"""engine/config.py's RunConfig: the neutral settings, each engine's own options table, the one read shim for
configs and traces written before the tables, and prepare()'s one refusal of what an engine does not declare."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import h5py
import pytest

from prefill_diff.engine import registry
from prefill_diff.engine.config import RunConfig, load_side, parse_run, run_from_dict
from prefill_diff.engine.native.settings import NativeOptions, cache_config, numerical_config
from prefill_diff.engine.shared.errors import ConfigError

DATA = Path(__file__).resolve().parents[2] / "data"


def test_the_run_config_holds_only_what_every_engine_means_the_same_way():
    neutral = {f.name for f in fields(RunConfig)} - {"name", "engine", "options"}
    assert neutral == {"batching", "dtype", "weight_quant", "cache_dtype", "int8_scales", "chunk_size",
                       "deterministic", "decode", "reuse", "fault", "tp"}
    for info in registry.ENGINES.values():  # no engine's option is a neutral name
        assert not registry.option_names(info) & neutral, info.name


@pytest.mark.parametrize("preset, options", [
    ("sdpa", {"kernel": "sdpa"}), ("tiled", {"kernel": "tiled", "block_size": 4}),
    ("paged", {"cache_kind": "paged", "page_size": 4}), ("rotate-on-read", {"key_rotation": "pre"}),
    ("compiled", {"compile": True})])
def test_our_engines_settings_are_its_own_table(preset, options):
    run = load_side(preset).run
    assert run.options == NativeOptions(**options)
    assert run.as_dict()["native"] == {**{f.name: f.default for f in fields(NativeOptions)}, **options}


def test_our_engine_builds_its_numerics_and_cache_from_the_run_and_its_options():
    run = load_side("kv-int8").run
    assert (run.cache_dtype, run.int8_scales) == ("int8", "per-token")
    cc = cache_config(parse_run({"run": {"chunk_size": 4, "native": {"cache_kind": "paged", "page_size": 3}},
                                 "cache": {"dtype": "int8", "int8_scales": "per-head"}}, "t", "t"))
    assert (cc.chunk_size, cc.invariants, cc.layout.kind, cc.layout.page_size) == (4, "record", "paged", 3)
    assert (cc.layout.dtype, cc.layout.int8_scales) == ("int8", "per-head")
    num = numerical_config(parse_run({"run": {"dtype": "float64", "native": {"kernel": "sdpa"}}}, "t", "t"))
    assert (num.dtype, num.kernel) == ("float64", "sdpa")


# -- the read shim: configs and traces written before the tables ------------------------------------------

@pytest.mark.parametrize("old, new", [
    ({"run": {"kernel": "sdpa"}}, "sdpa"), ({"run": {"native": {"kernel": "sdpa"}}}, "sdpa"),
    ({"cache": {"kind": "paged", "page_size": 4, "key_rotation": "pre"}}, "paged"),
    ({"run": {"compile": True, "invariants": "raise", "training": True, "dropout_seed": 3}}, "reference")])
def test_old_config_keys_of_our_engine_read_into_its_table(old, new):
    run = parse_run(old, "c.toml", "c")
    flat = {**old.get("run", {}), **old.get("run", {}).get("native", {}), **old.get("cache", {})}
    flat.pop("native", None)
    renamed = {"kind": "cache_kind"}
    assert {renamed.get(k, k): getattr(run.options, renamed.get(k, k)) for k in flat} == \
        {renamed.get(k, k): v for k, v in flat.items()}


def test_an_old_key_and_its_table_both_set_is_refused():
    with pytest.raises(ConfigError, match=r"c.toml: \[run\] kernel and \[run.native\] kernel set the same option"):
        parse_run({"run": {"kernel": "sdpa", "native": {"kernel": "tiled"}}}, "c.toml", "c")


def test_our_old_keys_on_another_engine_are_dropped_at_their_default_and_refused_otherwise():
    run = parse_run({"run": {"engine": "transformers", "kernel": "eager"}, "cache": {"kind": "contiguous"}},
                    "c.toml", "c")
    assert run.options == registry.engine("transformers").default_options()
    with pytest.raises(ConfigError, match=r"c.toml: \[run\] kernel is an option of our engine, \[run.native\] "
                                          r"kernel \(engine is 'transformers'\)"):
        parse_run({"run": {"engine": "transformers", "kernel": "sdpa"}}, "c.toml", "c")
    with pytest.raises(ConfigError, match=r"\[cache\] kind is an option of our engine, \[run.native\] cache_kind"):
        parse_run({"run": {"engine": "vllm", "batching": "packed"}, "cache": {"kind": "paged"}}, "c.toml", "c")


def test_an_old_keys_bad_value_is_said_where_it_was_written():
    with pytest.raises(ConfigError, match=r"c.toml: \[cache\] kind must be one of contiguous, paged"):
        parse_run({"cache": {"kind": "page"}}, "c.toml", "c")
    with pytest.raises(ConfigError, match=r"c.toml: \[cache\] page_size must be int"):
        parse_run({"cache": {"page_size": 2.5}}, "c.toml", "c")


@pytest.mark.parametrize("name, preset", [("trace-v1.0.h5", "reference"), ("trace-v1.2.h5", "batched-left")])
def test_committed_old_traces_runs_read_back(name, preset):
    """Format 1.0 and 1.2 recorded the run nested (numerical, cache.layout; 1.0 transformers' option at the top):
    their runs read back as today's."""
    with h5py.File(DATA / name) as f:
        recorded = json.loads(f.attrs["meta"])["side"]["run"]
    assert "numerical" in recorded and "native" not in recorded
    run = run_from_dict(recorded, name)
    assert run.options == NativeOptions() and run.batching == recorded["batching"]
    assert run.dtype == "float32" and run.cache_dtype is None and run.chunk_size == 0


def test_an_old_trace_of_a_paged_int8_run_reads_back_whole():
    old = {"name": "x", "engine": "native", "batching": "left", "tp": 1, "reuse": None, "fault": None,
           "numerical": {"dtype": "bfloat16", "kernel": "tiled", "block_size": 4, "weight_quant": "int8",
                         "deterministic": True, "training": False, "dropout_seed": None, "compile": False},
           "cache": {"chunk_size": 4, "invariants": "record",
                     "layout": {"kind": "paged", "dtype": "int8", "key_rotation": "pre", "page_size": 8,
                                "int8_scales": "per-head", "version": 1}}}
    run = run_from_dict(old, "old")
    assert (run.dtype, run.weight_quant, run.cache_dtype, run.int8_scales, run.chunk_size) == \
        ("bfloat16", "int8", "int8", "per-head", 4)
    assert run.options == NativeOptions(kernel="tiled", block_size=4, cache_kind="paged", page_size=8,
                                        key_rotation="pre")
    assert run_from_dict(run.as_dict(), "new") == run  # and today's form reads back as itself


# -- one refusal for what an engine does not declare -------------------------------------------------------

@pytest.mark.parametrize("engine, conf, says", [
    ("transformers", {"run": {"chunk_size": 4}}, "the transformers engine does not run chunked prefill "
                                                 "(chunk_size=4) (use our engine for chunked prefill)"),
    ("transformers", {"reuse": {"prefix_len": 4}}, "prefix reuse ([reuse]) (use our engine for prefix reuse)"),
    ("transformers", {"run": {"batching": "packed"}}, "the transformers engine does not run batching='packed'"),
    ("llama.cpp", {"cache": {"dtype": "int8"}}, "[cache] dtype='int8' (use [run.llamacpp] type_k / type_v)"),
    ("vllm", {"run": {"weight_quant": "int8", "batching": "left"}},
     "the vllm engine does not run batching='left' (vLLM never pads: \"packed\" submits every prompt to one "
     "engine, \"unbatched\" one at a time); weight_quant='int8' (a quantized checkpoint is vLLM's own business)"),
])
def test_what_an_engine_does_not_declare_is_refused_in_one_place(engine, conf, says, run_cli, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("PREFILL_DIFF_VLLM_PYTHON", str(tmp_path / "never-started"))
    lines = [f'engine = "{engine}"'] + [f"{k} = {json.dumps(v)}" for k, v in conf.get("run", {}).items()]
    body = "[run]\n" + "\n".join(lines) + "\n"
    for section in ("cache", "reuse"):
        if section in conf:
            body += f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in conf[section].items())
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    res = run_cli("run", "reference", cfg)  # refused in prepare(), before any engine converts or loads the model
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_a_family_an_engine_does_not_run_is_refused_with_why():
    run = parse_run({"run": {"engine": "vllm", "batching": "packed"}}, "t", "t")
    from prefill_diff.engine.models.args import MODEL_PRESETS
    said = registry.refusals(run.info, run, MODEL_PRESETS["synthetic:olmo2"], False, False)
    assert said == ["a model of the olmo2 family (vLLM has no OLMo 2 class of its own: it runs it through its "
                    "transformers backend, whose layers the worker does not read)"]
    assert registry.refusals(run.info, run, MODEL_PRESETS["synthetic:qwen3"], False, False) == []


def test_every_engine_runs_its_own_presets_as_declared():
    """No built-in preset asks of its engine what the engine does not declare (else it could never run)."""
    from prefill_diff.engine.presets import PRESETS
    from prefill_diff.engine.models.args import MODEL_PRESETS
    for name in PRESETS:
        run = load_side(name).run
        if run.fault is not None and run.fault.name not in run.info.faults:
            continue
        assert registry.refusals(run.info, run, MODEL_PRESETS["synthetic"], False, False) == [], name
