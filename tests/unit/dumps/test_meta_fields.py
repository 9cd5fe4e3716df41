"""The trace's metadata is declared once (dumps/meta_fields.py FIELDS, and each engine's own record beside that
engine): the reader's checker is built from it, docs/trace-format.md's table of ``meta`` keys lists exactly it,
model.args is ModelArgs' fields, and the recorder refuses an engine's record that breaks its declaration."""
from __future__ import annotations

import importlib
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from prefill_diff.dumps import meta_fields as mf
from prefill_diff.dumps import metacheck
from prefill_diff.dumps import schema as sc
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.dumps.trace_file import RecorderError
from prefill_diff.engine.models.args import ModelArgs
from prefill_diff.engine.registry import ENGINES

ROOT = Path(__file__).resolve().parents[3]
VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")  # the format versions written so far


def sections() -> dict:
    """meta.record key -> (engine, its declared rows), from the registry's record_section entries."""
    out = {}
    for info in ENGINES.values():
        if info.record_section is not None:
            key, module, attribute = info.record_section
            out[key] = (info.name, getattr(importlib.import_module(f"prefill_diff.engine.{module}"), attribute))
    return out


def declared() -> dict:
    """Every declared key the table of docs/trace-format.md lists (the rows nothing lies beneath), without the
    leading ``meta.``: name -> Field."""
    rows = list(mf.FIELDS)
    for key, (engine, rows_of) in sections().items():
        rows += mf.section_fields(key, rows_of, engine)
    return {r.name.removeprefix("meta."): r for r in mf.leaves(rows)}


def doc_table() -> dict:
    """name -> (since, written by, required) from the table of docs/trace-format.md's "`meta` keys" section; a
    key ``.x`` continues the previous key's parent."""
    text = (ROOT / "docs" / "trace-format.md").read_text(encoding="utf-8")
    section = text[text.index("### `meta` keys"):]
    lines = section[section.index("| key | since |"):].splitlines()
    out = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        keys, since, writers, required = (c.strip() for c in line.strip("|").split(" | ")[:4])
        prefix = None
        for name in re.findall(r"`([^`]+)`", keys):
            if name.startswith("."):
                assert prefix is not None, f"{line[:60]}: {name} continues no key"
                name = prefix + name
            prefix = name.rsplit(".", 1)[0] if "." in name else ""
            assert name not in out, f"{name} is listed twice"
            out[name] = (since, writers, required.replace("`", ""))
    return out


def test_the_documented_keys_are_the_declared_keys_both_ways():
    doc, code = doc_table(), declared()
    assert sorted(set(code) - set(doc)) == [], "declared but not in docs/trace-format.md"
    assert sorted(set(doc) - set(code)) == [], "in docs/trace-format.md but not declared"


def test_the_documented_versions_writers_and_requirements_are_the_declared_ones():
    doc, code = doc_table(), declared()
    wrong = [(name, doc[name], (f.since, ", ".join(f.writers), f.required or "MAY"))
             for name, f in code.items() if doc[name] != (f.since, ", ".join(f.writers), f.required or "MAY")]
    assert not wrong, wrong


def test_the_doc_table_parser_reads_continued_keys():
    """The check above reads what the table says: its first row, continued keys included."""
    doc = doc_table()
    assert doc["model.args.vocab_size"] == ("1.0", "all", "MUST")
    assert doc["record.prefill.samples[].steps"][0] == "1.2"
    assert doc["record.vllm.samples[].num_cached_tokens"] == ("1.1", "vllm", "MAY")


def test_every_row_has_a_known_version_and_known_writers():
    rows = list(mf.FIELDS) + [r for key, (e, d) in sections().items() for r in mf.section_fields(key, d, e)]
    engines = set(ENGINES) | {"all"}
    assert not [r.name for r in rows if r.since not in VERSIONS or not set(r.writers) <= engines or not r.meaning]
    assert VERSIONS[-1] == sc.FORMAT_VERSION  # a new version adds its rows' since here
    names = [r.name for r in mf.FIELDS]
    assert len(names) == len(set(names))


def _bad_value(check):
    """A JSON value ``check`` refuses (None when it accepts anything)."""
    for v in ([{}], {"not-a-key\x00": [{}]}, 1.5, "?", -1):
        try:
            check(v, "x")
        except mf.MetaError:
            return v
    return None


