"""The verdict: every §2.11 fault localised with its diagnosis, fail-fast agreement, JUnit, plot."""
from __future__ import annotations

import json
import os

import pytest

from prefill_diff.dumps.reader import Trace
from prefill_diff.jobs import run_lockstep
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

from conftest import TABLE


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return record_side(prepare_side("reference"), tmp_path_factory.mktemp("ref") / "ref.h5")


@pytest.mark.parametrize("fault", sorted(TABLE))
def test_fault_localised_with_matching_diagnosis(reference, tmp_path, fault):
    (stage, layer, kind), row = TABLE[fault]
    cand = record_side(prepare_side(fault), tmp_path / "c.h5")
    with Trace(reference) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
    fb = rep.first_break
    assert (fb.stage, fb.layer, fb.kind) == (stage, layer, kind), rep.verdict_line()
    assert f"§2.11 {row}" in rep.diagnosis, rep.diagnosis
    extra = {"fault:gqa-mapping": lambda: fb.tensor == "attn_update" and fb.heads == (0,),
             "fault:unmasked-padding": lambda: fb.tensor == "attn_update" and set(fb.samples) == {1, 2},
             "fault:adapter-mismatch": lambda: fb.tensor == "cache_keys",
             "fault:masked-row-softmax": lambda: fb.padding,
             "fault:last-column": lambda: fb.tensor == "logits" and set(fb.samples) == {1, 2}}
    assert extra.get(fault, lambda: True)()
    assert fb.sublayer == ("final" if stage == "final" else "attention")  # every §2.11 fault is in attention
    assert not rep


@pytest.mark.slow
@pytest.mark.parametrize("cand", ["batched-left", "fault:gqa-mapping", "fault:skip-kv", "fault:last-column",
                                  "fault:masked-row-softmax", "chunked", "transformers"])
def test_fail_fast_and_full_run_agree_on_the_first_break(reference, tmp_path, cand):
    full_path = record_side(prepare_side(cand), tmp_path / "c.h5")
    with Trace(reference) as r, Trace(full_path) as c:
        full = compare_traces(r, c)
    fast = run_lockstep("reference", cand).report
    assert fast.verdict == full.verdict
    if full.first_break is None:
        assert fast.first_break is None and len(fast.layers) == 4 and not fast.stopped_early
    else:
        a, b = fast.first_break, full.first_break
        assert (a.stage, a.layer, a.kind, a.tensor, a.sample, a.position) == \
            (b.stage, b.layer, b.kind, b.tensor, b.sample, b.position)
        assert len(fast.layers) == (b.layer + 1 if b.layer is not None else 4)
        assert fast.stopped_early == (b.layer is not None and b.layer < 3)


@pytest.mark.slow
def test_junit_is_valid_and_carries_the_first_break(run_cli, tmp_path):
    from junitparser import Failure, JUnitXml
    out = tmp_path / "r.xml"
    assert run_cli("run", "reference", "fault:skip-kv", "--junit", out).exit_code == 1
    xml = JUnitXml.fromfile(str(out))
    cases = [c for suite in xml for c in suite]
    names = [c.name for c in cases]
    assert names[:4] == ["layer 000", "layer 001", "layer 002", "layer 003"]
    assert {"final logits", "final norm_last", "final top ids"} <= set(names)
    failed = [c for c in cases if any(isinstance(r, Failure) for r in c.result)]
    assert [c.name for c in failed] == ["layer 002"]
    msg = failed[0].result[0].message
    assert msg.startswith("layer 2 cache length | sample 0 pos 69")
    out2 = tmp_path / "ok.xml"
    assert run_cli("run", "reference", "batched-left", "--junit", out2).exit_code == 0
    assert all(not c.result for suite in JUnitXml.fromfile(str(out2)) for c in suite)


