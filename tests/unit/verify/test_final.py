"""verify/final.py: the final logits and norm at each sample's last token within tolerance, then the top ids,
judged on the reference's logits (near-ties within tolerance are no failure)."""
from __future__ import annotations

import numpy as np
import pytest

from prefill_diff.verify import wording
from prefill_diff.verify.calibrate import Calibration
from prefill_diff.verify.final import FinalCheck, Gathered, compare_final

from ._traces import TOL, context, make_spec, policy, record

TOPK = 5


def _final(ref_spec, cand_spec, edit=None, **kw):
    ref, cand = record(ref_spec, name="ref"), record(cand_spec, name="cand", edit=edit)
    return compare_final(context(ref, cand, policy(topk=TOPK)), **kw)


def _top(logits, k=TOPK):
    """Ids by descending logit (ties by lower id), k of them."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:k]


def test_identical_final_outputs_pass_in_other_columns():
    spec = make_spec(pad=[0, 2, 1])
    res = _final(spec, spec.relayout([3, 0, 1]))
    assert res and res.first_break is None and res.top_ids_ok and res.top_detail is None
    assert [e.max_abs for e in res.sample_max_abs] == [0.0, 0.0, 0.0]
    assert [(t.sample, t.reference, t.candidate) for t in res.top] == \
        [(s, _top(f[1]), _top(f[1])) for s, f in enumerate(spec.finals)]
    assert res.gather == tuple(Gathered(s, len(x) - 1, len(x) - 1, len(x) - 1) for s, x in enumerate(spec.samples))
    assert res.breaks == (FinalCheck("logits", None), FinalCheck("norm_last", None), FinalCheck("top ids", None))
    assert res.tensor("logits").compared == 3 * 16 and res.tensor("norm_last").compared == 3 * 8


def test_a_changed_logit_is_a_value_break_at_the_samples_last_token():
    ref = make_spec()
    cand = ref.copy()
    low = int(np.argmin(cand.finals[1][1]))  # the least likely id: the top ids stay as they are
    cand.finals[1][1][low] += 0.5
    res = _final(ref, cand)
    fb = res.first_break
    assert (fb.stage, fb.kind, fb.tensor, fb.sample, fb.position, fb.channel) == \
        ("final", "value", "logits", 1, len(ref.samples[1]) - 1, low)
    assert res.top_ids_ok and res.tensor("norm_last") and not res.tensor("logits")
    want = [float(np.abs(c[1].astype(np.float64) - r[1]).max()) for r, c in zip(ref.finals, cand.finals)]
    assert [e.max_abs for e in res.sample_max_abs] == pytest.approx(want) and want[1] == pytest.approx(0.5)
    assert dict(res.breaks)["logits"].kind == "value" and dict(res.breaks)["top ids"] is None


def test_top_ids_swapped_within_tolerance_are_no_failure():
    """Ids 3 and 9 tie within the logits' tolerance in the reference; the candidate ranks them the other way."""
    ref = make_spec()
    z = ref.finals[0][1]
    z[:] = np.arange(16, dtype=np.float32) * 0.1
    z[3], z[9] = 5.0, np.float32(5.0 - 1e-4)
    cand = ref.copy()
    cand.finals[0][1][3], cand.finals[0][1][9] = np.float32(5.0 - 1e-4), 5.0
    res = _final(ref, cand)
    top = res.top[0]
    assert top.reference[:2] == [3, 9] and top.candidate[:2] == [9, 3]
    assert res and res.top_ids_ok


