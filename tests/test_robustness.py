"""Nothing silently wrong: bad requests, broken files (fuzzed), interruptions, determinism, property
tests over random small models, tenant isolation and untrusted input."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.engine.shared.errors import PrefillDiffError
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

ROOT = Path(__file__).resolve().parents[1]


# -- bad requests: each §2.1 precondition, through `record` and `run` ------------------------------

BAD_REQUESTS = {
    "id outside the vocabulary": ('[inputs]\ntoken_ids = [[1, 2, 3], [4, 96, 6]]\n',
                                  r"2\.1\(1\).*sample 1, position 1: id 96, vocab_size=96"),
    "mask with a hole": ('[inputs]\ntoken_ids = [[1, 2, 3], [4, 5, 6]]\nattention_mask = [[1, 1, 1], [1, 0, 1]]\n',
                         r"2\.1\(2\).*sample 1: a padding position 1 lies inside the prompt"),
    "mask value not 0/1": ('[inputs]\ntoken_ids = [[1, 2, 3]]\nattention_mask = [[1, 2, 1]]\n',
                           r"2\.1\(2\).*sample 0, position 1: 2"),
    "position undefined": ('[inputs]\ntoken_ids = [[1, 2, 3], [4, 5, 6]]\npositions = [[0, 1, 2], [0, 1]]\n',
                           r"2\.1\(3\).*sample 1, position 2: no position id"),
    "negative position": ('[inputs]\ntoken_ids = [[1, 2, 3], [4, 5, 6]]\npositions = [[0, 1, 2], [0, -1, 2]]\n',
                          r"2\.1\(3\).*sample 1, position 1: -1"),
    "vocabularies incompatible": ('[model]\ntokenizer_vocab_size = 500\n',
                                  r"2\.1\(4\).*tokenizer size=500, vocab_size=96"),
    "fractional mask value": ('[inputs]\ntoken_ids = [[1, 2, 3]]\nattention_mask = [[1, 1, 0.5]]\n',
                              r"2\.1\(2\).*only 0 and 1.*sample 0, position 2: 0\.5"),
    "dropout in training mode": ('[model]\ndropout = 0.1\n[run]\ntraining = true\n',
                                 r"2\.1\(5\).*dropout=0.1"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_exits_2_before_layer_0_and_writes_nothing(run_cli, tmp_path, case):
    body, pattern = BAD_REQUESTS[case]
    cfg = tmp_path / "bad.toml"
    cfg.write_text('preset = "batched-left"\n' + body)
    out = tmp_path / "t.h5"
    for args in (("record", cfg, "-o", out), ("run", "reference", cfg, "--out", tmp_path / "runs")):
        res = run_cli(*args)
        assert res.exit_code == 2, (case, res.output)
        assert re.search(pattern, res.output), (case, res.output)
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists()
    leftovers = [p for p in tmp_path.rglob("*") if p.suffix == ".h5" or ".partial" in p.name]
    assert not leftovers, leftovers


# -- broken files ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    path = record_side(prepare_side("batched-left"), d / "good.h5", "full")
    return Path(path)


@pytest.fixture(scope="module")
def lower_level_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-levels")
    return {lv: Path(record_side(prepare_side("batched-left"), d / f"{lv}.h5", lv)) for lv in ("sampled", "stats")}


def _exercise(good: Path, bad: Path):
    """Open, inspect and compare a possibly damaged trace; only PrefillDiffError may come out."""
    from prefill_diff.dumps.inspect import summarize
    try:
        with Trace(bad) as t:
            summarize(t)
            with Trace(good) as g:
                compare_traces(g, t)
                compare_traces(t, g)
    except PrefillDiffError:
        pass


@pytest.mark.slow
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_fail_loudly_or_compare_never_crash(small_trace, tmp_path, data):
    _fuzz(small_trace, tmp_path, data)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_sampled_and_stats_traces_fail_loudly_or_compare_never_crash(lower_level_traces, tmp_path, data):
    _fuzz(lower_level_traces[data.draw(st.sampled_from(["sampled", "stats"]))], tmp_path, data)


def _fuzz(small_trace, tmp_path, data):
    raw = bytearray(small_trace.read_bytes())
    mode = data.draw(st.sampled_from(["truncate", "flip", "zero-run"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if mode == "truncate":
        raw = raw[:at]
    elif mode == "flip":
        for k in range(data.draw(st.integers(1, 8))):
            i = (at + k * 97) % len(raw)
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    else:
        n = data.draw(st.integers(1, 4096))
        raw[at:at + n] = bytes(min(n, len(raw) - at))
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(raw))
    _exercise(small_trace, bad)


@pytest.mark.parametrize("damage", ["duplicate", "out of range", "ids disagree", "nothing computed",
                                    "computed with a hole", "valid mask zeroed"])
def test_inconsistent_input_layout_is_refused_by_compare_and_inspect(run_cli, small_trace, tmp_path, damage):
    """Found by the fuzzer in a fresh environment: zeroed /inputs/token_index crashed compare (exit 3)."""
    bad = tmp_path / "bad.h5"
    shutil.copy(small_trace, bad)
    with h5py.File(bad, "a") as f:
        if damage == "duplicate":
            f["inputs/token_index"][0, 1] = f["inputs/token_index"][0, 0]
        elif damage == "out of range":
            f["inputs/token_index"][0, 0] = 40
        elif damage == "ids disagree":
            f["inputs/input_ids"][0, 0] = f["inputs/input_ids"][0, 0] + 1
        elif damage == "nothing computed":  # with every residual garbage: must never pass with 0 values compared
            f["inputs/computed"][...] = 0
            for i in range(4):
                f[f"layers/{i:03d}/layer_output"][...] = 1e6
        elif damage == "computed with a hole":
            f["inputs/computed"][0, 5] = 0
        else:
            f["inputs/valid_mask"][...] = 0
    for args in (("compare", small_trace, bad), ("compare", bad, small_trace), ("inspect", bad)):
        res = run_cli(*args)
        assert res.exit_code == 2, (args, res.output)
        out = " ".join(res.output.split())
        assert any(w in out for w in ("inconsistent", "disagree", "does not compute a suffix")), out
        assert "internal error" not in out


def test_truncations_are_refused_in_one_line(run_cli, small_trace, tmp_path):
    size = small_trace.stat().st_size
    for frac in (0.01, 0.2, 0.5, 0.9, 0.999):
        bad = tmp_path / f"cut{frac}.h5"
        bad.write_bytes(small_trace.read_bytes()[: int(size * frac)])
        res = run_cli("compare", small_trace, bad)
        assert res.exit_code in (1, 2), res.output  # refused, or (data cut only) differences reported
        assert "Traceback" not in res.output and "internal error" not in res.output
        if res.exit_code == 2:
            assert len(res.output.strip().splitlines()) == 1 and str(bad) in res.output


def test_flipped_data_bytes_are_a_break_never_a_pass(small_trace, tmp_path):
    bad = tmp_path / "flip.h5"
    shutil.copy(small_trace, bad)
    with h5py.File(bad, "a") as f:
        off = f["layers/002/mlp_update"].id.get_chunk_info_by_coord((1, 0, 0)).byte_offset  # sample 1's chunk
    raw = bytearray(bad.read_bytes())
    raw[off + 4 * (40 * 128 + 3) + 3] ^= 0x40  # an exponent bit of column 40 (a valid token), channel 3
    bad.write_bytes(bytes(raw))
    with Trace(small_trace) as g, Trace(bad) as t:
        rep = compare_traces(g, t)
    assert not rep and rep.first_break.layer == 2 and rep.first_break.tensor == "mlp_update"


def test_hostile_declared_sizes_are_refused(small_trace, tmp_path):
    bad = tmp_path / "huge.h5"
    shutil.copy(small_trace, bad)
    with h5py.File(bad, "a") as f:
        del f["layers/001/mid"]
        f.create_dataset("layers/001/mid", shape=(3, 12, 1 << 26), dtype="f4")  # declares 3 GiB rows
    with pytest.raises(TraceError, match="the model says width 128|larger than a reader allocates"):
        Trace(bad)
    meta = tmp_path / "meta.h5"
    shutil.copy(small_trace, meta)
    with h5py.File(meta, "a") as f:
        f.attrs["meta"] = "{" + " " * (17 * 1024 * 1024) + "}"
    with pytest.raises(TraceError, match="over the 16777216 limit"):
        Trace(meta)


@pytest.mark.slow
def test_same_architecture_different_weights_stay_comparable(run_cli, tmp_path):
    other = tmp_path / "other.toml"
    other.write_text('preset = "batched-left"\n[model]\nseed = 7\n')
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", other, "--json", out)
    rep = json.loads(out.read_text())
    # another model: an identity failure (exit 1, not 2), and the layers are still compared
    assert res.exit_code == 1 and (rep["first_break"]["stage"], rep["first_break"]["kind"]) == ("metadata", "identity")
    assert rep["reference"]["weights_digest"] != rep["candidate"]["weights_digest"]
    # the source's digest, and the first parameter whose own digest differs (meta.parameters, format 1.4)
    assert [d["key"] for d in rep["identity_differences"]] == ["weights_digest", "parameter"]
    assert len(rep["layers"]) == 4 and rep["layers"][0]["first_break"]["stage"] == "layer"
    res = run_cli("run", "reference", other, "--json", out, "--allow-identity-difference")
    rep = json.loads(out.read_text())
    assert res.exit_code == 1 and rep["first_break"]["stage"] == "layer"
    assert any("MODEL IDENTITY DIFFERS: weights_digest" in n for n in rep["notes"])


@pytest.mark.slow
def test_different_vocabularies_are_a_metadata_break(run_cli, tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    vocab = tmp_path / "v.toml"
    vocab.write_text('[model]\nvocab_size = 128\n')
    assert run_cli("record", "reference", "-o", a).exit_code == 0
    assert run_cli("record", vocab, "-o", b).exit_code == 0
    res = run_cli("compare", a, b, "-q")
    out = " ".join(res.output.split())  # rich wraps long lines
    assert res.exit_code == 2 and "metadata | traces are not comparable" in out and "vocab_size 96 vs 128" in out


# -- interruptions ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_many_times_never_leaves_an_accepted_trace(tmp_path, monkeypatch):
    """The trace-format test kills `record` four times; here ten, at random moments."""
    from test_trace_format import test_killing_record_never_leaves_an_accepted_trace as kill
    monkeypatch.setenv("PREFILL_DIFF_KILLS", "10")
    kill(tmp_path)


# -- determinism -----------------------------------------------------------------------------------

def test_recording_twice_is_bit_identical(tmp_path):
    a = record_side(prepare_side("batched-left"), tmp_path / "a.h5")
    b = record_side(prepare_side("batched-left"), tmp_path / "b.h5")
    with h5py.File(a) as fa, h5py.File(b) as fb:
        names = []
        fa.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) > 50
        for n in names:
            assert np.array_equal(fa[n][()], fb[n][()], equal_nan=True), n
        ma, mb = json.loads(fa.attrs["meta"]), json.loads(fb.attrs["meta"])
        assert ma["repro"]["deterministic_algorithms"] is True
        # provenance (version, command line, time) differs between runs by design (docs/trace-format.md)
        assert ma.pop("provenance")["time"] and mb.pop("provenance")["time"]
        assert ma == mb
    with Trace(a) as ta, Trace(b) as tb:
        rep = compare_traces(ta, tb)
    assert rep and all(t.max_abs == 0 for lr in rep.layers for t in lr.tensors)


# -- property tests over random small models ------------------------------------------------------

def _model_toml(h_kv, rep, head_dim, layers, seed):
    return (f'[model]\nsource = "synthetic"\nseed = {seed}\nn_layers = {layers}\nn_kv_heads = {h_kv}\n'
            f'n_heads = {h_kv * rep}\nhead_dim = {head_dim}\ndim = {h_kv * rep * head_dim}\nhidden_dim = 48\n'
            'vocab_size = 50\n')


def _inputs_toml(lengths, seed):
    rng = np.random.default_rng(seed)
    rows = [[int(t) for t in rng.integers(1, 50, n)] for n in lengths]
    return f'[inputs]\ntoken_ids = {rows}\n'


def _run(tmp_path, ref_body, cand_body):
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.jobs.sides import record
    traces = []
    for i, body in enumerate((ref_body, cand_body)):
        cfg = tmp_path / f"{i}.toml"
        cfg.write_text(body)
        rec = Recorder(None, "full")
        record(prepare_side(str(cfg)), rec)
        traces.append(Trace(rec.f, f"side {i}"))
    return compare_traces(*traces), traces


models = st.tuples(st.integers(1, 2), st.sampled_from([1, 2, 3]), st.sampled_from([4, 8]), st.integers(1, 3),
                   st.integers(0, 5))
lengths = st.lists(st.integers(1, 10), min_size=1, max_size=3)


@pytest.mark.slow
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=models, lens=lengths, batching=st.sampled_from(["left", "right", "packed", "unbatched"]),
       kernel=st.sampled_from(["eager", "sdpa", "tiled"]), chunk=st.integers(0, 4), page=st.integers(1, 5),
       prefix=st.integers(0, 4), paged=st.booleans())
def test_property_non_fault_candidates_agree(tmp_path, model, lens, batching, kernel, chunk, page, prefix, paged):
    ref = _model_toml(*model) + _inputs_toml(lens, model[4])
    cand = (f'[run]\nbatching = "{batching}"\nkernel = "{kernel}"\nblock_size = 3\nchunk_size = {chunk}\n'
            f'[cache]\nkind = "{"paged" if paged else "contiguous"}"\npage_size = {page}\n')
    if prefix:
        cand += f'[reuse]\nprefix_len = {prefix}\n'
    rep, traces = _run(tmp_path, ref, cand + _model_toml(*model) + _inputs_toml(lens, model[4]))
    assert rep, rep.verdict_line()
    rec = traces[1].meta["record"]
    assert rec["invariant_violations"] == []  # every cache invariant holds
    for i in range(traces[1].n_layers):
        assert traces[1].layer(i).cache_lengths.tolist() == list(lens)


FAULTS = ["last-column", "skip-kv", "position-restart", "gqa-mapping", "unmasked-padding", "adapter-mismatch",
          "masked-row-softmax"]


@pytest.mark.slow
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=models, lens=lengths, fault=st.sampled_from(FAULTS))
def test_property_every_fault_is_caught_or_declared_unshowable(tmp_path, model, lens, fault):
    ref = _model_toml(*model) + _inputs_toml(lens, model[4])
    rep, _ = _run(tmp_path, ref, f'preset = "fault:{fault}"\n' + ref)
    assert (not rep) or rep.inconclusive, f"fault:{fault} passed quietly: {rep.verdict_line()}"
    if not rep.inconclusive:
        assert rep.diagnosis and "§2.11" in rep.diagnosis, rep.diagnosis


# -- tenant isolation and untrusted input -----------------------------------------------------------

def test_lookup_by_one_tenant_never_touches_another_tenants_entries():
    import torch
    from prefill_diff.engine.native.kv_cache import PrefixKV
    from prefill_diff.engine.native.reuse import PrefixCache
    kv = PrefixKV([(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), torch.arange(2))], {})
    pc = PrefixCache()
    pc.insert([1, 2], kv, {"w": 1}, "tenant-a")
    seen = []
    original = pc.confirm
    pc.confirm = lambda entry, *a, **k: seen.append(entry.tenant) or original(entry, *a, **k)
    got = pc.lookup([1, 2, 3], 2, {"w": 1}, "tenant-b")
    assert not got.hit and seen == [] and pc.confirmations == 0
    assert "tenant-a" not in got.reason and "tenant" in got.reason  # same answer as for an empty cache
    assert got.reason == PrefixCache().lookup([1, 2, 3], 2, {"w": 1}, "tenant-b").reason
    assert pc.lookup([1, 2, 3], 2, {"w": 1}, "tenant-a").hit and seen == ["tenant-a"]


def test_nothing_loads_pickles():
    sources = [p for d in ("engine", "dumps", "verify", "cli") for p in (ROOT / d).rglob("*.py")]
    assert sources
    for p in sources:
        text = p.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, p
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            assert "weights_only=True" in m.group(1), p


def test_trace_attributes_are_json_not_pickles(small_trace):
    """Attributes are numbers, number arrays or fixed-length UTF-8 text (inline, checksummed), never opaque."""
    with h5py.File(small_trace) as f:
        def check(name, obj):
            for k, v in obj.attrs.items():
                tid = obj.attrs.get_id(k).get_type()
                if isinstance(v, bytes):
                    v.decode("utf-8")
                    assert not tid.is_variable_str(), (name, k)  # no global-heap strings
                else:
                    assert np.asarray(v).dtype.kind in "iuf", (name, k, type(v))
        check("/", f)
        f.visititems(check)
        json.loads(f.attrs["meta"])


@pytest.mark.parametrize("damage", ["meta.tolerance is a list", "meta.layout is a list", "declared n_layers huge",
                                    "logits wider than the vocabulary",
                                    "topk_ids 1-D", "a state of strings", "statistics out of range"])
def test_structurally_inconsistent_traces_exit_2(run_cli, small_trace, tmp_path, damage):
    """Found by hand in review: each of these reached numpy and ended as an internal error (exit 3)."""
    bad = tmp_path / "bad.h5"
    shutil.copy(small_trace, bad)
    with h5py.File(bad, "a") as f:
        meta = json.loads(f.attrs["meta"])
        if damage.startswith("meta.") or damage.startswith("declared"):
            if damage == "meta.tolerance is a list":
                meta["tolerance"] = [1, 2]
            elif damage == "meta.layout is a list":
                meta["layout"] = ["contiguous"]
            else:
                meta["model"]["args"]["n_layers"] = 10 ** 7
            del f.attrs["meta"]
            f.attrs["meta"] = np.bytes_(json.dumps(meta))
        elif damage == "logits wider than the vocabulary":
            del f["final/logits"]
            f["final/logits"] = np.zeros((3, 200), np.float32)
        elif damage == "topk_ids 1-D":
            del f["final/topk_ids"]
            f["final/topk_ids"] = np.zeros(3, np.int64)
        elif damage == "a state of strings":
            shape = f["layers/001/mid"].shape
            del f["layers/001/mid"]
            f["layers/001/mid"] = np.full(shape, b"x", dtype="S1")
        else:
            f["layers/001/stats/mid"][0, 0] = 1e30
    # a full-level compare reads the values, not the (redundant) statistics: there only inspect must refuse
    runs = (("inspect", bad),) if damage == "statistics out of range" else (("compare", small_trace, bad),
                                                                             ("inspect", bad))
    for args in runs:
        res = run_cli(*args)
        out = " ".join(res.output.split())
        assert res.exit_code == 2 and "internal error" not in out and len(out) < 400, (args, out[:400])
