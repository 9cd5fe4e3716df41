"""The trace schema (dumps/schema.py): what the recorder writes is declared there, and the reader holds files
to it."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from prefill_diff.dumps import schema as sc
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.engine.shared import precisions

ARGS = {"dim": 8, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 2, "vocab_size": 16}
SAMPLES = [[3, 4, 5], [6, 7]]  # right-padded into 3 columns
FIXTURE_V10 = Path(__file__).parent / "data" / "trace-v1.0.h5"


def record(path, level: str) -> Path:
    """A small trace from plain numpy tensors, every optional tensor included."""
    rng = np.random.default_rng(0)
    a, C = ARGS, 3
    with Recorder(path, level, sample_tokens=2, sample_channels=3) as rec:
        rec.begin(SAMPLES, C, {"model": {"args": a}, "engine": {"dtype": "float32"}})
        for s, toks in enumerate(SAMPLES):
            n = len(toks)
            rec.inputs(s, 0, np.array(toks), np.ones(n, bool), np.arange(n), np.arange(n))
        for layer in range(a["n_layers"]):
            for s, toks in enumerate(SAMPLES):
                n = len(toks)
                for name in sc.STATES:
                    width = a["n_heads"] * a["head_dim"] if name == "attn_heads" else a["dim"]
                    rec.state(layer, name, s, 0, rng.standard_normal((n, width)).astype(np.float32))
                kv = rng.standard_normal((2, a["n_kv_heads"], n, a["head_dim"])).astype(np.float32)
                rec.cache(layer, s, kv[0], kv[1], np.arange(n))
            rec.layer_done(layer)
        for s, toks in enumerate(SAMPLES):
            rec.final(s, rng.standard_normal(a["dim"]).astype(np.float32),
                      rng.standard_normal(a["vocab_size"]).astype(np.float32), len(toks) - 1, len(toks) - 1)
        top = rec.final_top_ids()
    path.with_suffix(".top").write_text(" ".join(map(str, top)))
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("schema")
    return {lv: record(d / f"{lv}.h5", lv) for lv in sc.LEVELS}


def datasets(f: h5py.File) -> dict:
    out = {}
    f.visititems(lambda name, obj: out.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
    return out


def dims_of(t: Trace, path: str, ds) -> dict:
    """The named dimensions a dataset must have, from the trace's own metadata."""
    a = t.args
    dims = {"S": t.n_samples, "C": t.n_cols, "dim": a["dim"], "vocab": a["vocab_size"], "H": a["n_kv_heads"],
            "D": a["head_dim"], "stat": len(sc.STAT_COLUMNS)}
    el, name = sc.element_of(path)
    if el is sc.STATE:
        dims["W"] = a["n_heads"] * a["head_dim"] if name == "attn_heads" else a["dim"]
    if el is sc.SAMPLED:
        dims["P"] = t.sampled_slots
    return dims


@pytest.mark.parametrize("level", sc.LEVELS)
def test_every_dataset_the_recorder_writes_is_declared_and_matches(traces, level):
    with Trace(traces[level]) as t:
        found = datasets(t.f)
        assert found
        for path, ds in found.items():
            hit = sc.element_of(path)
            assert hit is not None, f"{path} is written but not declared in dumps/schema.py"
            assert hit[0].problem(ds, dims_of(t, path, ds)) is None, (path, hit[0].problem(ds, dims_of(t, path, ds)))
            for attr in hit[0].attrs:
                if attr != sc.ATTR_SOURCE_DTYPE or ds.dtype.kind == "f":
                    assert attr in ds.attrs, f"{path} lacks its declared attribute {attr}"


@pytest.mark.parametrize("level", sc.LEVELS)
def test_every_dataset_carries_its_declared_fill_value(traces, level):
    """A cell never written reads as the element's declared fill (dumps/schema.py): the recorder writes most
    datasets whole, so only the file's own fill value says it."""
    with Trace(traces[level]) as t:
        checked = 0
        for path, ds in datasets(t.f).items():
            el = sc.element_of(path)[0]
            if el.fill is not None:
                want = el.fill
                got = ds.fillvalue
                assert (np.isnan(got) if np.isnan(want) else got == want), (path, got, want)
                checked += 1
        assert checked >= 8