def test_top_ids_beyond_tolerance_are_a_break_judged_on_the_reference_logits():
    """The candidate's recorded top ids put the reference's second id first: its reference logit is below the
    first's by more than atol + rtol·|first|."""
    ref = make_spec()
    swapped = {}

    def swap(f):
        for s in (0, 2):
            ids = f["final/topk_ids"][s]
            ids[[0, 1]] = ids[[1, 0]]
            f["final/topk_ids"][s] = ids
            swapped[s] = ids[:2].tolist()
    res = _final(ref, ref.copy(), edit=swap)
    assert not res.top_ids_ok and res.tensor("logits")  # the logits themselves agree
    z = ref.finals[0][1].astype(np.float64)
    first, second = _top(ref.finals[0][1])[:2]
    assert swapped[0] == [second, first]
    assert z[first] - z[second] > TOL.atol + TOL.rtol * abs(z[first])
    fb = res.first_break
    assert (fb.kind, fb.tensor, fb.sample, fb.samples) == ("top_ids", "topk_ids", 0, (0, 2))
    assert fb.message == res.top_detail == wording.top_ids_differ(0, 0, second, first, z[second], z[first])


def _nan_and_change():
    """Candidate logits with a value changed in sample 0 and a NaN in sample 2."""
    ref = make_spec()
    cand = ref.copy()
    cand.finals[0][1][int(np.argmin(cand.finals[0][1]))] += 1.0
    cand.finals[2][1][int(np.argmin(cand.finals[2][1]))] = np.nan
    return ref, cand


def test_non_finite_logits_break_before_values():
    ref, cand = _nan_and_change()
    res = _final(ref, cand)
    assert (res.first_break.kind, res.first_break.tensor) == ("finite_mask", "logits")
    assert res.tensor("logits").finite.ref_only == 1 and res.tensor("logits").n_bad == 1
    only_nan = ref.copy()
    only_nan.finals[2][1][int(np.argmin(only_nan.finals[2][1]))] = np.nan
    fb = _final(ref, only_nan).first_break
    assert (fb.kind, fb.sample, fb.samples) == ("finite_mask", 2, (2,))


def test_a_finite_mask_break_names_the_sample_with_the_non_finite_value():
    """Sample 0 has only a finite value out of tolerance; the NaN is in sample 2: the finite-mask break (the
    first) must point at sample 2, not at sample 0's value difference."""
    ref, cand = _nan_and_change()
    fb = _final(ref, cand).first_break
    assert fb.kind == "finite_mask" and (fb.sample, fb.samples) == (2, (2,))


def test_a_different_model_width_is_a_shape_break():
    res = _final(make_spec(), make_spec(dim=12))
    fb = res.first_break
    assert (fb.kind, fb.tensor, fb.message) == ("shape", "norm_last", "norm_last width 8 vs 12")


def test_each_side_says_where_it_gathered():
    """A candidate that gathered sample 1 at token 1 (not its last, 2): recorded as given."""
    ref = make_spec()
    cand = ref.copy()
    cand.finals[1][3] = 1
    res = _final(ref, cand)
    assert res.gather[1] == Gathered(1, 2, 1, 2) and res.gather[0] == Gathered(0, 4, 4, 4)


def test_the_twins_own_break_comes_first_as_the_precisions():
    """Calibrated, with the twin's final stage broken (check 2): that break, worded as the precision's, comes
    before the candidate's own."""
    ref = make_spec()
    twin, cand = ref.copy(), ref.copy()
    low = int(np.argmin(ref.finals[0][1]))
    twin.finals[0][1][low] += 1.0
    cand.finals[1][1][low] += 1.0
    r, t, c = record(ref, name="r"), record(twin, name="t"), record(cand, name="c")
    numerics = compare_final(context(r, t, policy(topk=TOPK)))
    assert numerics.first_break is not None and numerics.first_break.sample == 0
    calib = Calibration(golden=r, twin=t, label="bfloat16")
    res = compare_final(context(r, c, policy(topk=TOPK), calib=calib), numerics)
    fb = res.first_break
    assert (fb.check, fb.kind, fb.sample) == ("numerics", "value", 0) and res.numerics is numerics
    assert fb.message == wording.numerics("bfloat16", "test", numerics.first_break.message)
    res = compare_final(context(r, c, policy(topk=TOPK), calib=calib), compare_final(context(r, r, policy())))
    assert res.first_break.check == "change" and res.first_break.sample == 1  # check 1: the candidate's own