def test_junit_fails_every_final_check_that_fails_not_only_the_first(run_cli, tmp_path):
    """fault:last-column breaks norm_last, the logits and the top ids: three failed final cases."""
    from junitparser import Failure, JUnitXml
    xml_path, json_path = tmp_path / "r.xml", tmp_path / "r.json"
    assert run_cli("run", "reference", "fault:last-column", "--junit", xml_path, "--json", json_path).exit_code == 1
    rep = json.loads(json_path.read_text())
    cases = {c.name: c for suite in JUnitXml.fromfile(str(xml_path)) for c in suite}
    failed = {n for n, c in cases.items() if any(isinstance(r, Failure) for r in c.result)}
    final = rep["final"]
    want = {f"final {n}" for n, t in final["tensors"].items() if not t["passed"]}
    if not final["top_ids_ok"]:
        want.add("final top ids")
    assert {"final norm_last", "final logits", "final top ids"} <= want
    assert {n for n in failed if n.startswith("final")} == want
    # the first final break carries its own line; the later ones cite it
    assert cases["final logits"].result[0].message.startswith("final logits | sample")
    assert cases["final top ids"].result[0].message.startswith(
        "after the first break at final logits: final top ids | sample 1 | rank 1 is id")


def test_plot_is_written(run_cli, tmp_path):
    png = tmp_path / "e.png"
    assert run_cli("run", "reference", "bf16", "--plot", png).exit_code == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_plot_marks_exactly_the_points_that_broke_tolerance(reference, tmp_path):
    """The picture agrees with the verdict: a passing run marks nothing, a fault marks its broken tensors."""
    from prefill_diff.verify.formats.plot import plot_data, plot_errors
    for cand, first in (("bf16", None), ("fault:gqa-mapping", ("attn_update", 0))):
        path = record_side(prepare_side(cand), tmp_path / f"{cand}.h5")
        with Trace(reference) as r, Trace(path) as c:
            rep = compare_traces(r, c)
        data = plot_data(rep)
        assert set(data) == {"attn_update", "mlp_update", "layer_output", "cache_keys", "cache_values"}
        for name, s in data.items():
            want = [lr.layer for lr in rep.layers if not lr.tensor(name)]
            assert s["broken"] == want and s["layers"] == [lr.layer for lr in rep.layers]
        if first is None:
            assert rep and not any(s["broken"] for s in data.values())
        else:
            assert first[1] in data[first[0]]["broken"]
        plot_errors(rep, tmp_path / f"{cand}.png")
        assert (tmp_path / f"{cand}.png").stat().st_size > 5000


@pytest.mark.slow
def test_tolerance_file_and_flags(run_cli, tmp_path):
    pol = tmp_path / "p.toml"
    pol.write_text('base = "float32"\ntopk = 3\n[attn_update]\natol = 5.0\nrtol = 0.0\n[residual]\natol = 20.0\n'
                   '[mlp_update]\natol = 20.0\n[cache_keys]\natol = 20.0\n[cache_values]\natol = 20.0\n'
                   '[logits]\natol = 50.0\n')
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "fault:gqa-mapping", "--tolerance", pol, "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0, rep["verdict_line"]  # a loose enough declared tolerance passes the fault
    # explicit atol/rtol are torch.testing's rule: the ntol and row_rtol terms are off unless given
    assert rep["policy"]["kinds"]["attn_update"] == {"atol": 5.0, "rtol": 0.0, "ntol": 0.0, "row_rtol": 0.0}
    assert rep["policy"]["topk"] == 3
    res = run_cli("run", "reference", "fault:gqa-mapping", "--tolerance", pol, "--atol", "1e-4", "-q")
    assert res.exit_code == 1  # flags win over the file
    # the header names each shown term's source once: a flag over the file's [residual] table, the file's own ntol
    pol2 = tmp_path / "p2.toml"
    pol2.write_text('base = "float32"\n[residual]\natol = 1e-4\nntol = 1e-3\n')
    res = run_cli("run", "reference", "batched-left", "--tolerance", pol2, "--atol", "1e-3", "--json", out)
    rep = json.loads(out.read_text())
    assert rep["policy"]["name"] == "float32+overrides"
    assert rep["policy"]["kinds"]["residual"] == {"atol": 1e-3, "rtol": 1e-5, "ntol": 1e-3, "row_rtol": 0.0}
    assert rep["policy"]["kinds"]["mlp_update"]["ntol"] == 0.0  # no table: the exact rule of the flag's atol
    assert f"atol 0.001 (flag), rtol 1e-05 (float32 default, base from file {pol2}), ntol 0.001 (file {pol2} " \
           "[residual]), row_rtol off (explicit atol/rtol)" in rep["rule"], rep["rule"]
    bad = tmp_path / "bad.toml"
    bad.write_text('[attn]\natol = 1\n')
    res = run_cli("run", "reference", "sdpa", "--tolerance", bad)
    assert res.exit_code == 2 and "unknown table [attn] (tables: [residual], " in res.output