@pytest.mark.parametrize("level", sc.LEVELS)
def test_every_element_required_at_a_level_is_written(traces, level):
    with Trace(traces[level]) as t:
        for el in sc.ELEMENTS:
            if level not in el.levels:
                continue
            names = {sc.STATE: sc.REQUIRED_STATES, sc.SAMPLED: sc.REQUIRED_STATES, sc.STATS: sc.STAT_TENSORS,
                     sc.CHECKSUM: sc.STAT_TENSORS, sc.CACHE: sc.CACHE_TENSORS}.get(el, (None,))
            for layer in range(t.n_layers) if el.in_layer else (None,):
                for name in names:
                    assert el.at(layer, name) in t.f, (level, el.at(layer, name))


def test_the_committed_v10_trace_is_described_by_the_schema():
    with Trace(FIXTURE_V10) as t:
        assert t.version == "1.0"
        for path, ds in datasets(t.f).items():
            hit = sc.element_of(path)
            assert hit is not None and hit[0].problem(ds, dims_of(t, path, ds)) is None, path


def test_element_of_refuses_undeclared_paths():
    assert sc.element_of("layers/000/bogus") is None
    assert sc.element_of("layers/000/stats/bogus") is None
    assert sc.element_of("layers/0/mid") is None  # three digits
    assert sc.element_of("mid") is None  # a state outside a layer group
    assert sc.element_of("final/bogus") is None
    assert sc.element_of("layers/001/cache/keys") == (sc.CACHE, "keys")
    assert sc.element_of("layers/001/stats/cache_values") == (sc.STATS, "cache_values")


