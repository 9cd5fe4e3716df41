"""verify/metrics.py's screened, buffered slab metrics against a naive element-by-element float64 computation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.verify import metrics
from prefill_diff.verify.tolerance import Tolerance

F32_MAX = float(np.finfo(np.float32).max)
SPECIAL = [0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 2e20, 1e-40, -1.5e19]

pytestmark = pytest.mark.usefixtures("metric_kernels")  # with the compiled kernels (one thread, shared), without


def naive(r, c, tol: Tolerance, equal_nan=False):
    """The SPEC's rule, one element at a time, in float64 (non-finite elements excluded from values)."""
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    fr, fc = np.isfinite(r64), np.isfinite(c64)
    both = ~fr & ~fc
    if equal_nan:
        both &= ~((np.isnan(r64) & np.isnan(c64)) | (r64 == c64))
    fin = [int((fr & ~fc).sum()), int((~fr & fc).sum()), int(both.sum())]
    ok = fr & fc
    r64, c64 = np.where(ok, r64, 0.0), np.where(ok, c64, 0.0)
    T, W = r.shape
    out = dict(fin=fin, max_abs=0.0, sum_abs=0.0, max_rel=0.0, max_row_rel=0.0, n_bad=0, worst_excess=None,
               rr=0.0, cc=0.0, rc=0.0)
    excess_all = []
    for t in range(T):
        row_r, row_d = r64[t], np.abs(c64[t] - r64[t])
        rms = np.sqrt(np.sum(row_r ** 2) / W)
        nr, nd = np.linalg.norm(row_r), np.linalg.norm(row_d)
        row_rel = (np.inf if nd > 0 else np.nan) if nr == 0 else nd / nr
        tiny = np.finfo(np.float32).tiny
        out["underflow"] = out.get("underflow", False) or 0 < nr ** 2 < tiny or 0 < nd ** 2 < tiny
        if not np.isnan(row_rel):
            out["max_row_rel"] = max(out["max_row_rel"], row_rel)
        whole = tol.row_rtol > 0 and row_rel <= tol.row_rtol
        for w in range(W):
            d = row_d[w]
            out["max_abs"] = max(out["max_abs"], d)
            out["sum_abs"] += d
            if row_r[w] != 0:
                out["max_rel"] = max(out["max_rel"], d / abs(row_r[w]))
            elif d > 0:
                out["max_rel"] = np.inf
            excess = d - (tol.atol + tol.rtol * abs(row_r[w]) + tol.ntol * rms)
            if not whole:
                excess_all.append(excess)
                out["n_bad"] += int(excess > 0)
    out["rr"], out["cc"], out["rc"] = float(np.sum(r64 ** 2)), float(np.sum(c64 ** 2)), float(np.sum(r64 * c64))
    if out["n_bad"]:
        out["worst_excess"] = max(excess_all)
    return out


def close(a, b, rel=2e-5):
    if np.isinf(a) or np.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-30


@st.composite
def slabs(draw):
    T, W = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2 ** 31))
    rng = np.random.default_rng(seed)
    r = (rng.standard_normal((T, W)) * draw(st.sampled_from([1e-3, 1.0, 50.0]))).astype(np.float32)
    noise = draw(st.sampled_from([0.0, 1e-7, 1e-4, 1e-2, 1.0]))
    c = (r + rng.standard_normal((T, W)) * noise * np.abs(r).max()).astype(np.float32)
    for _ in range(draw(st.integers(0, 4))):  # special values on one side, the other or both
        t, w = draw(st.integers(0, T - 1)), draw(st.integers(0, W - 1))
        v = np.float32(draw(st.sampled_from(SPECIAL)))
        side = draw(st.sampled_from(["r", "c", "both"]))
        if side in ("r", "both"):
            r[t, w] = v
        if side in ("c", "both"):
            c[t, w] = v
    tol = Tolerance(draw(st.sampled_from([0.0, 1e-6, 1e-3])), draw(st.sampled_from([0.0, 1e-5, 1e-2])),
                    draw(st.sampled_from([0.0, 1e-5, 1e-2])), draw(st.sampled_from([0.0, 0.05])))
    return r, c, tol, draw(st.booleans())


@pytest.mark.slow
@settings(max_examples=examples(400), deadline=None)
@given(slabs())
def test_slab_metrics_equal_the_naive_rule(case):
    r, c, tol, equal_nan = case
    toks = np.arange(r.shape[0]) + 100
    p = metrics.slab(r, c, tol, equal_nan, sample=3, toks=toks)
    want = naive(r, c, tol, equal_nan)
    assert p.fin == want["fin"]
    assert p.n_bad == want["n_bad"], (p.n_bad, want["n_bad"])
    for k in ("max_abs", "sum_abs", "rr", "cc"):
        assert close(getattr(p, k), want[k]), (k, getattr(p, k), want[k])
    assert abs(p.rc - want["rc"]) <= 1e-4 * (want["rr"] + want["cc"]) + 1e-30
    # float32 limits: a ratio beyond float32's range is inf; where a row's squared norm underflows (every
    # |x| < 1e-19) the reported row error is not exact, but pass/fail (n_bad, above) still is
    assert close(p.max_rel, want["max_rel"], rel=1e-4) or (p.max_rel == np.inf and want["max_rel"] > F32_MAX)
    if not want["underflow"]:
        assert close(p.max_row_rel, want["max_row_rel"], rel=1e-4) or (
            p.max_row_rel == np.inf and want["max_row_rel"] > F32_MAX), (p.max_row_rel, want["max_row_rel"])
    if want["n_bad"]:
        excess, sample, tok, ch, _bound, ref, cand = p.worst
        assert sample == 3 and tok in toks
        assert close(excess, want["worst_excess"], rel=1e-4), (excess, want["worst_excess"])
        # the two sides' values at the worst element, as the traces hold them (scaled back after a rescale)
        assert close(ref, float(r[tok - 100, ch]), rel=1e-12) and close(cand, float(c[tok - 100, ch]), rel=1e-12)
        assert want["fin"] != [0, 0, 0] or p.min_atol > tol.atol
    # each "would pass with" value is a passing value (the others held fixed)
    for k in ("atol", "rtol", "ntol"):
        v = getattr(p, f"min_{k}")
        if np.isfinite(v) and v > getattr(tol, k):
            looser = Tolerance(**{**tol.__dict__, k: v * (1 + 1e-5) + 1e-30})
            assert naive(r, c, looser, equal_nan)["n_bad"] == 0, (k, v)


def test_finite_values_whose_squares_overflow_still_break():
    """A flipped exponent bit (|x| ~ 1e20, x² beyond float32) must not make the RMS bound infinite: a silent pass."""
    r = np.ones((2, 64), np.float32)
    r[0, :2] = 3e20, 2e20
    c = r.copy()
    c[0, 1] = 1e20
    for tol in (Tolerance(1e-4, 1e-4), Tolerance(1e-4, 1e-4, 1e-5)):
        p = metrics.slab(r, c, tol, False, 0, np.arange(2))
        assert p.n_bad == 1 and p.worst[2:4] == (0, 1)
        assert close(p.worst[5], 2e20, rel=1e-6) and close(p.worst[6], 1e20, rel=1e-6)  # scaled back
        assert np.isfinite(p.rr) and 0.9 < p.rc / np.sqrt(p.rr * p.cc) < 1.0
    p = metrics.slab(r.astype(np.float64) * 1e150, c.astype(np.float64) * 1e150, Tolerance(1e-4, 1e-4, 1e-5),
                     False, 0, np.arange(2))
    assert p.n_bad == 1 and p.max_abs > 1e169
