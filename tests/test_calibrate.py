"""A PASS means equivalent: the calibrated verdict for low precision, coverage, and explicit tolerances."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.verify.calibrate import CalibAcc, Calibration, rel_row_errors
from prefill_diff.jobs import CalibPlan, record_calibration, run as run_pair, run_lockstep
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

from conftest import TABLE


def _config(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _bf16(tmp_path, preset, extra=""):
    return _config(tmp_path, f"{preset.replace(':', '_')}-bf16.toml",
                   f'preset = "{preset}"\n{extra}[run]\ndtype = "bfloat16"\n')


# -- check (1) by hand: the rule against a naive loop --------------------------------------------------------

def test_calib_acc_equals_a_naive_loop():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(40, 16))
    t = g + rng.normal(scale=1e-2, size=g.shape)
    c = g + rng.normal(scale=1e-2, size=g.shape)
    c[7] += 0.5  # one row 30-50x the noise
    c[8, 3] = np.nan  # a non-finite candidate row never passes
    acc = CalibAcc(4.0, 2.0 ** -8)
    acc.add(c[:20], t[:20], g[:20], 0, np.arange(20))
    acc.add(c[20:], t[20:], g[20:], 1, np.arange(20))
    res = acc.result()
    e_c = [np.linalg.norm(c[i] - g[i]) / np.linalg.norm(g[i]) for i in range(40)]
    e_t = [np.linalg.norm(t[i] - g[i]) / np.linalg.norm(g[i]) for i in range(40)]
    med = float(np.median(e_t))
    bad = [i for i in range(40) if not e_c[i] <= 4 * max(e_t[i], med) + 2.0 ** -8]
    assert bad == [7, 8] and res.bad_rows == 2 and not res
    assert res.bad_samples == (0,) and res.bad_positions == {0: 7}
    assert res.worst == (0, 8)  # the NaN row is infinitely over
    np.testing.assert_allclose(rel_row_errors(c[:3], g[:3]), e_c[:3])
    clean = CalibAcc(4.0, 2.0 ** -8)
    clean.add(t, t, g, 0, np.arange(40))
    assert clean.result() and clean.result().max_ratio <= 1.0


# -- the built-in model: clean low-precision paths pass, real bugs fail -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("cand", ["bf16", "fp16", "w8", "kv-int8", "batched-left+bf16", "sdpa+fp16",
                                  "chunked+w8", "paged+kv-int8"])
def test_clean_low_precision_paths_pass_calibrated(run_cli, tmp_path, cand):
    if "+" in cand:
        preset, prec = cand.split("+")
        extra = {"bf16": '[run]\ndtype = "bfloat16"\n', "fp16": '[run]\ndtype = "float16"\n',
                 "w8": '[run]\nweight_quant = "int8"\n', "kv-int8": '[cache]\ndtype = "int8"\n'}[prec]
        cand = _config(tmp_path, "c.toml", f'preset = "{preset}"\n{extra}')
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", cand, "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["rule"].startswith("calibrated"), rep["rule"]
    if "+" in str(cand) or cand.endswith(".toml"):  # a real twin was recorded: every tensor carries check (1)
        t = rep["layers"][3]["tensors"]["layer_output"]["calibrated"]
        assert t["passed"] and t["rows"] > 0 and 0 < t["max_ratio"] <= 4
        assert rep["policy"]["calibration"]["golden"] == "float64"
        assert all(lr["numerics"]["passed"] for lr in rep["layers"])


@pytest.mark.slow
def test_bf16_with_a_wrong_rope_theta_fails_at_layer_0_cache_keys(run_cli, tmp_path):
    cand = _config(tmp_path, "c.toml", '[model]\nrope_theta = 12000.0\n[run]\ndtype = "bfloat16"\n')
    out = tmp_path / "r.json"
    # a wrong rope_theta is a model identity difference (a failure by itself); judged as values on purpose:
    res = run_cli("run", "reference", cand, "--json", out, "--allow-identity-difference")
    fb = json.loads(out.read_text())["first_break"]
    assert res.exit_code == 1
    assert (fb["layer"], fb["tensor"], fb["kind"], fb["check"]) == (0, "cache_keys", "value", "change")
    assert fb["noise_ratio"] > 10 and fb["noise_factor"] == 4
    assert "the measured bfloat16 noise (allowed 4x)" in fb["message"] and "would pass with" in fb["message"]
    # the same bug passes today's fixed envelope: that is why the envelope is no longer the default
    assert run_cli("run", "reference", cand, "--no-calibrate", "-q", "--allow-identity-difference").exit_code == 0


@pytest.mark.slow
def test_bf16_vs_bf16_with_one_perturbed_projection_fails(tmp_path):
    ref_prep, cand_prep = prepare_side("bf16"), prepare_side("bf16")
    import copy
    cand_prep.engine = copy.deepcopy(cand_prep.engine)
    with torch.no_grad():
        w = cand_prep.engine.model.layers[1].attention.wo.weight
        w.mul_(1.05)  # 5%: large against bf16's own drift (about 1% a layer), invisible to the envelope
    ref = record_side(ref_prep, tmp_path / "r.h5")
    cand = record_side(cand_prep, tmp_path / "c.h5")
    plan = CalibPlan(True, cand_prec={"dtype": "bfloat16", "weight_quant": "none", "cache_dtype": "bfloat16"},
                     twin_is_ref=True)
    gold, twin = record_calibration(ref_prep.side, plan, str(tmp_path / "golden.h5"), str(tmp_path / "twin.h5"),
                                    snapshot=ref_prep.snapshot)
    assert twin is None  # same precisions: the reference is its own twin
    with Trace(ref) as r, Trace(cand) as c, Trace(gold) as g:
        # the changed weight is an identity difference (its digest after loading): allowed, to judge the values
        envelope = compare_traces(r, c, allow_identity=True)
        rep = compare_traces(r, c, calib=Calibration(g, None, 4.0, 2.0 ** -8, "bfloat16"), allow_identity=True)
    assert envelope  # the fixed bf16 envelope lets it through
    fb = rep.first_break
    assert not rep and (fb.layer, fb.tensor, fb.check) == (1, "attn_update", "change"), rep.verdict_line()
    assert all(lr for lr in rep.layers[:1])  # layer 0 is untouched and passes


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(TABLE))
def test_every_fault_in_bf16_fails_at_the_right_layer(run_cli, tmp_path, fault):
    (stage, layer, kind), _ = TABLE[fault]
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", _bf16(tmp_path, fault), "--json", out)
    rep = json.loads(out.read_text())
    fb = rep["first_break"]
    assert res.exit_code == 1, rep["verdict_line"]
    assert (fb["stage"], fb["layer"], fb["kind"]) == (stage, layer, kind), rep["verdict_line"]
    if kind == "value":
        assert fb["check"] == "change", rep["verdict_line"]


@pytest.mark.slow
def test_explicit_atol_rtol_are_torch_testing_rule_and_fail_bf16(run_cli, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "bf16", "--atol", "1e-5", "--rtol", "1.3e-6", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1, rep["verdict_line"]
    kinds = rep["policy"]["kinds"]
    assert all(k == {"atol": 1e-5, "rtol": 1.3e-6, "ntol": 0.0, "row_rtol": 0.0} for k in kinds.values())
    assert rep["policy"]["sources"]["atol"] == "flag" and rep["policy"]["sources"]["ntol"] == "explicit atol/rtol"
    assert rep["rule"].startswith("declared rule") and "atol 1e-05 (flag)" in rep["rule"]
    res = run_cli("run", "reference", "bf16", "--atol", "1e-5", "--rtol", "1.3e-6")
    assert "atol 1e-05 (flag), rtol 1.3e-06 (flag), ntol off" in " ".join(res.output.split())


def test_calibrate_and_explicit_tolerance_exclude_each_other(run_cli):
    res = run_cli("run", "reference", "bf16", "--calibrate", "--atol", "1")
    assert res.exit_code == 2 and "one or the other" in res.output


@pytest.mark.slow
def test_same_precision_calibrate_uses_the_reference_as_twin(run_cli, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "sdpa", "--calibrate", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["policy"]["calibration"]["twin"] == "the reference itself"
    lo = rep["layers"][3]["tensors"]["layer_output"]["calibrated"]
    assert lo["rows"] == 124 and 0 < lo["median_noise"] < 1e-5  # float32's own noise, measured
    assert "numerics" not in rep["layers"][0]


@pytest.mark.slow
def test_numerics_break_is_check_2(tmp_path):
    """A twin that is itself broken (here: overflowed at layer 2) fails check (2), naming the first tensor."""
    ref_prep = prepare_side("reference")
    cand_prep = prepare_side(_bf16(tmp_path, "batched-left"))
    ref = record_side(ref_prep, tmp_path / "r.h5")
    cand = record_side(cand_prep, tmp_path / "c.h5")
    prec = {"dtype": "bfloat16", "weight_quant": "none", "cache_dtype": "bfloat16"}
    gold, twin = record_calibration(ref_prep.side, CalibPlan(True, cand_prec=prec), str(tmp_path / "golden.h5"),
                                    str(tmp_path / "twin.h5"), snapshot=ref_prep.snapshot)
    with h5py.File(twin, "r+") as f:  # what an fp16 overflow leaves behind
        ds = f["layers/002/mlp_update"]
        ds[0, 3, 5] = np.inf
    with Trace(ref) as r, Trace(cand) as c, Trace(gold) as g, Trace(twin) as t:
        rep = compare_traces(r, c, calib=Calibration(g, t, 4.0, 2.0 ** -8, "bfloat16"))
    fb = rep.first_break
    assert (fb.layer, fb.tensor, fb.check) == (2, "mlp_update", "numerics"), rep.verdict_line()
    assert "numerics themselves break" in fb.message


@pytest.mark.slow
def test_fail_fast_calibrated_agrees_with_the_full_run(tmp_path):
    cand = _bf16(tmp_path, "fault:gqa-mapping")
    fast = run_lockstep("reference", cand).report
    full = run_pair("reference", cand).report
    a, b = fast.first_break, full.first_break
    assert (a.layer, a.tensor, a.check) == (b.layer, b.tensor, b.check) == (0, "attn_update", "change")
    assert fast.stopped_early
    clean = run_lockstep("reference", _bf16(tmp_path, "batched-left")).report
    assert clean and clean.calibration.startswith("calibrated")


# -- baselines: siblings recorded once, or recorded at compare time ------------------------------------------

@pytest.mark.slow
def test_record_twin_of_makes_compare_of_two_files_calibrated(run_cli, tmp_path):
    base, cand, bug = tmp_path / "base.h5", tmp_path / "cand.h5", tmp_path / "bug.h5"
    assert run_cli("record", "reference", "-o", cand).exit_code == 0  # placeholder, replaced below
    assert run_cli("record", _bf16(tmp_path, "batched-left"), "-o", cand, "--force").exit_code == 0
    rope = _config(tmp_path, "rope.toml", '[model]\nrope_theta = 12000.0\n[run]\ndtype = "bfloat16"\n')
    assert run_cli("record", rope, "-o", bug).exit_code == 0
    assert run_cli("record", "reference", "-o", base).exit_code == 0
    out = tmp_path / "r.json"
    allow = "--allow-identity-difference"  # the wrong rope_theta, judged as values
    res = run_cli("compare", base, bug, "--json", out, allow)  # no golden or twin yet: the fixed envelope, said
    rep = json.loads(out.read_text())
    assert res.exit_code == 0 and rep["rule"].startswith(f"uncalibrated (no golden and twin beside {base}: record "
                                                         "it with --twin-of bfloat16 to calibrate): fixed bfloat16 "
                                                         "envelope"), rep["rule"]
    assert "fixed bfloat16 envelope" in " ".join(run_cli("compare", base, bug, allow).output.split())
    res = run_cli("record", "reference", "-o", base, "--force", "--twin-of", "bf16")
    assert res.exit_code == 0 and (tmp_path / "base.golden.h5").exists() and (tmp_path / "base.twin-bfloat16.h5").exists()
    assert run_cli("compare", base, cand, "-q").exit_code == 0
    res = run_cli("compare", base, bug, "--json", out, allow)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1 and rep["first_break"]["check"] == "change" and rep["first_break"]["layer"] == 0
    stats = tmp_path / "bug-stats.h5"  # a lower level has no rows to calibrate: the envelope, and it says so
    assert run_cli("record", rope, "-o", stats, "--level", "stats").exit_code == 0
    run_cli("compare", base, stats, "--json", out, allow)
    assert json.loads(out.read_text())["rule"].startswith("uncalibrated (--level stats keeps no full rows): fixed")
    # a dtype name is a precision too: the same siblings
    res = run_cli("record", "reference", "-o", tmp_path / "b2.h5", "--twin-of", "bfloat16")
    assert res.exit_code == 0 and (tmp_path / "b2.twin-bfloat16.h5").exists()


@pytest.mark.slow
def test_compare_baseline_against_a_preset_records_golden_and_twin(run_cli, tmp_path):
    base = tmp_path / "base.h5"
    assert run_cli("record", "reference", "-o", base).exit_code == 0
    out = tmp_path / "r.json"
    res = run_cli("compare", base, _bf16(tmp_path, "batched-left"), "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0 and rep["rule"].startswith("calibrated"), rep["verdict_line"]
    res = run_cli("compare", base, _bf16(tmp_path, "fault:gqa-mapping"), "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1 and rep["first_break"]["check"] == "change"


# -- coverage ---------------------------------------------------------------------------------------------------

def test_a_reference_sample_without_counterpart_fails_with_coverage(run_cli, tmp_path):
    ref = tmp_path / "r.h5"
    assert run_cli("record", "reference", "--tokens", "1,2,3", "--tokens", "4,5,6,7", "--tokens", "8,9",
                   "-o", ref).exit_code == 0
    cand = tmp_path / "c.h5"  # sample 1 dropped, sample 2 tokenised with an extra leading token 1
    assert run_cli("record", "batched-left", "--tokens", "1,2,3", "--tokens", "1,8,9", "-o", cand).exit_code == 0
    out = tmp_path / "r.json"
    res = run_cli("compare", ref, cand, "--json", out)
    rep = json.loads(out.read_text())
    fb = rep["first_break"]
    assert res.exit_code == 1 and (fb["stage"], fb["kind"]) == ("metadata", "coverage")
    assert fb["samples"] == [1, 2] and rep["verdict"] == "fail"
    assert "candidate sample 1 equals reference sample 2 with one extra leading token 1" in fb["message"]
    assert len(rep["layers"]) == 4 and all(lr["passed"] for lr in rep["layers"])  # matched samples still compared
    assert "FAILED | coverage | 2 of 3 reference samples have no counterpart" in " ".join(res.output.split())
    res = run_cli("compare", ref, cand, "--allow-subset", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0 and any("2 of 3 reference samples skipped (--allow-subset)" in n for n in rep["notes"])


def test_run_refuses_sides_with_different_prompts_before_running(run_cli, tmp_path):
    cand = _config(tmp_path, "c.toml", 'preset = "batched-left"\n[inputs]\ntoken_ids = [[1, 2, 3]]\n')
    res = run_cli("run", "reference", cand, "--out", tmp_path / "o")
    assert res.exit_code == 2 and "prefill different prompts" in res.output and len(res.output.splitlines()) == 1
    assert not list((tmp_path / "o").glob("*.h5"))  # nothing ran, no trace written


@pytest.mark.slow
def test_smollm2_bf16_batch_is_calibrated_and_passes(run_cli, tmp_path):
    """A real model with massive activations: a left-padded bf16 batch is judged against measured bf16 noise."""
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", _bf16(tmp_path, "batched-left"), "--model", "smollm2",
                  "--prompt", "The capital of France is", "--prompt", "Hi there", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["rule"].startswith("calibrated") and len(rep["layers"]) == 30
    ratios = [t["calibrated"]["max_ratio"] for lr in rep["layers"] for t in lr["tensors"].values()
              if "calibrated" in t]
    assert ratios and max(ratios) <= 4


@pytest.mark.slow
def test_preset_names_are_policy_aliases_and_stored_as_dtypes(run_cli, tmp_path):
    base = tmp_path / "b.h5"
    assert run_cli("record", "reference", "-o", base, "--policy", "bf16").exit_code == 0
    out = tmp_path / "r.json"
    res = run_cli("compare", base, "bf16", "--json", out)  # the baseline's declared policy: bfloat16
    rep = json.loads(out.read_text())
    assert res.exit_code == 0 and rep["policy"]["name"] == "bfloat16"
    assert rep["policy"]["sources"]["atol"].endswith("base from baseline trace")
