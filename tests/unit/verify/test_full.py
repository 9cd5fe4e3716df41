"""verify/full.py: a state compared over every aligned cell, against a naive comparison by token index."""
from __future__ import annotations

import numpy as np
import pytest

from prefill_diff.verify.calibrate import Calibration
from prefill_diff.verify.full import compare_full_state

from ._traces import DIM, HEAD_DIM, N_HEADS, TOL, context, element_rule, make_spec, policy, record


def _compare(ref_spec, cand_spec, name="mid", tol=TOL, pol=None):
    ref, cand = record(ref_spec, name="ref"), record(cand_spec, name="cand")
    return compare_full_state(context(ref, cand, pol), ref.layer(0), cand.layer(0), name, tol)


def _aligned(ref_spec, cand_spec, name):
    """(sample, tokens, reference rows, candidate rows) over the tokens both sides computed, in float64."""
    for s in range(len(ref_spec.samples)):
        toks = [t for t in ref_spec.tokens(s) if t in cand_spec.tokens(s)]
        a = np.stack([ref_spec.row(name, s, t) for t in toks]).astype(np.float64)
        b = np.stack([cand_spec.row(name, s, t) for t in toks]).astype(np.float64)
        yield s, toks, a, b


def test_a_trace_against_itself_in_other_columns_is_exact():
    """Cells are aligned by token index: the same values laid out with other padding agree exactly."""
    ref = make_spec(pad=[0, 2, 1])
    t = _compare(ref, ref.relayout([3, 0, 2]))
    assert t and t.level == "full" and t.n_bad == 0 and t.max_abs == 0.0
    assert t.compared == sum(len(s) for s in ref.samples) * DIM
    assert t.cosine == pytest.approx(1.0) and t.worst is None and t.bad_samples == ()


def test_metrics_equal_a_naive_element_by_element_comparison():
    """max_abs, max_rel, mean_abs, cosine, n_bad, the worst element and each sample's first bad token, from
    float64 loops over the aligned rows."""
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.relayout([1, 0, 3])
    rng = np.random.default_rng(5)
    for s, x in enumerate(cand.states[(0, "mid")]):
        x[cand.pad[s]:] += (1e-3 * rng.standard_normal(x[cand.pad[s]:].shape)).astype(np.float32)
    t = _compare(ref, cand)
    d_all, a_all, b_all, n_bad, first_bad, worst = [], [], [], 0, {}, (-np.inf, None)
    for s, toks, a, b in _aligned(ref, cand, "mid"):
        bad = element_rule(a, b, TOL)
        n_bad += int(bad.sum())
        if bad.any():
            first_bad[s] = toks[int(np.flatnonzero(bad.any(axis=1))[0])]
        excess = np.abs(b - a) - (TOL.atol + TOL.rtol * np.abs(a))
        i, j = np.unravel_index(np.argmax(excess), excess.shape)
        if excess[i, j] > worst[0]:
            worst = (excess[i, j], (s, toks[i], int(j)), (a[i, j], b[i, j]))
        d_all.append(np.abs(b - a).ravel()), a_all.append(a.ravel()), b_all.append(b.ravel())
    d, a, b = map(np.concatenate, (d_all, a_all, b_all))
    assert n_bad > 0  # the noise is of the tolerance's size: some elements fail, some pass
    assert t.n_bad == n_bad and t.compared == d.size and not t
    assert t.max_abs == pytest.approx(d.max(), rel=1e-6)
    assert t.max_rel == pytest.approx((d / np.abs(a)).max(), rel=1e-4)
    assert t.mean_abs == pytest.approx(d.mean(), rel=1e-5)
    assert t.cosine == pytest.approx(a @ b / np.sqrt((a @ a) * (b @ b)), abs=1e-6)
    assert t.worst == worst[1] and t.worst_values == pytest.approx(worst[2], rel=1e-6)
    assert t.bad_samples == tuple(sorted(first_bad)) and t.bad_positions == first_bad


def test_one_changed_value_is_named_by_sample_token_and_channel():
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.relayout([2, 0, 0])
    cand.row("layer_output", 1, 2)[5] += 0.5
    t = _compare(ref, cand, "layer_output")
    assert not t and t.n_bad == 1 and t.worst == (1, 2, 5)
    assert t.max_abs == pytest.approx(0.5, abs=1e-6)
    old = float(ref.row("layer_output", 1, 2)[5])
    assert t.worst_values == pytest.approx((old, old + 0.5), abs=1e-6)
    assert t.worst_bound == pytest.approx(TOL.atol + TOL.rtol * abs(old), rel=1e-6)
    assert t.bad_samples == (1,) and t.bad_positions == {1: 2}


def test_a_changed_padding_row_is_not_a_value_difference():
    """Padding cells are never compared as values (only counted for non-finite values)."""
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.copy()
    cand.states[(0, "mid")][1][0] += 100.0  # sample 1's first padding cell
    t = _compare(ref, cand)
    assert t and t.max_abs == 0.0


def test_different_widths_are_a_shape_result_not_a_comparison():
    ref, cand = make_spec(), make_spec(dim=12)
    t = _compare(ref, cand)
    assert not t and t.shape_detail == "mid width 8 vs 12" and t.compared == 0


