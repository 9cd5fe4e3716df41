"""Hostile input (issue 13): traces from strangers, prompts from chat templates, files that are not files.

Each test here reproduces one way a well-formed but hostile input crashed, hung, or read what it should not,
and checks that it is now refused with exit 2 and one clear line (or handled), never exit 3.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.jobs.sides import prepare_side, record_side

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return Path(record_side(prepare_side("batched-left"), d / "good.h5", "full"))


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile-sampled")
    return Path(record_side(prepare_side("batched-left"), d / "sampled.h5", "sampled"))


def _copy(src: Path, tmp_path: Path, name: str = "bad.h5") -> Path:
    dst = tmp_path / name
    shutil.copy(src, dst)
    return dst


def _one_line(res, code=2):
    out = res.output.strip()
    assert res.exit_code == code, out[-2000:]
    assert "internal error" not in out and "Traceback" not in out, out[-2000:]
    return " ".join(out.split())


# -- HDF5 objects that read outside the file ------------------------------------------------------------

SECRET = np.arange(64 * 12 * 3, dtype="<f4") + 0.25  # recognisable floats


def _replace_with_external(f: h5py.File, path: str, secret: Path):
    shape, dtype = f[path].shape, f[path].dtype
    del f[path]
    f.create_dataset(path, shape=shape, dtype=dtype, external=[(str(secret), 0, h5py.h5f.UNLIMITED)])


@pytest.mark.parametrize("attack", ["external storage", "external link", "soft link", "virtual dataset",
                                    "unknown filter"])
def test_objects_that_read_outside_the_file_are_refused_before_any_data(run_cli, good, tmp_path, attack):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET.tobytes())
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as o:
        o["mid"] = np.ones((3, 12, 64), np.float32)
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        if attack == "external storage":
            _replace_with_external(f, "layers/002/mid", secret)
            want = "layers/002/mid keeps its data in external file"
        elif attack == "external link":
            del f["layers/002/mid"]
            f["layers/002/mid"] = h5py.ExternalLink(str(other), "/mid")
            want = "layers/002/mid is an external link"
        elif attack == "soft link":
            del f["layers/002/mid"]
            f["layers/002/mid"] = h5py.SoftLink("/layers/001/mid")
            want = "layers/002/mid is a soft link"
        elif attack == "virtual dataset":
            del f["layers/002/mid"]
            layout = h5py.VirtualLayout(shape=(3, 12, 64), dtype="f4")
            layout[...] = h5py.VirtualSource(str(other), "mid", shape=(3, 12, 64))
            f.create_virtual_dataset("layers/002/mid", layout)
            want = "layers/002/mid is a virtual dataset"
        else:
            data = f["layers/002/mid"][()]
            del f["layers/002/mid"]
            f.create_dataset("layers/002/mid", data=data, fletcher32=True, chunks=(1, 12, 64))
            want = "layers/002/mid uses HDF5 filter 3"
    if attack == "external storage":  # the attack works on plain h5py: the secret's bytes come back as floats
        with h5py.File(bad, "r") as f:
            assert np.array_equal(f["layers/002/mid"][0, 0, :4], SECRET[:4])
    for args in (("inspect", bad, "--layer", 2, "--tensor", "mid", "--sample", 0, "--json"), ("compare", good, bad),
                 ("compare", bad, good)):
        out = _one_line(run_cli(*args))
        assert want in out and "refused" in out, out
        assert "0.25" not in out and "1.25" not in out  # nothing of the secret is printed


def test_hard_link_cycles_are_walked_once(good, tmp_path):
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        f["layers/000/loop"] = f["layers"]  # a hard link back up: a cycle
    with Trace(bad) as t:  # walked without looping; the extra name is not a state, so the trace still opens
        assert t.n_layers == 4


def test_a_file_with_too_many_objects_is_refused_before_its_walk_ends(good, tmp_path, monkeypatch):
    from prefill_diff.dumps import file_checks
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        g = f.create_group("crowd")
        for i in range(50):
            g.create_group(f"g{i}")
    monkeypatch.setattr(file_checks, "OBJECT_LIMIT", 40)
    with pytest.raises(TraceError, match="more than 40 objects; not a trace this tool wrote"):
        Trace(bad)
    monkeypatch.setattr(file_checks, "OBJECT_LIMIT", 10_000)
    with Trace(bad) as t:  # under the limit, the extra groups are not states: the trace opens
        assert t.n_layers == 4


# -- markup and terminal injection -------------------------------------------------------------------

def _edit_meta(path: Path, edit) -> None:
    with h5py.File(path, "a") as f:
        meta = json.loads(f.attrs["meta"])
        edit(meta)
        del f.attrs["meta"]
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode("utf-8"))


HOSTILE = "[INST] Say hi [/INST] [bold red]x[/] \x1b]0;owned\x07\x1b[2J\u202eevil\r\n"


def test_foreign_text_is_printed_as_plain_text_with_control_characters_visible(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path, "te[bold]xt.h5")

    def edit(m):
        m["texts"] = [HOSTILE] * 3
        m["token_text"] = {str(i): HOSTILE for i in range(96)}
        m["record"]["invariant_violations"] = [HOSTILE]
        m["side"]["origin"] = HOSTILE
        m["model"]["source"] = HOSTILE
    _edit_meta(bad, edit)
    junit = tmp_path / "r.xml"
    for args in (("inspect", bad), ("compare", good, bad, "--junit", junit), ("compare", bad, good)):
        res = run_cli(*args)
        assert res.exit_code in (0, 1), res.output[-2000:]
        assert "\x1b" not in res.output and "\x07" not in res.output and "\u202e" not in res.output
        assert "\\x1b]0;owned\\x07\\x1b[2J\\u202eevil" in res.output.replace("\n", "") or \
            "\\x1b]0;owned" in res.output, res.output[-3000:]
        assert "[bold red]x[/]" in res.output or "[INST]" in res.output  # markup shown, not interpreted
    assert "[INST] Say hi [/INST]" in run_cli("inspect", bad).output
    assert "cache invariant broken" in " ".join(run_cli("compare", good, bad).output.split())
    import xml.etree.ElementTree as ET
    ET.parse(junit)  # control characters would make the XML unreadable


def test_markup_in_an_output_file_name_is_printed_not_parsed(run_cli, tmp_path):
    (tmp_path / "d[").mkdir()
    out = tmp_path / "d[/]x.h5"  # the file "]x.h5" in the directory "d[": the example
    res = run_cli("record", "reference", "-o", out, "--level", "stats")
    text = _one_line(res, 0)
    assert out.exists() and f"wrote {out}" in text


def test_error_messages_show_control_characters_as_escapes(run_cli, tmp_path):
    res = run_cli("inspect", tmp_path / "no\x1b[31mfile.h5")
    assert res.exit_code == 2 and "\x1b" not in res.output and "\\x1b[31m" in res.output


# -- well-formed but wrong metadata ----------------------------------------------------------------------

def _set(meta: dict, path: str, value) -> None:
    keys = path.split(".")
    d = meta
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


META_CASES = {  # the reproduced exit-3 crashes: (field, value, extra edits, field named in the message)
    "texts a number": ("texts", 5, {}, "meta.texts"),
    "texts numbers": ("texts", [1, 2, 3], {}, "meta.texts[0]"),
    "texts too few": ("texts", ["a"], {}, "meta.texts"),
    "adapter a string": ("model.adapter", "lora", {}, "meta.model.adapter"),
    "invariant_violations a number": ("record.invariant_violations", 3, {}, "meta.record.invariant_violations"),
    "fault a string": ("record.fault", "gqa-mapping", {}, "meta.record.fault"),
    "reuse sample out of range": ("record.reuse", [{"sample": 9, "hit": True, "prefix_len": 2}], {},
                                  "meta.record.reuse[0].sample"),
    "rope_inv_freq a string": ("model.rope_inv_freq", "abc", {"layout.key_rotation": "pre"},
                               "meta.model.rope_inv_freq"),
    "rope_inv_freq short": ("model.rope_inv_freq", [1.0], {"layout.key_rotation": "pre"}, "meta.model.rope_inv_freq"),
    "rope_inv_freq missing": ("model.rope_inv_freq", None, {"layout.key_rotation": "pre"}, "meta.model.rope_inv_freq"),
    "key_rotation unknown": ("layout.key_rotation", "sideways", {}, "meta.layout.key_rotation"),
    "args dim a string": ("model.args.dim", "64", {}, "meta.model.args.dim"),
    "args heads not a multiple": ("model.args.n_kv_heads", 3, {}, "meta.model.args.n_heads"),
    "tolerance a number": ("tolerance", 1e-3, {}, "meta.tolerance"),
    "tolerance unknown key": ("tolerance", {"atol": 1e-3, "bogus": 1}, {}, "meta.tolerance.bogus"),
    "tolerance negative": ("tolerance", {"residual": {"atol": -1}}, {}, "meta.tolerance.residual.atol"),
    "token_text numbers": ("token_text", {"5": 5}, {}, "meta.token_text.5"),
    "engine a list": ("engine", ["native"], {}, "meta.engine"),
    "provenance a string": ("provenance", "prefill-diff 0.1.0", {}, "meta.provenance"),
    "provenance argv a list": ("provenance.argv", ["prefill-diff", "run"], {}, "meta.provenance.argv"),
    "provenance time a number": ("provenance.time", 1700000000, {}, "meta.provenance.time"),
    "compile time text": ("record.timing", {"compile_s": "12 s"}, {}, "meta.record.timing.compile_s"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_wrong_metadata_is_refused_naming_the_field(run_cli, good, tmp_path, case):
    field, value, extra, named = META_CASES[case]
    bad = _copy(good, tmp_path)

    def edit(m):
        _set(m, field, value)
        for k, v in extra.items():
            _set(m, k, v)
    _edit_meta(bad, edit)
    for args in (("inspect", bad), ("compare", good, bad), ("compare", bad, good)):
        out = _one_line(run_cli(*args))
        assert named in out and str(bad) in out, (args, out)
        if field == "tolerance":
            assert "tolerance declared in this trace" in out, out


SPEC_CASES = {  # compare BASELINE.h5 PRESET rebuilds the baseline's model from meta.model.spec
    "unknown override": ("model.spec.overrides", {"bogus": 1}, "meta.model.spec.overrides.bogus"),
    "string seed": ("model.spec.seed", "7", "meta.model.spec.seed"),
    "string adapter rank": ("model.spec.adapter", {"id": "a", "rank": "4"}, "meta.model.spec.adapter.rank"),
    "list source": ("model.spec.source", ["synthetic"], "meta.model.spec.source"),
    "dim 1e9": ("model.spec.overrides", {"dim": 1e9}, "meta.model.spec.overrides.dim"),
    "dim 2**63-1": ("model.spec.overrides", {"dim": 2 ** 63 - 1}, "meta.model.spec.overrides.dim"),
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_wrong_model_spec_is_refused_before_recording_a_candidate(run_cli, good, tmp_path, case):
    field, value, named = SPEC_CASES[case]
    bad = _copy(good, tmp_path)
    _edit_meta(bad, lambda m: _set(m, field, value))
    out = _one_line(run_cli("compare", bad, "reference"))
    assert named in out, out


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "out of range", "fractional", "short", "width wrong"])
def test_sampled_channels_attribute_is_checked(run_cli, sampled, tmp_path, damage):
    bad = _copy(sampled, tmp_path)
    with h5py.File(bad, "a") as f:
        ds = f["layers/001/sampled/mid"]
        ch = ds.attrs["channels"]
        if damage == "missing":
            del ds.attrs["channels"]
        elif damage == "out of range":
            ch[-1] = 64
            ds.attrs["channels"] = ch
        elif damage == "fractional":
            ds.attrs["channels"] = ch + 0.5
        elif damage == "short":
            ds.attrs["channels"] = ch[:-1]
        else:
            ds.attrs["width"] = 1 << 40
    for args in (("inspect", bad), ("compare", sampled, bad), ("compare", bad, sampled)):
        out = _one_line(run_cli(*args))
        assert "layer 1 sampled mid: attribute" in out, out


def test_schema_agrees_with_the_code_it_mirrors():
    """The reader cannot import the engine (torch) or verify/: its copies of their names must stay equal."""
    from dataclasses import fields
    from prefill_diff.dumps import meta_fields
    from prefill_diff.engine.models.args import ModelArgs
    from prefill_diff.verify import tolerance
    assert set(meta_fields.MODEL_ARGS) == {f.name for f in fields(ModelArgs)}
    assert set(meta_fields.PRECISION_ORDER) == set(tolerance.DTYPE_DEFAULTS)
    assert meta_fields.TOL_FIELDS == tolerance.TOL_FIELDS and meta_fields.TOL_KINDS == tolerance.TOL_KINDS


# -- property test: every metadata field mutated by type and range ---------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import examples  # noqa: E402

POOL = [None, True, False, 0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63 - 1, 2 ** 63, -(2 ** 63) - 1, 10 ** 30, 0.5, 1.5, -0.0,
        1e308, 1e-300, float("nan"), float("inf"), "", "x", "7", "pre", "float16", "[bold]x[/]", "\x1b[2J", [], [1],
        [1.5], ["a"], [None], [[1, 2]], {}, {"a": 1}, {"sample": 0, "hit": True, "prefix_len": 1}, {"id": "x"}]
DELETE = object()


def _paths(meta, prefix=()):
    """Every key path in the metadata (containers too), lists sampled at their first items."""
    yield prefix
    if isinstance(meta, dict):
        for k, v in meta.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(meta, list):
        for i, v in enumerate(meta[:3]):
            yield from _paths(v, prefix + (i,))


def _mutate(meta, path, value):
    if not path:
        return value if value is not DELETE else {}
    d = meta
    for k in path[:-1]:
        d = d[k]
    if value is DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return meta


def meta_paths(trace: Path) -> list:
    with h5py.File(trace) as f:
        meta = json.loads(f.attrs["meta"])
    paths = [p for p in _paths(meta) if not (p[:1] == ("token_text",) and len(p) > 1 and p[1] not in ("5", "6"))]
    return sorted(set(paths), key=lambda p: tuple(map(str, p)))


def mutated_exit_codes(run_cli, good: Path, bad: Path, path: tuple, value, baseline_run: bool = False) -> list:
    """Write ``good`` with one metadata field mutated to ``bad``; inspect and compare both ways; exit codes."""
    shutil.copy(good, bad)
    with h5py.File(bad, "a") as f:
        meta = _mutate(json.loads(f.attrs["meta"]), path, value)
        del f.attrs["meta"]
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode("utf-8", "surrogatepass"))
    runs = [("inspect", bad), ("compare", good, bad, "-q"), ("compare", bad, good, "--json", bad.with_suffix(".json"))]
    if baseline_run:
        runs.append(("compare", bad, "reference", "-q"))
    codes = []
    for args in runs:
        res = run_cli(*args)
        assert res.exit_code in (0, 1, 2), (path, value, args, res.output[-1500:])
        codes.append(res.exit_code)
    return codes


@pytest.mark.parametrize("path", [("engine",), ("layout",), ("record",), ("side",), ("side", "run")])
def test_a_null_object_in_the_metadata_reads_as_an_absent_one(run_cli, good, tmp_path, path):
    """`"engine": null` is what a JSON writer makes of None: it means absent, never an internal error."""
    assert all(c in (0, 1, 2) for c in mutated_exit_codes(run_cli, good, tmp_path / "bad.h5", path, None))


@pytest.fixture(scope="module")
def good_paths(good):
    return meta_paths(good)


@pytest.mark.slow
@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_mutated_metadata_exits_0_1_or_2_never_3(run_cli, good, good_paths, tmp_path, data):
    path = data.draw(st.sampled_from(good_paths), label="path")
    value = data.draw(st.sampled_from(POOL + [DELETE]) if path else st.sampled_from(POOL), label="value")
    spec = path[:2] == ("model", "spec")
    mutated_exit_codes(run_cli, good, tmp_path / "bad.h5", path, value, baseline_run=spec)


ATTR_POOL = [None, 0, -1, 64, 1 << 40, 1.5, "x", np.array([0.5, 1.5]), np.array([], np.int64),
             np.array([3, 1, 2]), np.array([-1, 0]), np.arange(64), np.arange(33), np.array([[0, 1]])]


@pytest.mark.slow
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_mutated_dataset_attributes_exit_0_1_or_2_never_3(run_cli, sampled, tmp_path, data):
    with h5py.File(sampled) as f:
        targets = []
        f.visititems(lambda n, o: targets.extend((n, k) for k in o.attrs) if o.attrs else None)
    name, key = data.draw(st.sampled_from(sorted(targets)))
    value = data.draw(st.sampled_from(ATTR_POOL + [DELETE]))
    bad = tmp_path / "bad.h5"
    shutil.copy(sampled, bad)
    with h5py.File(bad, "a") as f:
        del f[name].attrs[key]
        if value is not DELETE and value is not None:
            f[name].attrs[key] = value
    for args in (("inspect", bad), ("compare", sampled, bad, "-q"), ("compare", bad, sampled, "-q")):
        res = run_cli(*args)
        assert res.exit_code in (0, 1, 2), (name, key, value, args, res.output[-1500:])


# -- inputs that are not regular files, and sizes that do not fit ---------------------------------------

def _cli(*args, timeout=120):
    """The CLI in a subprocess (a hang is a failure, not a stuck test run)."""
    proc = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_fifos_devices_and_dev_null_are_refused_before_opening(good, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    zero = tmp_path / "cand.toml"
    zero.symlink_to("/dev/zero")
    cases = [(("inspect", fifo), "trace is a FIFO"), (("compare", good, fifo), "is a FIFO"),
             (("compare", fifo, good), "trace is a FIFO"), (("record", fifo, "-o", tmp_path / "t.h5"), "is a FIFO"),
             (("compare", good, good, "--tolerance", fifo), "tolerance file is a FIFO"),
             (("compare", good, zero), "config file is a character device (a link to /dev/zero)"),
             (("compare", good, "/dev/null"), "config file is a character device"),
             (("record", "/dev/null", "-o", tmp_path / "t.h5"), "config file is a character device")]
    for args, want in cases:
        code, out = _cli(*args, timeout=60)
        assert code == 2 and want in out and "internal error" not in out, (args, out)
    assert not (tmp_path / "t.h5").exists()


def test_config_and_tolerance_files_are_capped(run_cli, good, tmp_path):
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid TOML, but no config is that large
    out = _one_line(run_cli("record", big, "-o", tmp_path / "t.h5"))
    assert "over the 1048576-byte limit" in out
    out = _one_line(run_cli("compare", good, good, "--tolerance", big))
    assert "tolerance file" in out and "over the 1048576-byte limit" in out


@pytest.mark.parametrize("body", ["dim = 1000000000", "vocab_size = 1000000000", "hidden_dim = 1000000000",
                                  "dim = 9223372036854775807"])
def test_model_sizes_are_refused_before_allocation(run_cli, tmp_path, body):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f"[model]\n{body}\n")
    out = _one_line(run_cli("record", cfg, "-o", tmp_path / "t.h5"))
    assert "needs about" in out and "available; refused before allocating" in out and "--ignore-memory-estimate" in out


def test_memory_estimate_uses_the_machine_and_can_be_overridden(run_cli, tmp_path, monkeypatch):
    from prefill_diff.engine.models import budget
    cfg = tmp_path / "m.toml"
    cfg.write_text("[model]\nn_layers = 100000\n")  # ran for minutes before: refused at once
    monkeypatch.setattr(budget, "available_bytes", lambda: 8 << 30)
    out = _one_line(run_cli("record", cfg, "-o", tmp_path / "t.h5"))
    assert "14,771,224,704 parameters" in out and "n_layers=100000" in out and "165 GiB" in out
    monkeypatch.setattr(budget, "available_bytes", lambda: 1 << 20)  # 1 MiB: even the default model is too big
    out = _one_line(run_cli("record", "reference", "-o", tmp_path / "t.h5", "--level", "stats"))
    assert "needs about" in out
    _one_line(run_cli("record", "reference", "-o", tmp_path / "t.h5", "--level", "stats", "--ignore-memory-estimate"),
              0)
    assert budget.CHECK["enabled"] is False
    other = tmp_path / "other.toml"
    other.write_text("[model]\nseed = 3\n")  # another model (the last one stays loaded): the next run checks again
    _one_line(run_cli("record", other, "-o", tmp_path / "u.h5", "--level", "stats"))


def test_estimated_parameters_equal_the_model_built():
    from prefill_diff.engine.models import budget
    from prefill_diff.engine.models.args import MODEL_PRESETS
    from prefill_diff.engine.native.model import Transformer
    import torch
    for name, args in MODEL_PRESETS.items():
        for a in (args, args.replace(tie_embeddings=True, qkv_bias=True, lm_head_bias=True),
                  args.replace(o_bias=True, mlp_bias=True, qk_norm="head"),
                  args.replace(qk_norm="proj", norm_placement="post")):
            with torch.device("meta"):
                m = Transformer(a)
            built = sum(p.numel() for p in m.parameters())
            assert budget.param_count(a) == built, (name, a)


@pytest.mark.parametrize("tokens,want", [("1,,2", "id 1 is empty"), (",1", "id 0 is empty"),
                                         ("1,99999999999999999999", "id 1 is 99999999999999999999, outside the 64-bit"),
                                         ("-9223372036854775809", "outside the 64-bit")])
def test_token_lists_that_overflow_or_have_holes_are_refused(run_cli, tmp_path, tokens, want):
    out = _one_line(run_cli("record", "reference", "-o", tmp_path / "t.h5", "--tokens", tokens))
    assert want in out and repr(tokens) in out, out


@pytest.mark.parametrize("key", ["token_ids", "positions"])
def test_config_integers_that_overflow_int64_are_refused(run_cli, tmp_path, key):
    cfg = tmp_path / "c.toml"
    big = 2 ** 64
    cfg.write_text("[inputs]\n" + ("token_ids = [[1, 2, %d]]\n" % big if key == "token_ids" else
                                   "token_ids = [[1, 2, 3]]\npositions = [[0, 1, %d]]\n" % big))
    out = _one_line(run_cli("record", cfg, "-o", tmp_path / "t.h5"))
    assert f"[inputs] {key} sample 0, position 2 is {big}, outside the 64-bit integer range" in out


@pytest.mark.slow
def test_prompt_that_is_not_utf8_is_refused_naming_the_byte_offset(tmp_path):
    """Bytes from the command line (a chat template's output) that are not UTF-8 crashed the tokenizer."""
    proc = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "record", "reference", "--model",
                           "smollm2", "-o", str(tmp_path / "t.h5"), "--prompt", "ok", "--prompt",
                           os.fsdecode(b"Hello \xff\xfe world")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "prompt 1 is not valid UTF-8 text (byte 0xff at byte offset 6)" in proc.stderr
    assert not (tmp_path / "t.h5").exists()


# -- output paths and concurrent writers -----------------------------------------------------------------

def test_output_errors_exit_2_before_any_work(run_cli, good, tmp_path, monkeypatch):
    from prefill_diff import jobs
    from prefill_diff.jobs import sides as recording
    work = []
    monkeypatch.setattr(recording, "prepare_side", lambda *a, **k: work.append(a) or 1 / 0)
    monkeypatch.setattr(jobs, "compare_files", lambda *a, **k: work.append(a) or 1 / 0)
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    cases = [(("run", "reference", "sdpa", "--out", "/proc/x"), "--out /proc/x: cannot create the directory"),
             (("run", "reference", "sdpa", "--out", afile), "is a file"),
             (("run", "reference", "sdpa", "--plot", tmp_path / "plot.txt"), "unsupported format '.txt'"),
             (("run", "reference", "sdpa", "--json", afile / "r.json"), "cannot write --json (the JSON report)"),
             (("run", "reference", "sdpa", "--junit", tmp_path / "no" / "r.xml"), "directory " + str(tmp_path / "no")
              + " does not exist"),
             (("compare", good, good, "--json", tmp_path), "is a directory"),
             (("compare", good, good, "--junit", "/proc/r.xml"), "cannot write --junit (the JUnit report) /proc/r.xml"),
             (("record", "reference", "-o", good), "exists; pass --force"),
             (("record", "reference", "-o", afile / "t.h5"), "is not a directory")]
    for args, want in cases:
        out = _one_line(run_cli(*args))
        assert want in out, (args, out)
    assert work == []  # refused before a model was prepared or a trace compared


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_directory_exits_2_before_any_work(run_cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        out = _one_line(run_cli("run", "reference", "sdpa", "--out", ro))
        assert "is not writable" in out
    finally:
        ro.chmod(0o755)


def test_a_trace_that_appears_meanwhile_is_not_replaced(tmp_path):
    from prefill_diff.dumps.placement import TraceExistsError
    target = tmp_path / "t.h5"

    def other_writer(layer):  # another `record` to the same path finishes while this one runs
        if layer == 1:
            target.write_bytes(b"the other trace")
    with pytest.raises(TraceExistsError, match="appeared while this trace was being recorded"):
        record_side(prepare_side("reference"), target, "stats", progress=other_writer)
    assert target.read_bytes() == b"the other trace"
    assert not list(tmp_path.glob(".t.h5.partial-*"))


@pytest.mark.slow
def test_two_concurrent_records_to_one_path_one_wins_one_says_so(tmp_path):
    target = tmp_path / "t.h5"
    cmd = [sys.executable, "-m", "prefill_diff.cli.main", "record", "reference", "-o", str(target), "--level", "stats"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    loser = next(r for r in results if r[0] == 2)
    assert "appeared while this trace was being recorded" in loser[2] or "exists; pass --force" in loser[2], loser
    assert sum("wrote" in r[1] for r in results) == 1
    Trace(target).close()
    assert not list(tmp_path.glob(".t.h5.partial-*"))


def test_final_move_refuses_to_replace_with_and_without_hard_links(tmp_path, monkeypatch):
    from prefill_diff.dumps import placement
    for no_links in (False, True):
        if no_links:  # a file system without hard links: renameat2(RENAME_NOREPLACE), or a last-moment check
            monkeypatch.setattr(placement.os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no")))
        src, dst = tmp_path / f"src{no_links}", tmp_path / f"dst{no_links}"
        src.write_text("new")
        dst.write_text("old")
        with pytest.raises(placement.TraceExistsError):
            placement.place(src, dst, force=False)
        assert dst.read_text() == "old"
        dst.unlink()
        placement.place(src, dst, force=False)
        assert dst.read_text() == "new" and not src.exists()


# -- signals ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    from test_trace_format import start_big_record
    proc, target = start_big_record(tmp_path)
    assert list(tmp_path.glob(".t.h5.partial-*")), "the recording never started writing"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out, err)  # 128 + SIGTERM, as shells report it
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert not list(tmp_path.glob(".t.h5.partial-*"))
    if target.exists():
        Trace(target).close()
        assert "complete trace kept" in err


def test_interrupt_after_the_final_rename_says_the_trace_was_kept(run_cli, tmp_path, monkeypatch):
    from prefill_diff.dumps.recorder import Recorder
    close = Recorder.close

    def close_then_ctrl_c(self):
        close(self)
        raise KeyboardInterrupt
    monkeypatch.setattr(Recorder, "close", close_then_ctrl_c)
    target = tmp_path / "t.h5"
    res = run_cli("record", "reference", "-o", target, "--level", "stats")
    assert res.exit_code == 130
    text = " ".join(res.output.split())
    assert f"complete trace kept: {target}" in text and "not kept" not in text, text
    Trace(target).close()


# -- also ------------------------------------------------------------------------------------------------

def test_input_positions_are_compared_as_a_break_at_layer_0(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path)
    with Trace(good) as t:
        cols, toks = t.cells(1)
    with h5py.File(bad, "a") as f:
        f["inputs/positions"][1, cols[3]] += 5  # valid cell of sample 1, token 3: everything else agrees
    out_json = tmp_path / "r.json"
    res = run_cli("compare", good, bad, "--json", out_json)
    assert res.exit_code == 1, res.output
    fb = json.loads(out_json.read_text())["first_break"]
    assert (fb["layer"], fb["kind"], fb["sample"], fb["position"]) == (0, "positions", 1, int(toks[3]))
    assert "position id" in fb["message"] and "1 of" in fb["message"]
    with h5py.File(bad, "a") as f:  # padding cells are not compared
        f["inputs/positions"][1, cols[3]] -= 5
        pad = np.flatnonzero(f["inputs/valid_mask"][1] == 0)
        assert pad.size
        f["inputs/positions"][1, pad[0]] += 5
    assert run_cli("compare", good, bad).exit_code == 0


def test_complex_lengths_are_refused_without_a_warning(good, tmp_path):
    import warnings
    bad = _copy(good, tmp_path)
    with h5py.File(bad, "a") as f:
        lengths = f["samples/lengths"][()]
        del f["samples/lengths"]
        f["samples/lengths"] = lengths.astype(np.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceError, match="/samples/lengths holds complex128, not integers"):
            Trace(bad)


@pytest.mark.slow
def test_chat_template_prompt_records_and_inspects_as_plain_text(run_cli, tmp_path):
    """The issue's reproduction: `--prompt "[INST] Say hi [/INST]"` recorded fine, then `inspect` exited 3."""
    out = tmp_path / "chat.h5"
    _one_line(run_cli("record", "reference", "--model", "smollm2", "--prompt", "[INST] Say hi [/INST]", "-o", out,
                      "--level", "stats"), 0)
    res = run_cli("inspect", out)
    assert res.exit_code == 0, res.output[-2000:]
    assert "[INST] Say hi [/INST]" in res.output


def test_an_interrupt_inside_a_gc_callback_is_not_printed_as_a_traceback(monkeypatch):
    """The signal handler raises KeyboardInterrupt wherever Python is; inside a weakref or GC callback Python
    cannot propagate it and prints "Exception ignored ... Traceback" (seen once in CI under SIGTERM). The
    interrupt is recorded and acted on, so that report is dropped; other unraisable errors still reach the hook."""
    import types
    from prefill_diff.cli import main as cli_main
    from prefill_diff.engine.shared.errors import INTERRUPT
    seen = []
    hook = cli_main._unraisable(seen.append)
    monkeypatch.setitem(INTERRUPT, "seen", True)
    hook(types.SimpleNamespace(exc_value=KeyboardInterrupt()))
    assert seen == []
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    hook(other)
    assert seen == [other]
    monkeypatch.setitem(INTERRUPT, "seen", False)  # a KeyboardInterrupt the handler did not raise: reported
    stray = types.SimpleNamespace(exc_value=KeyboardInterrupt())
    hook(stray)
    assert seen == [other, stray]
