"""verify/stats.py: per-sample statistics (min, max, mean, rms) within tolerance, finite counts exactly."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.dumps.schema import STAT_COLUMNS
from prefill_diff.verify import wording
from prefill_diff.verify.full import compare_full_state
from prefill_diff.verify.stats import COL, compare_sample, compare_stats, pad_counts
from prefill_diff.verify.tolerance import Tolerance

from ._traces import TOL, context, make_spec, record


def _row(count, mn, mx, mean, rms, finite=None, pad_count=0.0, pad_finite=0.0) -> np.ndarray:
    """A statistics row in STAT_COLUMNS order; l2 from the rms (rms = l2 / sqrt(count))."""
    d = {"count": count, "finite": count if finite is None else finite, "min": mn, "max": mx, "mean": mean,
         "l2": rms * np.sqrt(count), "pad_count": pad_count, "pad_finite": pad_finite}
    return np.array([d[k] for k in STAT_COLUMNS], dtype=np.float64)


def _four(x: np.ndarray) -> np.ndarray:
    """min, max, mean, rms of values, in float64."""
    x = np.asarray(x, np.float64)
    return np.array([x.min(), x.max(), x.mean(), np.sqrt(np.mean(x * x))])


def _valid_values(spec, name: str, s: int) -> np.ndarray:
    return np.asarray(spec.states[(0, name)][s][spec.pad[s]:], np.float64)


def test_columns_are_the_trace_formats():
    assert list(COL) == list(STAT_COLUMNS) and [COL[k] for k in STAT_COLUMNS] == list(range(len(STAT_COLUMNS)))


def test_one_sample_against_hand_computed_errors():
    """max 2 vs 2.1 (rms 2 on both sides): error 0.1 against atol + rtol·|2| + ntol·rms."""
    a = _row(4, -1.0, 2.0, 0.5, 2.0)
    b = _row(4, -1.0, 2.1, 0.5, 2.0)
    e = compare_sample(a, b, Tolerance(0.05, 0.01))  # bound 0.07: out
    assert e.n_bad == 1 and e.max_abs == pytest.approx(0.1) and e.min_atol == pytest.approx(0.1 - 0.02)
    e = compare_sample(a, b, Tolerance(0.05, 0.01, ntol=0.01))  # ntol in units of the reference's rms: 0.09, out
    assert e.n_bad == 1 and e.min_atol == pytest.approx(0.1 - 0.02 - 0.02)
    assert compare_sample(a, b, Tolerance(0.05, 0.01, ntol=0.02)).n_bad == 0  # 0.11: in
    assert compare_sample(a, a, Tolerance(0.0, 0.0)) == (0.0, 0, 0.0)


def test_every_statistic_is_judged():
    """min, max, mean and rms each count once when out of tolerance."""
    a = _row(9, -3.0, 3.0, 0.0, 1.5)
    b = _row(9, -3.5, 3.5, 0.25, 1.0)
    e = compare_sample(a, b, Tolerance(0.1, 0.0))
    assert e.n_bad == 4 and e.max_abs == pytest.approx(0.5) and e.min_atol == pytest.approx(0.5)


@pytest.mark.parametrize("ref,cand,bad", [
    (np.nan, np.nan, 0),  # NaN on both sides agrees
    (np.inf, np.inf, 0),  # equal infinities agree
    (1.0, np.nan, 1),  # finite on one side only: an infinite error
    (1.0, np.inf, 1),
    (1.0, -np.inf, 1),
])
def test_non_finite_statistics(ref, cand, bad):
    a, b = _row(4, ref, 2.0, 0.5, 1.0), _row(4, cand, 2.0, 0.5, 1.0)
    e = compare_sample(a, b, Tolerance(1e-3, 1e-3))
    assert e.n_bad == bad and e.max_abs == (np.inf if bad else 0.0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in stats.py
@pytest.mark.parametrize("stat,value", [("mn", np.nan), ("mx", np.inf), ("rms", np.inf)])
def test_a_statistic_non_finite_in_the_reference_only_is_a_difference(stat, value):
    """The same pair with the sides swapped is a difference (test_non_finite_statistics; docs/guarantees.md: a
    statistic infinite on one side only is a difference): it must be one whichever side holds which."""
    finite = dict(mn=-1.0, mx=2.0, mean=0.5, rms=1.0)
    a = _row(4, **{**finite, stat: value})
    b = _row(4, **finite)
    assert compare_sample(b, a, Tolerance(1e-3, 1e-3)).n_bad == 1  # the candidate's: found
    e = compare_sample(a, b, Tolerance(1e-3, 1e-3))
    assert e.n_bad == 1 and e.max_abs == np.inf


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=8, max_size=8), st.sampled_from([0.0, 1e-3, 0.1]),
       st.sampled_from([0.0, 1e-2]), st.sampled_from([0.0, 1e-2]))
def test_min_atol_is_the_smallest_passing_atol(v, atol, rtol, ntol):
    """An atol just above min_atol passes (the other terms kept), one just below it does not."""
    a = _row(16, v[0], v[0] + abs(v[1]), v[2], abs(v[3]))
    b = _row(16, v[4], v[4] + abs(v[5]), v[6], abs(v[7]))
    e = compare_sample(a, b, Tolerance(atol, rtol, ntol))
    ra, ca = a[[2, 3, 4]], b[[2, 3, 4]]
    d = np.abs(np.append(ca, b[5] / 4) - np.append(ra, a[5] / 4))
    bound = atol + rtol * np.abs(np.append(ra, a[5] / 4)) + ntol * a[5] / 4
    assert e.n_bad == int((d > bound).sum()) and e.max_abs == pytest.approx(d.max())
    if e.min_atol > 0:
        assert compare_sample(a, b, Tolerance(e.min_atol * (1 + 1e-9) + 1e-12, rtol, ntol)).n_bad == 0
        assert compare_sample(a, b, Tolerance(e.min_atol * (1 - 1e-6), rtol, ntol)).n_bad > 0


def _stats(ref_spec, cand_spec, name="mid", tol=TOL, levels=("stats", "stats"), **kw):
    ref, cand = record(ref_spec, levels[0], name="ref", **kw), record(cand_spec, levels[1], name="cand", **kw)
    ctx = context(ref, cand)
    return compare_stats(ctx, ref.layer(0), cand.layer(0), name, tol), ctx


def test_identical_statistics_pass_with_equal_checksums():
    spec = make_spec(pad=[0, 2, 1])
    t, ctx = _stats(spec, spec.relayout([1, 0, 0]))
    assert t and t.level == "stats" and t.compared == 4 * 3 and t.max_abs == 0.0
    assert t.bit_identical is True and wording.STATS_ONLY in ctx.skipped


def test_a_changed_value_shows_as_the_statistics_it_moves():
    """A value raised to a new maximum of sample 1: the largest statistic error is computed from the arrays."""
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.copy()
    cand.row("mid", 1, 2)[3] = _valid_values(ref, "mid", 1).max() + 0.5
    t, _ = _stats(ref, cand)
    want = np.abs(_four(_valid_values(cand, "mid", 1)) - _four(_valid_values(ref, "mid", 1)))
    assert not t and t.bad_samples == (1,) and t.worst == (1, None, None)
    assert t.max_abs == pytest.approx(want.max(), rel=1e-5)
    assert t.n_bad == int((want > TOL.atol + TOL.rtol * np.abs(_four(_valid_values(ref, "mid", 1)))).sum())
    assert t.bit_identical is False
    assert t.needed.atol == pytest.approx(
        (want - TOL.rtol * np.abs(_four(_valid_values(ref, "mid", 1)))).max(), rel=1e-5)


def test_different_bits_within_tolerance_pass_with_differing_checksums():
    ref = make_spec()
    cand = ref.copy()
    cand.row("mid", 0, 1)[0] += 1e-6
    t, _ = _stats(ref, cand)
    assert t and t.bit_identical is False


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_counts_are_compared_exactly_by_side():
    """A NaN in the candidate is a value finite in the reference only (ref_only), one in the reference the
    opposite."""
    ref = make_spec()
    cand = ref.copy()
    cand.row("mid", 0, 1)[0] = np.nan
    cand.row("mid", 0, 2)[0] = np.nan
    ref.row("mid", 2, 0)[1] = np.inf
    t, _ = _stats(ref, cand)
    assert (t.finite.ref_only, t.finite.cand_only) == (2, 1)
    assert not t.finite_ok and not t and set(t.bad_samples) >= {0, 2}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_against_inf_breaks_whichever_side_holds_the_nan():
    """NaN in the reference and +inf in the candidate at one cell: equal non-finite counts, but the statistics
    (NaN against inf and finite) differ; the verdict may not depend on which trace is the reference."""
    ref = make_spec()
    cand = ref.copy()
    ref.row("mid", 0, 1)[2], cand.row("mid", 0, 1)[2] = np.nan, np.inf
    swapped, _ = _stats(cand, ref)
    assert not swapped  # the candidate's NaN: its statistics are out of tolerance
    t, _ = _stats(ref, cand)
    assert not t


def test_nan_in_valid_cells_of_both_sides_breaks_without_equal_nan():
    """Whether the two NaN are at the same cell (non-finite in both) or not (finite on one side only), the full
    level breaks without equal_nan; the statistics know both sides hold a non-finite valid value."""
    ref = make_spec()
    cand = ref.copy()
    ref.row("mid", 0, 1)[2] = cand.row("mid", 0, 1)[2] = np.nan
    r, c = record(ref), record(cand)
    assert not compare_full_state(context(r, c), r.layer(0), c.layer(0), "mid", TOL)  # the full level breaks
    t, ctx = _stats(ref, cand)
    assert not ctx.policy.equal_nan
    assert not t


def test_padding_counts_come_from_the_statistics():
    """pad_counts: non-finite padding cells per side, and the samples where they differ."""
    ref = make_spec(pad=[1, 2, 0])
    cand = ref.copy()
    ref.states[(0, "mid")][1][0, :3] = np.nan
    cand.states[(0, "mid")][1][1, :3] = np.nan  # as many, in another cell: equal counts
    cand.states[(0, "mid")][0][0, 0] = -np.inf
    r, c = record(ref, "stats"), record(cand, "stats")
    ctx = context(r, c)
    got = pad_counts(ctx, r.layer(0), c.layer(0), "mid")
    assert got == {"pad_ref": 3, "pad_cand": 4, "pad_by_sample": ((0, 0, 1),)}
    t = compare_stats(ctx, r.layer(0), c.layer(0), "mid", TOL)
    assert t.values_ok and not t.finite_ok and t.bad_samples == (0,)
    assert pad_counts(ctx, r.layer(0), c.layer(0), "no_such_tensor") == {}


def test_statistics_over_other_cells_are_not_compared():
    """A candidate that reused sample 0's prefix has statistics over fewer cells: that sample is skipped."""
    ref = make_spec()
    cand = make_spec(start=[2, 0, 0])
    for key, per in cand.states.items():
        for s, x in enumerate(per):
            x[:] = ref.states[key][s][cand.start[s]:]
    t, ctx = _stats(ref, cand)
    assert t and t.compared == 4 * 2
    assert wording.stats_cover_other_cells("mid") in ctx.skipped


def test_a_tensor_one_side_did_not_record_is_not_compared():
    ref, cand = make_spec(), make_spec(heads=False)
    t, ctx = _stats(ref, cand, "attn_heads")
    assert t.level == "none" and t.note == "not recorded in one trace" and t.compared == 0
    assert wording.not_recorded("attn_heads") in ctx.skipped


def test_statistics_for_lack_of_values_say_so():
    """A full side against a sampled one, compared as statistics: the skipped line names both levels."""
    spec = make_spec()
    t, ctx = _stats(spec, spec, "cache_keys", levels=("full", "sampled"))
    assert t and t.level == "stats"
    assert wording.stats_for_lack_of_values("cache_keys", "full", "sampled") in ctx.skipped
    assert wording.STATS_ONLY not in ctx.skipped