def test_problem_names_what_is_wrong(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["ints"] = np.zeros((2, 3), np.int64)
        f["floats"] = np.zeros((2, 3), np.float32)
        el = sc.Element("ints", "iu", ("S", "C"))
        assert el.problem(f["ints"], {"S": 2, "C": 3}) is None
        assert el.problem(f["ints"], {"S": 2}) is None  # an unknown dimension matches any length
        assert el.problem(f["ints"], {"S": 2, "C": 4}) == "has shape (2, 3), expected (2, 4)"
        assert el.problem(f["floats"], {"S": 2, "C": 3}) == "holds float32, not integers"
        assert el.problem(None, {}) == "is missing (or not a dataset)"
        assert el.problem(f, {}) == "is missing (or not a dataset)"  # a group is not a dataset


def test_recorder_gives_back_the_top_ids(traces):
    with Trace(traces["stats"]) as t:
        want = t.final["topk_ids"].ravel().tolist()
    assert traces["stats"].with_suffix(".top").read_text().split() == [str(i) for i in want]
    assert len(want) == len(SAMPLES) * min(10, ARGS["vocab_size"])


def _damaged(src, tmp_path, path, data) -> Path:
    bad = tmp_path / "bad.h5"
    shutil.copy(src, bad)
    with h5py.File(bad, "a") as f:
        attrs = dict(f[path].attrs)
        del f[path]
        f[path] = data
        for k, v in attrs.items():
            f[path].attrs[k] = v
    return bad


@pytest.mark.parametrize("path, data, words", [
    ("final/gather_col", np.zeros(2, np.float64), "/final/gather_col holds float64, not integers"),
    ("final/logits", np.zeros((2, 16), np.int64), "/final/logits holds int64, not floating-point values"),
    ("final/logits", np.zeros((2, 15), np.float32), "/final/logits has shape (2, 15), expected (2, 16)"),
    ("inputs/positions", np.zeros((2, 4), np.int64), "/inputs/positions has shape (2, 4), expected (2, 3)"),
    ("layers/001/stats/mid", np.zeros((2, 8), np.int64), "/layers/001/stats/mid holds int64, not floating-point"),
    ("layers/001/stats/mid", np.zeros((2, 7)), "/layers/001/stats/mid has shape (2, 7), expected (2, 8)"),
    ("layers/000/checksums/mid", np.zeros(3, np.int64), "/layers/000/checksums/mid has shape (3,), expected (2,)"),
    ("layers/000/cache/lengths", np.zeros(2, np.float32), "/layers/000/cache/lengths holds float32, not integers"),
    ("layers/001/mid", np.zeros((2, 3, 8), np.int32), "/layers/001/mid holds int32, not floating-point values"),
    ("layers/001/mid", np.zeros((2, 3, 9), np.float32), "/layers/001/mid has shape (2, 3, 9), expected (2, 3, 8)"),
    ("layers/001/attn_heads", np.zeros((2, 3, 9), np.float32), "/layers/001/attn_heads has shape (2, 3, 9)"),
    ("layers/000/cache/keys", np.zeros((2, 1, 3, 2), np.float32), "/layers/000/cache/keys has shape (2, 1, 3, 2), "
                                                                 "expected (2, 2, 3, 2)"),
])
def test_reader_refuses_an_element_of_the_wrong_dtype_or_shape(traces, tmp_path, path, data, words):
    bad = _damaged(traces["full"], tmp_path, path, data)
    with pytest.raises(TraceError, match=f"^{bad}: " + words.replace("(", r"\(").replace(")", r"\)")):
        Trace(bad)


def test_reader_refuses_a_sampled_element_of_the_wrong_shape(traces, tmp_path):
    bad = _damaged(traces["sampled"], tmp_path, "layers/000/sampled/mid", np.zeros((2, 5, 3), np.float32))
    with pytest.raises(TraceError, match=r"/layers/000/sampled/mid has shape \(2, 5, 3\), expected \(2, 2, \?\)"):
        Trace(bad)


def test_reader_refuses_a_missing_required_element(traces, tmp_path):
    for level, path in (("stats", "layers/001/checksums/layer_output"), ("full", "layers/000/cache/values")):
        bad = tmp_path / f"missing-{level}.h5"
        shutil.copy(traces[level], bad)
        with h5py.File(bad, "a") as f:
            del f[path]
        with pytest.raises(TraceError, match=f"missing required dataset /{path}"):
            Trace(bad)


def test_inputs_and_final_reach_the_file_on_flush_and_close():
    """The recorder keeps the inputs and the final outputs in memory (one write per dataset instead of one per
    sample): ``flush`` writes them for a reader of the file being recorded (run --fail-fast), a later flush
    rewrites them in place, and ``close`` writes them too; nothing is left out."""
    a = ARGS
    rec = Recorder(None, "stats")
    rec.begin(SAMPLES, 3, {"model": {"args": a}, "engine": {"dtype": "float32"}})
    assert "inputs" not in rec.f
    rec.inputs(0, 0, np.array(SAMPLES[0]), np.ones(3, bool), np.arange(3), np.arange(3))
    rec.flush()
    assert rec.f["inputs/input_ids"][0].tolist() == SAMPLES[0] and rec.f["inputs/computed"][1].tolist() == [0, 0, 0]
    assert rec.f["inputs/token_index"][1].tolist() == [-1, -1, -1] and "final" not in rec.f
    rec.inputs(1, 0, np.array(SAMPLES[1]), np.ones(2, bool), np.arange(2) + 5, np.arange(2))
    z = np.arange(a["vocab_size"], dtype=np.float32)
    rec.final(1, np.ones(a["dim"], np.float32), z, 1, 1)
    rec.flush()
    assert rec.f["inputs/positions"][1, :2].tolist() == [5, 6] and rec.f["inputs/valid_mask"][1].tolist() == [1, 1, 0]
    assert rec.f["final/written"][:].tolist() == [0, 1] and rec.f["final/gather_col"][:].tolist() == [-1, 1]
    assert rec.f["final/topk_ids"][1, 0] == a["vocab_size"] - 1
    assert rec.f["final/logits"].attrs["source_dtype"] == b"float32"
    rec.final(0, np.zeros(a["dim"], np.float32), -z, 2, 2)
    assert rec.final_top_ids()[0] == 0 and rec.f["final/written"][0] == 0  # in memory until the next flush
    for s, toks in enumerate(SAMPLES):  # a layer's small datasets too: written by flush, not by layer_done
        x = np.full((len(toks), a["dim"]), s + 1.0, np.float32)
        rec.state(0, "mid", s, 0, x)
        kv = np.zeros((a["n_kv_heads"], len(toks), a["head_dim"]), np.float32)
        rec.cache(0, s, kv, kv, np.arange(len(toks)))
    rec.layer_done(0)
    assert "layers" not in rec.f
    rec.flush()
    assert rec.f["final/written"][:].tolist() == [1, 1]
    assert rec.f["layers/000/stats/mid"][:, 3].tolist() == [1.0, 2.0]  # max
    assert rec.f["layers/000/cache/lengths"][:].tolist() == [3, 2]
    rec.f["inputs/input_ids"][0, 0] = 99  # nothing changed since: a flush (per layer, by a live reader) leaves it
    rec.flush()
    assert rec.f["inputs/input_ids"][0, 0] == 99
    rec.inputs(0, 0, np.array(SAMPLES[0]), np.ones(3, bool), np.arange(3), np.arange(3))
    rec.flush()
    assert rec.f["inputs/input_ids"][0, 0] == SAMPLES[0][0]
    rec.abort()


# -- the vocabulary: declared once (dumps/schema.py; the precisions in the shared leaf engine/shared/precisions.py) --------

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_NAMES = ("STATES", "REQUIRED_STATES", "VALUE_ORDER", "CACHE_TENSORS", "STAT_TENSORS", "ABSENTABLE",
                "FINAL_TENSORS", "TOL_KINDS", "TOL_FIELDS")
PRECISION_NAMES = ("ACT_DTYPES", "CACHE_DTYPES", "FP8_DTYPES", "PRECISION_ORDER")
DECLARED = {  # each list the vocabulary declares or derives, as a set of words
    **{name: frozenset(getattr(sc, name)) for name in SCHEMA_NAMES},
    **{name: frozenset(getattr(precisions, name)) for name in PRECISION_NAMES}}
DECLARED_IN = {"dumps/schema.py", "engine/shared/precisions.py"}
# every name of the vocabulary (the lists, and the tables that key or map by it) and the module declaring it
VOCABULARY = {**{n: "schema" for n in (*SCHEMA_NAMES, "TOL_KIND", "TENSOR", "LAYER_TENSORS", "FINAL_KIND")},
              **{n: "precisions" for n in (*PRECISION_NAMES, "DTYPE_ALIASES")}}


def _literal_lists(path: Path):
    """Every tuple, list or set literal of two or more strings in a module, as the set of its strings."""
    import ast
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            yield node.lineno, frozenset(e.value for e in node.elts)


def test_the_vocabulary_is_declared_once_and_every_consumer_derives_from_it():
    """No module outside the declarations spells out one of the vocabulary's lists (the states, the tolerance
    kinds, the activation or cache precisions, ...) itself: adding a state or a precision is one edit. A
    selection (the tensors a config field reaches first, the dtypes vLLM runs) is knowledge of its own and
    allowed. The scan must find the declarations themselves, or it proves nothing."""
    found, declarations_seen = [], set()
    for d in ("cli", "verify", "dumps", "engine"):
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, words in _literal_lists(path):
                for name, declared in DECLARED.items():
                    if words == declared:
                        (declarations_seen.add(name) if rel in DECLARED_IN
                         else found.append(f"{rel}:{line} spells out schema.{name}: {sorted(words)}"))
    assert {"TOL_KINDS", "TOL_FIELDS", "ACT_DTYPES", "PRECISION_ORDER"} <= declarations_seen, declarations_seen
    assert not found, "\n".join(found)


def _vocabulary_reads(path: Path):
    """(line, statement, whether it reads the declared name) for each import of a name of the vocabulary (or of
    anything from a declaring module under another name) and each module-level rebinding of one: ``from .schema
    import TOL_KINDS`` reads it; ``from .schema import TOL_KINDS as KINDS``, ``KINDS = TOL_KINDS`` and ``from
    .tolerance import TOL_KINDS`` (not the declaring module) do not."""
    import ast
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = (node.module or "").rsplit(".", 1)[-1]
            for a in node.names:
                if a.name in VOCABULARY or (source in ("schema", "precisions") and a.asname):
                    yield node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}" + (
                        f" as {a.asname}" if a.asname else ""), (
                        a.asname in (None, a.name) and source == VOCABULARY.get(a.name))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in VOCABULARY:
            yield node.lineno, f"{', '.join(ast.unparse(t) for t in node.targets)} = {node.value.id}", False