def test_non_finite_padding_is_counted_per_side_and_breaks_when_the_counts_differ():
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.relayout([3, 0, 0])
    cand.states[(0, "mid")][0][1, :2] = np.nan  # 2 in a padding cell of candidate sample 0
    ref.states[(0, "mid")][2][0, 3] = np.inf  # 1 in reference sample 2's padding cell
    t = _compare(ref, cand)
    assert (t.finite.pad_ref, t.finite.pad_cand) == (1, 2)
    assert t.finite.pad_by_sample == ((0, 0, 2), (2, 1, 0))
    assert t.values_ok and not t.finite_ok and not t
    assert set(t.bad_samples) == {0, 2}


def test_equal_non_finite_padding_counts_pass():
    ref = make_spec(pad=[0, 2, 1])
    cand = ref.relayout([0, 1, 1])
    ref.states[(0, "mid")][1][1, 0] = np.nan
    cand.states[(0, "mid")][1][0, 7] = -np.inf  # another padding cell of the same sample, another value
    t = _compare(ref, cand)
    assert t and (t.finite.pad_ref, t.finite.pad_cand) == (1, 1) and t.finite.pad_by_sample == ()


@pytest.mark.parametrize("equal_nan", [False, True])
def test_non_finite_valid_cells_are_counted_by_side(equal_nan):
    """A NaN in the candidate only is a valid value finite only in the reference; NaN at the same cell of both
    sides is counted as non-finite in both unless equal_nan (then it agrees). The non-finite cells are left out
    of the value metrics."""
    ref = make_spec()
    cand = ref.relayout([1, 1, 1])
    cand.row("mid", 2, 1)[0] = np.nan
    ref.row("mid", 0, 3)[4] = cand.row("mid", 0, 3)[4] = np.nan
    t = _compare(ref, cand, pol=policy(equal_nan=equal_nan))
    assert (t.finite.ref_only, t.finite.cand_only, t.finite.both) == (1, 0, 0 if equal_nan else 1)
    assert t.n_bad == 0 and t.max_abs == 0.0
    assert t.finite.valid_ok is False and not t
    assert t.bad_positions[2] == 1
    only_both = _compare(ref, ref.relayout([1, 1, 1]), pol=policy(equal_nan=equal_nan))
    assert bool(only_both) == equal_nan and only_both.finite.both == (0 if equal_nan else 1)


def test_attention_heads_out_of_tolerance_are_named():
    """attn_heads rows are n_heads blocks of head_dim channels: a change in channel c is head c // head_dim."""
    ref = make_spec()
    cand = ref.copy()
    ch = HEAD_DIM * (N_HEADS - 1) + 1
    cand.row("attn_heads", 0, 4)[ch] += 1.0
    t = _compare(ref, cand, "attn_heads")
    assert not t and t.heads == (ch // HEAD_DIM,) and t.worst == (0, 4, ch)
    assert _compare(ref, cand, "mid").heads is None  # a state that is not per head names none


def test_a_reused_prefix_is_left_out_of_the_comparison():
    """Tokens the candidate did not compute (a reused prefix) are not compared, whatever the reference holds."""
    ref = make_spec()
    cand = make_spec(start=[2, 0, 0])
    for key, per in cand.states.items():
        for s, x in enumerate(per):
            x[:] = ref.states[key][s][cand.start[s]:]
    ref.row("mid", 0, 1)[0] += 9.0  # a token the candidate reused, not computed
    t = _compare(ref, cand)
    assert t and t.compared == (3 + 3 + 4) * DIM


def test_a_calibrated_comparison_judges_rows_against_the_twins_noise():
    """Check (1): a row fails when ||cand - golden|| / ||golden|| > K·max(e_t, median e_t) + u, where the twin is
    the reference itself; the candidate's rows are judged by their own errors, computed here by hand."""
    ref = make_spec()
    golden, cand = ref.copy(), ref.copy()
    rng = np.random.default_rng(3)
    for s, x in enumerate(golden.states[(0, "mid")]):
        x += (1e-4 * rng.standard_normal(x.shape)).astype(np.float32)  # the reference's own rounding noise
    cand.row("mid", 1, 1)[:] += 0.05  # a row far beyond 4x that noise
    cand.row("mid", 2, 3)[2] += 1e-5  # one within it
    K, u = 4.0, 2.0 ** -24
    r, c, g = record(ref, name="r"), record(cand, name="c"), record(golden, name="g")
    ctx = context(r, c, calib=Calibration(golden=g, twin=None, factor=K, floor=u))
    t = compare_full_state(ctx, r.layer(0), c.layer(0), "mid", ctx.value_tol("mid"))
    e_c, e_t, where = [], [], []
    for s in range(3):
        for tok in ref.tokens(s):
            gr = golden.row("mid", s, tok).astype(np.float64)
            e_c.append(np.linalg.norm(cand.row("mid", s, tok) - gr) / np.linalg.norm(gr))
            e_t.append(np.linalg.norm(ref.row("mid", s, tok) - gr) / np.linalg.norm(gr))
            where.append((s, tok))
    e_c, e_t = np.array(e_c), np.array(e_t)
    bad = e_c > K * np.maximum(e_t, np.median(e_t)) + u
    assert bad.sum() == 1 and t.calib.bad_rows == 1 and t.calib.rows == len(where)
    assert t.calib.worst == where[int(np.argmax(bad))] == (1, 1) and t.calib.bad_samples == (1,)
    assert t.calib.median_noise == pytest.approx(np.median(e_t), rel=1e-6)
    assert t.n_bad == 0 and not t  # the fixed rule only gathers metrics; check (1) decides