def _put(meta: dict, name: str, value) -> None:
    """Set the key ``name`` (items of a list: its first) in ``meta``, making what lies above it."""
    d = meta
    parts = name.split(".")[1:]
    for part in parts[:-1]:
        if part.endswith("[]"):
            d = d.setdefault(part[:-2], [{}])[0]
        else:
            d = d.setdefault(part, {})
            d = d if isinstance(d, dict) else {}
    d[parts[-1]] = value


def test_the_reader_refuses_a_bad_value_in_every_declared_key_naming_it():
    """The checker is the table: each checked key, given a value its check refuses, is named by the reader's
    error; the keys it does not check are the ones the declaration marks ``anything`` (shown, never read)."""
    unchecked = []
    for row in mf.leaves(mf.FIELDS):
        check = row.check if callable(row.check) else None
        bad = None if check is None else _bad_value(check)
        if bad is None:
            unchecked.append(row.name)
            continue
        meta = {"model": {"args": {"dim": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4,
                                   "vocab_size": 16}}}
        if row.name.startswith("meta.record.prefill."):  # the keys an object requires, present
            meta["record"] = {"prefill": {"samples": [dict.fromkeys(("sample", "tokens", "from_cache", "computed",
                                                                     "steps"), 0)]}}
        if row.name.startswith("meta.record.response."):
            meta["record"] = {"response": {"samples": [{"sample": 0, "prompt": 1, "response": 1}]}}
        if row.name.startswith("meta.model.adapter."):
            meta["model"]["adapter"] = {"id": "a"}
        _put(meta, row.name, bad)
        with pytest.raises(mf.MetaError) as e:
            metacheck.check_meta(meta)
        assert e.value.path.replace("[0]", "[]").startswith(row.name), (row.name, str(e.value))
    assert all(row.check is mf.anything for row in mf.leaves(mf.FIELDS) if row.name in unchecked), unchecked
    assert "meta.repro.torch" in unchecked and "meta.model.args.dim" not in unchecked


# -- model.args ---------------------------------------------------------------------------------------------------

def test_model_args_bounds_cover_model_args_fields_exactly():
    names = [f.name for f in fields(ModelArgs)]
    assert sorted(mf.ARG_BOUNDS) == sorted(names), "ARG_BOUNDS must hold one range per ModelArgs field"
    assert list(mf.MODEL_ARGS) == names
    assert set(mf.ARGS_SINCE) <= set(names) and set(mf.REQUIRED_ARGS) <= set(names)
    assert [r.name for r in mf.FIELDS if r.name.startswith("meta.model.args.")] == \
        [f"meta.model.args.{n}" for n in names]


@pytest.mark.parametrize("f", fields(ModelArgs), ids=lambda f: f.name)
def test_each_model_arg_takes_its_default_and_refuses_another_kind(f):
    """A field's kind comes from its type: its default (as a trace stores it) passes, a value of another kind
    does not; a field that may be None takes null."""
    value = ModelArgs().as_dict()[f.name]
    check = mf.MODEL_ARGS[f.name]
    check(value, f.name)
    if "None" in str(f.type):
        check(None, f.name)
    other = {int: "1", float: "1.0", str: 1, bool: 1}.get(type(value), "x")
    with pytest.raises(mf.MetaError):
        check(other if f.name != "rope_scaling" else "x", f.name)


# -- the engines' own records ---------------------------------------------------------------------------------

def test_the_registered_sections_are_the_engines_declarations():
    found = sections()
    assert {key: engine for key, (engine, _) in found.items()} == {"vllm": "vllm", "llama_cpp": "llama.cpp",
                                                                  "transformers": "transformers", "fsdp2": "fsdp2"}
    for key, (engine, rows) in found.items():
        for name, kind, options, since, meaning in rows:
            assert kind in mf.VOCABULARY and since in VERSIONS and meaning, (key, name)
        metacheck.section_check(key, rows, engine)  # it builds


def test_the_section_modules_import_nothing():
    """Plain data: an engine's declaration can be read without its engine's packages (or torch)."""
    for info in ENGINES.values():
        if info.record_section is not None:
            path = ROOT / "engine" / (info.record_section[1].replace(".", "/") + ".py")
            assert not re.search(r"^\s*(import|from)\s", path.read_text(encoding="utf-8"), re.M), path


