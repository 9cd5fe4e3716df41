"""prefill_diff.jobs: the jobs as plain functions — where the policy comes from, what is kept, when calibration runs."""
from __future__ import annotations

import os

import pytest

from prefill_diff import jobs
from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.shared.errors import ConfigError

BF16 = {"dtype": "bfloat16", "weight_quant": "none", "cache_dtype": "bfloat16"}
F32 = {"dtype": "float32", "weight_quant": "none", "cache_dtype": "float32"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("jobs")
    paths = {"tight": str(d / "tight.h5"), "plain": str(d / "plain.h5"), "cand": str(d / "cand.h5")}
    jobs.record("reference", paths["tight"], tolerance=jobs.Tolerance(atol=1e-12, rtol=0.0))
    jobs.record("reference", paths["plain"])
    jobs.record("batched-left", paths["cand"])
    return paths


@pytest.mark.slow
def test_the_policy_is_the_flags_else_the_baseline_declaration_else_the_dtype_default(traces):
    """batched-left differs from reference by ~1e-6: a baseline declaring atol 1e-12 must fail it."""
    default = jobs.compare(traces["plain"], traces["cand"]).report
    declared = jobs.compare(traces["tight"], traces["cand"]).report
    flags = jobs.compare(traces["tight"], traces["cand"], judging=jobs.Judging(jobs.Tolerance(atol=1e-3, rtol=0.0))).report
    assert default and flags, (default.verdict_line(), flags.verdict_line())
    assert not declared and declared.first_break.kind == "value", declared.verdict_line()
    assert declared.policy.sources["atol"] == "baseline trace"
    assert flags.policy.sources["atol"] != "baseline trace"
    with Trace(traces["tight"]) as t:
        assert jobs.resolve(None, t, t).sources["atol"] == "baseline trace"


@pytest.mark.slow
def test_a_run_without_out_keeps_no_trace_and_the_report_names_none(tmp_path):
    out = jobs.run("reference", "batched-left")
    assert out.ref_path is None and out.cand_path is None
    assert out.report.ref["file"] is None and out.report.cand["file"] is None
    kept = jobs.run("reference", "batched-left", out_dir=str(tmp_path / "t"))
    assert os.path.isfile(kept.ref_path) and kept.report.cand["file"] == kept.cand_path


@pytest.mark.slow
def test_an_outcome_and_its_report_print_as_their_verdict(traces):
    out = jobs.run("reference", "fault:skip-kv")
    line = out.report.verdict_line()
    assert str(out) == repr(out) == f"Outcome({line}, ref_path=None, cand_path=None)"
    assert str(out.report) == f"Report({line})" and line.startswith("FAILED | layer 2")
    kept = jobs.compare(traces["plain"], traces["cand"])
    assert repr(kept) == (f"Outcome(PASSED | 4/4 layers, logits and cache within tolerance, "
                          f"ref_path={traces['plain']!r}, cand_path={traces['cand']!r})")


@pytest.mark.slow
def test_fail_fast_stops_at_the_first_break_and_says_which_layers_were_not_reached():
    out = jobs.run("reference", "fault:gqa-mapping", judging=jobs.Judging(fail_fast=True))
    assert not out.report and out.report.first_break.layer == 0
    assert out.not_reached == [1, 2, 3]
    assert jobs.run("reference", "batched-left", judging=jobs.Judging(fail_fast=True)).not_reached == []


@pytest.mark.slow
def test_compare_records_a_preset_with_the_baselines_model_and_prompts(traces):
    rep = jobs.compare(traces["plain"], "fault:gqa-mapping").report
    assert not rep and (rep.first_break.layer, rep.first_break.tensor) == (0, "attn_update"), rep.verdict_line()
    assert rep.cand["file"] is None  # recorded into a temporary file, gone now


@pytest.mark.parametrize("kw, use, note", [
    (dict(calibrate=None, explicit=False, level="full"), True, None),
    (dict(calibrate=None, explicit=True, level="full"), False, None),  # a declared tolerance wins
    (dict(calibrate=False, explicit=False, level="full"), False, None),
    (dict(calibrate=None, explicit=False, level="stats"), False, "--level stats keeps no full rows"),
])
def test_calibration_is_on_when_precisions_differ_and_nothing_is_declared(kw, use, note):
    plan = jobs.plan_calibration(F32, BF16, **kw)
    assert (plan.use, plan.note) == (use, note)


def test_same_precisions_calibrate_only_when_asked_and_the_reference_is_its_own_twin():
    assert not jobs.plan_calibration(F32, F32, calibrate=None, explicit=False, level="full").use
    plan = jobs.plan_calibration(F32, F32, calibrate=True, explicit=False, level="full")
    assert plan.use and plan.twin_is_ref


@pytest.mark.parametrize("prec", [BF16, {**F32, "cache_dtype": "float16"}, {**F32, "weight_quant": "int8"},
                                  {**F32, "cache_dtype": "int8", "int8_scales": "per-token"}])
def test_like_with_like_below_float32_is_calibrated_with_the_reference_as_twin(prec):
    """Two runs of the same precision below float32 (bf16 vs bf16): a fixed envelope would let a 30% weight
    change through, so the verdict is calibrated against a float64 golden with the reference as its own twin."""
    plan = jobs.plan_calibration(prec, prec, calibrate=None, explicit=False, level="full")
    assert plan.use and plan.twin_is_ref and plan.maker == "native"
    assert not jobs.plan_calibration(prec, prec, calibrate=None, explicit=True, level="full").use
    assert not jobs.plan_calibration(prec, prec, calibrate=False, explicit=False, level="full").use


def test_golden_and_twin_come_from_our_engine_when_the_reference_engine_cannot_run_them():
    """What each engine can compute is data (engine/registry.py): llama.cpp runs no float64 and no precision on
    request, transformers no int8 weights; our engine runs both."""
    f16 = {"dtype": "float16", "weight_quant": "none", "cache_dtype": "float16"}
    assert jobs.plan_calibration(F32, f16, calibrate=None, explicit=False, level="full",
                                 ref_engine="llama.cpp").maker == "native"
    assert jobs.plan_calibration(f16, f16, calibrate=None, explicit=False, level="full",
                                 ref_engine="llama.cpp", cand_engine="llama.cpp").maker == "native"
    assert jobs.plan_calibration(F32, BF16, calibrate=None, explicit=False, level="full",
                                 ref_engine="transformers").maker == "transformers"
    w8 = {**F32, "weight_quant": "int8"}
    assert jobs.plan_calibration(F32, w8, calibrate=None, explicit=False, level="full",
                                 ref_engine="transformers").maker == "native"


def test_precisions_no_engine_of_ours_runs_keep_the_envelope_and_say_why():
    q4 = {**F32, "weight_quant": "Q4_1"}
    plan = jobs.plan_calibration(F32, q4, calibrate=None, explicit=False, level="full", cand_engine="llama.cpp")
    assert not plan.use
    assert plan.note.startswith("our engine cannot run the candidate's precisions (float32 with Q4_1 weights)")
    assert "quantizes activations to Q8" in plan.note


@pytest.mark.parametrize("kw, says", [
    (dict(calibrate=True, explicit=True, level="full"), "give one or the other"),
    (dict(calibrate=True, explicit=False, level="sampled"), "needs full traces (got --level sampled)"),
    (dict(calibrate=None, explicit=False, level="full", factor=0.0), "--noise-factor must be positive (got 0.0)"),
])
def test_contradictory_calibration_requests_are_refused(kw, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        jobs.plan_calibration(F32, BF16, **kw)


def test_run_refuses_sides_that_prefill_different_prompts_before_either_runs():
    with pytest.raises(ConfigError, match=r"reference sample \[1\] of 2"):
        jobs.check_coverage([(1, 2), (3, 4)], [(1, 2)], allow_subset=False)
    jobs.check_coverage([(1, 2), (3, 4)], [(1, 2)], allow_subset=True)


def test_a_bad_declared_tolerance_is_refused_before_anything_is_recorded(tmp_path):
    with pytest.raises(ConfigError):
        jobs.record("reference", str(tmp_path / "x.h5"), tolerance=jobs.Tolerance(atol=-1.0))
    assert not os.listdir(tmp_path)
