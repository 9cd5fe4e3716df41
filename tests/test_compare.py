"""Comparison: alignment by logical position, check order, first break, injected faults in trace files."""
from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.reader import Trace
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    return {name: record_side(prepare_side(name), d / f"{name}.h5") for name in ("reference", "batched-left")}


def compare(a, b, **kw):
    with Trace(a) as ra, Trace(b) as rb:
        return compare_traces(ra, rb, **kw)


def test_trace_against_itself_is_exact(traces):
    rep = compare(traces["reference"], traces["reference"])
    assert rep and rep.verdict == "pass"
    for lr in rep.layers:
        for t in lr.tensors:
            assert t.max_abs == 0.0 and t.n_bad == 0, (lr.layer, t.tensor)


def test_batched_aligned_with_unbatched_by_logical_position(traces):
    rep = compare(traces["reference"], traces["batched-left"])
    assert rep
    lr = rep.layers[0]
    # every valid token of every sample was compared: 70 + 45 + 9 tokens x 128 channels
    assert lr.tensor("layer_input").compared == 124 * 128
    assert lr.tensor("layer_input").max_abs == 0.0  # embeddings are exact
    assert 0 < lr.tensor("layer_output").max_abs < 1e-4


def edited(src, tmp_path, edit):
    dst = tmp_path / "edited.h5"
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        edit(f)
    return dst


def test_value_break_points_at_layer_tensor_sample_position_channel(traces, tmp_path):
    def bump(f):  # batched-left: sample 1 has 45 tokens in a 70-column rectangle; token 3 is column 28
        f["layers/002/mlp_update"][1, 28, 7] += 0.5
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, bump))
    fb = rep.first_break
    assert (fb.stage, fb.layer, fb.kind, fb.tensor, fb.sample, fb.position, fb.channel) == \
        ("layer", 2, "value", "mlp_update", 1, 3, 7)
    assert fb.max_abs_error == pytest.approx(0.5, abs=1e-3)
    assert all(lr for lr in rep.layers[:2])


def test_nan_is_a_finite_mask_break_before_values(traces, tmp_path):
    def nan(f):
        f["layers/001/layer_output"][0, 3, 0] = np.nan
        f["layers/001/attn_update"][0, 5, 0] += 1.0
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, nan))
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.tensor) == (1, "finite_mask", "layer_output")


def test_nan_in_padding_row_is_reported_as_padding(traces, tmp_path):
    def nan(f):  # column 0 of sample 1 is padding in the left-padded batch
        f["layers/000/mid"][1, 0, 0] = np.nan
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, nan))
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.tensor, fb.padding) == (0, "finite_mask", "mid", True)


def test_cache_positions_checked_exactly(traces, tmp_path):
    def shift(f):
        f["layers/000/cache/positions"][2, 4] = 40
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, shift))
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.sample, fb.position) == (0, "cache_positions", 2, 4)


def test_smallest_passing_tolerance_is_reported(traces, tmp_path):
    def bump(f):
        f["final/logits"][0, 3] += 0.01
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, bump))
    t = rep.final.tensor("logits")
    assert rep.first_break.stage == "final" and rep.first_break.tensor == "logits"
    with Trace(traces["reference"]) as r:
        row = r.final["logits"][0].astype(np.float64)
    ref, rms = abs(row[3]), float(np.sqrt(np.mean(row ** 2)))
    # the rule: |d| <= atol + rtol·|ref| + ntol·rms(ref row); each smallest value holds the other two fixed
    assert t.needed.atol == pytest.approx(0.01 - t.rtol * ref - t.ntol * rms, abs=2e-6)
    assert t.needed.rtol == pytest.approx((0.01 - t.atol - t.ntol * rms) / ref, rel=1e-3)
    assert t.needed.ntol == pytest.approx((0.01 - t.atol - t.rtol * ref) / rms, rel=1e-3)
    assert t.worst_bound == pytest.approx(t.atol + t.rtol * ref + t.ntol * rms, rel=1e-5)