def test_the_keys_the_reader_reads_of_a_section_check_what_the_engine_declares():
    """A reader reads an engine's record loosely but checks the keys the tools read (declared in FIELDS too):
    they accept and refuse the same values as the engine's own declaration."""
    strict = {r.name: r.check for key, (e, d) in sections().items() for r in mf.section_fields(key, d, e)}
    read = [r for r in mf.leaves(mf.FIELDS) if r.name.startswith(("meta.record.vllm.", "meta.record.llama_cpp."))]
    assert [r.name for r in read] == ["meta.record.vllm.bf16_rounding"]
    probes = [None, "nearest", "truncate", "other", "unknown", "x", 5, True, [], {}]
    for row in read:
        for v in probes:
            verdicts = []
            for check in (row.check, strict[row.name]):
                try:
                    check(v, row.name)
                    verdicts.append("ok")
                except mf.MetaError as e:
                    verdicts.append(str(e))
            assert verdicts[0] == verdicts[1], (row.name, v, verdicts)


def _section_meta(**vllm):
    meta = {"model": {"args": {"dim": 4, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2,
                               "vocab_size": 8}}, "engine": {"dtype": "float32"}}
    meta["record"] = {"vllm": {"version": "0.32.0", "effective": {}, "bf16_rounding": None,
                               "samples": [{"sample": 0, "steps": 1, "num_cached_tokens": 0}], **vllm}}
    return meta


@pytest.mark.parametrize("bad,named", [
    ({"samples": [{"sample": 0, "steps": "1", "num_cached_tokens": 0}]}, "meta.record.vllm.samples[0].steps"),
    ({"attention_backend": 3}, "meta.record.vllm.attention_backend"),
    ({"timing": {"import_s": 1.0, "boot_s": 2.0}}, "meta.record.vllm.timing.boot_s is not a known key"),
    ({"bogus": 1}, "meta.record.vllm.bogus is not a known key"),
])
def test_a_bad_value_in_a_declared_engine_section_is_refused_at_write_time_naming_the_field(bad, named):
    engine, rows = sections()["vllm"]
    rec = Recorder(None, "stats")
    rec.declare_record("vllm", rows, engine)
    try:
        with pytest.raises(RecorderError) as e:
            rec.begin([[1, 2]], 2, _section_meta(**bad))
        assert named in str(e.value) and "the vllm engine's record breaks the declaration" in str(e.value), e.value
    finally:
        rec.abort()
    loose = Recorder(None, "stats")  # undeclared, the section is read loosely: the same metadata is written
    loose.begin([[1, 2]], 2, _section_meta(**bad))
    loose.abort()


def test_an_engine_section_completed_at_the_end_of_the_run_is_checked_at_close(tmp_path):
    engine, rows = sections()["vllm"]
    path = tmp_path / "t.h5"
    rec = Recorder(path, "stats")
    rec.declare_record("vllm", rows, engine)
    rec.begin([[1, 2]], 2, _section_meta())
    rec.inputs(0, 0, np.array([1, 2]), np.ones(2, bool), np.arange(2), np.arange(2))
    for name in sc.REQUIRED_STATES:
        rec.state(0, name, 0, 0, np.ones((2, 4), np.float32))
    rec.cache(0, 0, np.ones((1, 2, 2), np.float32), np.ones((1, 2, 2), np.float32), np.arange(2))
    rec.final(0, np.ones(4, np.float32), np.ones(8, np.float32), 1, 1)
    rec.update_meta(record={"vllm": {**_section_meta()["record"]["vllm"], "isa": ["amx"]}})
    with pytest.raises(RecorderError, match=r"meta\.record\.vllm\.isa must be text or null"):
        rec.close()
    assert not path.exists()


def test_a_read_goes_through_a_declared_name():
    meta = {"layout": None, "model": {"args": {"dim": 8}}, "engine": {"dtype": None}}
    assert mf.value(meta, "meta.model.args.dim") == 8
    assert mf.value(meta, "meta.layout.key_rotation", "post") == "post"  # an object above it null: missing
    assert mf.value(meta, "meta.engine.dtype", "float32") is None  # the key itself null: null
    assert mf.value(meta, "meta.record.prefill", {}) == {}
    with pytest.raises(KeyError, match="meta.layout.rotation is not a declared metadata key"):
        mf.value(meta, "meta.layout.rotation")