def test_the_consumers_import_the_declared_names():
    """One name per concept: every module (tests included) reads the vocabulary by its declared name, imported
    from the module that declares it, never an alias of it. The scan must see the declared names imported, or it
    proves nothing."""
    found, read = [], 0
    for d in ("cli", "verify", "dumps", "engine", "tests"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for line, what, ok in _vocabulary_reads(path):
                read += ok
                if not ok:
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{line} {what}")
    assert read > 20, read
    assert not found, "\n".join(found)


def test_the_consumers_read_the_declaration():
    from dataclasses import fields
    from prefill_diff.verify.formats.terminal import COLUMNS
    from prefill_diff.dumps import meta_fields, metacheck
    from prefill_diff.engine import config, registry
    from prefill_diff.engine.models import cache_layout
    from prefill_diff.engine.native import settings
    from prefill_diff.verify import breaks, calibrate, comparator, tolerance
    from prefill_diff.verify.formats import plot
    assert comparator.STATES is sc.STATES and comparator.VALUE_ORDER is sc.VALUE_ORDER
    assert tolerance.TOL_KINDS is sc.TOL_KINDS is meta_fields.TOL_KINDS and tolerance.TOL_KIND is sc.TOL_KIND
    assert tuple(f.name for f in fields(tolerance.Tolerance)) == sc.TOL_FIELDS == meta_fields.TOL_FIELDS
    assert tolerance.PRECISION_ORDER is meta_fields.PRECISION_ORDER is precisions.PRECISION_ORDER
    assert set(tolerance.DTYPE_DEFAULTS) == set(precisions.PRECISION_ORDER) == set(precisions.CACHE_DTYPES)
    # tables keyed by the vocabulary cover all of it
    assert set(calibrate.UNIT_ROUNDOFF) == set(precisions.PRECISION_ORDER)
    assert metacheck.ABSENTABLE is sc.ABSENTABLE
    assert (metacheck.ACT_DTYPES is calibrate.ACT_DTYPES is registry.ACT_DTYPES is settings.ACT_DTYPES
            is precisions.ACT_DTYPES)
    assert cache_layout.CACHE_DTYPES is precisions.CACHE_DTYPES
    assert config.ACT_DTYPES is precisions.ACT_DTYPES and config.WEIGHT_QUANTS is settings.WEIGHT_QUANTS \
        is precisions.WEIGHT_QUANTS
    assert precisions.FP8_DTYPES == tuple(d for d in precisions.CACHE_DTYPES if d.startswith("fp8"))
    # a policy's other names: the dtypes' short names (derived from DTYPE_ALIASES), then the int8 presets
    assert list(tolerance.POLICY_ALIASES.items()) == [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"),
                                                      ("fp64", "float64"), ("w8", "int8"), ("kv-int8", "int8")]
    assert all(precisions.DTYPE_ALIASES.get(a, d) == d for a, d in tolerance.POLICY_ALIASES.items())
    assert all(breaks.SUBLAYER[n] == sc.TENSOR[n].sublayer for n in sc.VALUE_ORDER)
    assert [c[0] for c in COLUMNS] == [n for n in sc.VALUE_ORDER if sc.TENSOR[n].header]
    assert dict(plot.SERIES)["mlp_update"] == sc.TENSOR["mlp_update"].words
    # the derived lists are what the format has always named
    assert sc.STATES == ("layer_input", "attn_update", "attn_heads", "mid", "mlp_update", "layer_output")
    assert sc.REQUIRED_STATES == tuple(n for n in sc.STATES if n != "attn_heads")
    assert sc.CACHE_TENSORS == ("keys", "values") and sc.ABSENTABLE == ("attn_update", "mid", "mlp_update")
    assert set(sc.TOL_KIND.values()) == set(sc.TOL_KINDS)  # every kind judges something, every tensor has one