def test_swapped_top_ids_are_a_top_ids_break(traces, tmp_path):
    def swap(f):
        ids = f["final/topk_ids"][0]
        ids[[0, 1]] = ids[[1, 0]]
        f["final/topk_ids"][0] = ids
    rep = compare(traces["reference"], edited(traces["reference"], tmp_path, swap))
    fb = rep.first_break
    assert (fb.stage, fb.kind, fb.sample) == ("final", "top_ids", 0) and not rep.final.top_ids_ok
    assert rep.final.tensor("logits").n_bad == 0  # the logits themselves agree


def test_top1_agreement_alone_is_never_a_pass(traces, tmp_path):
    with Trace(traces["reference"]) as t:
        top = t.final["topk_ids"][0]
        low = int(np.argsort(t.final["logits"][0])[0])  # the least likely id: far from the top ranks
    assert low not in top.tolist()

    def bump(f):
        f["final/logits"][0, low] += 0.5
    rep = compare(traces["reference"], edited(traces["reference"], tmp_path, bump))
    assert rep.final.top_ids_ok and not rep
    assert (rep.first_break.stage, rep.first_break.tensor, rep.first_break.kind) == ("final", "logits", "value")


def test_differing_checksums_alone_are_never_a_failure(tmp_path):
    """At the stats level only statistics and checksums exist: different bits within tolerance still pass."""
    a = record_side(prepare_side("reference"), tmp_path / "a.h5", "stats")
    b = record_side(prepare_side("batched-left"), tmp_path / "b.h5", "stats")
    rep = compare(a, b)
    assert rep  # passes within tolerance ...
    assert any(t.bit_identical is False for lr in rep.layers for t in lr.tensors)  # ... though bits differ


def test_cache_break_comes_before_a_value_break_at_the_same_layer(traces, tmp_path):
    def both(f):  # a value far out of tolerance and a cache position, both at layer 0
        f["layers/000/mlp_update"][0, 3, 0] += 5.0
        f["layers/000/cache/positions"][2, 4] = 40
    rep = compare(traces["reference"], edited(traces["batched-left"], tmp_path, both))
    assert (rep.first_break.layer, rep.first_break.kind) == (0, "cache_positions")
    assert not rep.layers[0].tensor("mlp_update")  # the value break is there, ranked after the cache's


def test_the_report_names_the_files_it_is_given(traces):
    with Trace(traces["reference"]) as ra, Trace(traces["batched-left"]) as rb:
        own = compare_traces(ra, rb)
        given = compare_traces(ra, rb, files=(None, "cand (recorded now)"))
    assert own.ref["file"] == str(traces["reference"]) and own.cand["file"] == str(traces["batched-left"])
    assert given.ref["file"] is None and given.cand["file"] == "cand (recorded now)"
    d = given.as_dict()
    assert d["reference"]["file"] is None and d["candidate"]["file"] == "cand (recorded now)"


def test_the_comparator_takes_a_resolved_policy_and_none_means_the_default(traces):
    from prefill_diff.verify.comparator import Comparator
    from prefill_diff.verify.policy_file import default_policy_for
    with Trace(traces["reference"]) as ra, Trace(traces["batched-left"]) as rb:
        with pytest.raises(TypeError, match="needs a resolved Policy"):
            Comparator(ra, rb, None)
        rep = compare_traces(ra, rb)
        assert rep.policy == default_policy_for(ra.meta, rb.meta)
        assert rep.policy.sources["atol"] == "float32 default"


def test_the_default_policy_is_the_baselines_declared_tolerance():
    from prefill_diff.verify.policy_file import default_policy_for
    meta = {"engine": {"dtype": "float32"}}
    declared = default_policy_for({**meta, "tolerance": {"base": "bfloat16", "atol": 0.5}}, meta)
    assert declared.kinds["residual"].atol == 0.5 and declared.sources["atol"] == "baseline trace"
    assert default_policy_for(meta, {"engine": {"dtype": "bfloat16"}}).name == "bfloat16"