def test_metadata_break_for_different_architectures(run_cli, tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert run_cli("record", "reference", "-o", a).exit_code == 0
    assert run_cli("record", "reference", "--model", "seed-2.8", "-o", b).exit_code == 0
    out = tmp_path / "r.json"
    res = run_cli("compare", a, b, "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 2 and rep["first_break"]["stage"] == "metadata"  # incomparable: bad input
    assert rep["first_break"]["kind"] == "metadata" and "dim 128 vs 8" in rep["first_break"]["message"]


def test_samples_matched_by_token_ids_not_batch_index(run_cli, tmp_path):
    ref, cand = tmp_path / "r.toml", tmp_path / "c.toml"
    ref.write_text('[inputs]\ntoken_ids = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]\n')
    cand.write_text('preset = "batched-left"\n[inputs]\ntoken_ids = [[8, 9], [1, 2, 3], [10, 11]]\n')
    out = tmp_path / "r.json"
    assert run_cli("run", ref, cand).exit_code == 2  # different prompts: refused before running
    res = run_cli("run", ref, cand, "--allow-subset", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["samples"] == [{"reference": 0, "candidate": 1}, {"reference": 2, "candidate": 0}]
    assert any("sample 1 has no counterpart" in n and "--allow-subset" in n for n in rep["notes"])
    assert any("candidate sample 2 has no counterpart" in n for n in rep["notes"])


def test_reports_never_point_at_removed_temporary_traces(run_cli, tmp_path):
    tmp_json, kept_json = tmp_path / "t.json", tmp_path / "k.json"
    res = run_cli("run", "reference", "batched-left", "--json", tmp_json)
    assert res.exit_code == 0 and "not kept" in " ".join(res.output.split())
    rep = json.loads(tmp_json.read_text())
    assert rep["reference"]["file"] is None and rep["candidate"]["file"] is None
    assert run_cli("run", "reference", "batched-left", "--out", tmp_path / "keep", "--json", kept_json).exit_code == 0
    rep = json.loads(kept_json.read_text())
    assert os.path.isfile(rep["reference"]["file"]) and os.path.isfile(rep["candidate"]["file"])


@pytest.mark.parametrize("level", ["sampled", "stats"])
@pytest.mark.parametrize("cand", sorted(TABLE) + ["prefix-reuse", "chunked", "paged", "batched-left", "packed"])
def test_lower_levels_localise_like_full(tmp_path, level, cand):
    """A clean path passes and every fault breaks at the same stage, layer and kind at every level."""
    ref = record_side(prepare_side("reference"), tmp_path / "r.h5", level)
    c = record_side(prepare_side(cand), tmp_path / "c.h5", level)
    with Trace(ref) as a, Trace(c) as b:
        rep = compare_traces(a, b)
    if cand not in TABLE:
        assert rep, f"{level} {cand}: {rep.verdict_line()}"
    else:
        fb = rep.first_break
        assert fb is not None and (fb.stage, fb.layer, fb.kind) == TABLE[cand][0], f"{level}: {rep.verdict_line()}"


def test_gqa_break_names_the_kv_head_the_query_head_reads(reference, tmp_path, run_cli):
    cand = record_side(prepare_side("fault:gqa-mapping"), tmp_path / "c.h5")
    with Trace(reference) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
    fb = rep.first_break
    assert fb.tensor == "attn_update" and fb.heads == (0,) and fb.kv_heads == (0,)  # g(0) = 0·2 // 4
    assert "query heads 0 (reading KV heads 0)" in rep.verdict_line()
    assert rep.as_dict()["first_break"]["kv_heads"] == [0]


def test_cache_break_names_the_kv_heads_that_differ(reference, tmp_path):
    """One KV head's values changed at one slot: the break names that head only, at the right slot."""
    import shutil
    import h5py
    cand = tmp_path / "c.h5"
    shutil.copy(reference, cand)
    with h5py.File(cand, "a") as f:
        ds = f["layers/001/cache/values"]
        v = ds[2]
        v[1, 3] += 1.0  # sample 2, KV head 1, slot 3
        ds[2] = v
    with Trace(reference) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
    fb = rep.first_break
    assert (fb.layer, fb.tensor, fb.sample, fb.position) == (1, "cache_values", 2, 3), rep.verdict_line()
    assert fb.kv_heads == (1,) and fb.heads is None
    assert "KV heads 1" in rep.verdict_line()
    assert rep.layers[1].tensor("cache_values").kv_heads == (1,)
    assert rep.layers[1].tensor("cache_keys").kv_heads == ()


def test_adapter_mismatch_cache_break_names_kv_heads(reference, tmp_path):
    cand = record_side(prepare_side("fault:adapter-mismatch"), tmp_path / "c.h5")
    with Trace(reference) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
    fb = rep.first_break
    assert fb.tensor == "cache_keys" and fb.kv_heads and set(fb.kv_heads) <= {0, 1}, rep.verdict_line()
    assert "KV heads" in rep.verdict_line()


def test_stats_level_break_says_only_what_statistics_measure(tmp_path):
    """It used to say 'would pass with … rtol>=0' and 'largest row error 0 of the row norm': false there."""
    ref = record_side(prepare_side("reference"), tmp_path / "r.h5", "stats")
    c = record_side(prepare_side("fault:gqa-mapping"), tmp_path / "c.h5", "stats")
    with Trace(ref) as a, Trace(c) as b:
        rep = compare_traces(a, b)
    fb = rep.first_break
    assert fb.kind == "value" and fb.layer == 0, rep.verdict_line()
    assert "statistics (min, max, mean, rms per sample) of" in fb.message and "largest statistic error" in fb.message
    assert "would pass with atol>=" in fb.message
    for false_claim in ("rtol>=", "ntol>=", "row_rtol>=", "row norm"):
        assert false_claim not in fb.message, fb.message
    assert fb.max_rel_error is None
    t = rep.layers[0].tensor(fb.tensor)
    assert t.level == "stats" and fb.max_abs_error == t.max_abs > 0


def test_last_column_hint_names_the_column_and_every_affected_sample(tmp_path):
    """It used to name 'token -1' and one sample while the break named another."""
    ref = record_side(prepare_side("batched-right"), tmp_path / "r.h5")
    c = record_side(prepare_side("fault:last-column"), tmp_path / "c.h5")
    with Trace(ref) as a, Trace(c) as b:
        rep = compare_traces(a, b)
        width = b.n_cols
        lengths = [len(s) for s in b.samples]
    fb = rep.first_break
    short = [s for s, n in enumerate(lengths) if n < width]
    assert set(fb.samples) == set(short) == {1, 2}, rep.verdict_line()
    hint = rep.diagnosis
    assert "§2.11 row 1" in hint and "token -1" not in hint
    assert f"samples {', '.join(map(str, short))} were not gathered" in hint, hint
    for s in short:
        assert f"sample {s} from stored column {width - 1} (a padding cell; its last valid token is " \
               f"{lengths[s] - 1})" in hint, hint
    assert f"read from column {width - 1}, the rectangle's last" in hint
