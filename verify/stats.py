"""The stats level: per-sample statistics (min, max, mean, rms) within tolerance, finite counts exactly.

Every level records, per layer, tensor and sample, the statistics of ``dumps.schema.STAT_COLUMNS``
and a checksum; when one side kept no values of a tensor, these are what can be compared. No
element, row or relative error exists here: ``max_abs`` is the largest statistic error.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..dumps.reader import LayerView
from ..dumps.schema import STAT_COLUMNS
from . import wording
from .context import Context
from .results import Finite, Needed, TensorResult
from .tolerance import Tolerance

COL = {k: i for i, k in enumerate(STAT_COLUMNS)}


class StatErrors(NamedTuple):
    """One sample's four statistics compared."""
    max_abs: float
    n_bad: int
    min_atol: float  # the smallest atol under which its four statistics pass


def pad_counts(ctx: Context, r: LayerView, c: LayerView, name: str) -> dict:
    """Non-finite counts in padding rows, from the statistics every level records: ``pad_ref``, ``pad_cand``
    and ``pad_by_sample`` ((reference sample, reference count, candidate count) where they differ), as keywords
    of ``Accumulator.result``."""
    rs_t, cs_t = r.stats(name), c.stats(name)
    if rs_t is None or cs_t is None:
        return {}
    cnt, fin = COL["pad_count"], COL["pad_finite"]
    each = [(a, int(rs_t[a][cnt] - rs_t[a][fin]), int(cs_t[b][cnt] - cs_t[b][fin])) for a, b in ctx.pairs]
    return {"pad_ref": sum(x[1] for x in each), "pad_cand": sum(x[2] for x in each),
            "pad_by_sample": tuple(x for x in each if x[1] != x[2])}


def _four(row) -> np.ndarray:
    """min, max, mean, rms of one sample's statistics row."""
    cnt = max(row[COL["count"]], 1)
    return np.array([row[COL["min"]], row[COL["max"]], row[COL["mean"]], row[COL["l2"]] / np.sqrt(cnt)])


def compare_sample(a, b, tol: Tolerance) -> StatErrors:
    """The statistics rows a (reference) and b (candidate) of one sample, within tol."""
    ra, ca = _four(a), _four(b)
    with np.errstate(invalid="ignore"):
        d = np.abs(ca - ra)
    same = (ra == ca) | (np.isnan(ra) & np.isnan(ca))  # equal infinities, or NaN on both sides
    d = np.where(np.isfinite(d), d, np.where(same, 0.0, np.inf))  # non-finite on one side, or two that differ
    scale = tol.ntol * ra[3] if np.isfinite(ra[3]) else 0.0  # ntol in units of the sample's RMS
    rel = tol.rtol * np.where(np.isfinite(ra), np.abs(ra), 0.0)  # a non-finite reference allows no relative error
    over = d > tol.atol + rel + scale
    return StatErrors(float(d.max()), int(over.sum()), float((d - rel - scale).max()))


def compare_stats(ctx: Context, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
    """Statistics only: finite counts exactly, min/max/mean/rms within tolerance, checksums."""
    rs_t, cs_t = r.stats(name), c.stats(name)
    if rs_t is None or cs_t is None:
        ctx.skipped.add(wording.not_recorded(name))
        return TensorResult(tensor=name, level="none", tol=tol, note="not recorded in one trace")
    rchk, cchk = r.checksum(name), c.checksum(name)
    more_nonfinite = np.zeros(2, dtype=np.int64)  # (candidate, reference) has more non-finite values
    both = 0  # non-finite valid values both sides hold (at most: the statistics do not say where)
    worst, max_abs, n_bad, min_atol, bad, identical, n = None, 0.0, 0, 0.0, {}, True, 0
    for rs, cs in ctx.pairs:
        a, b = rs_t[rs], cs_t[cs]
        if a[COL["count"]] != b[COL["count"]]:
            ctx.skipped.add(wording.stats_cover_other_cells(name))
            continue
        nf_r, nf_c = a[COL["count"]] - a[COL["finite"]], b[COL["count"]] - b[COL["finite"]]
        if nf_r != nf_c:
            more_nonfinite += [int(max(nf_c - nf_r, 0)), int(max(nf_r - nf_c, 0))]  # statistics are float64
            bad.setdefault(rs, None)
        if min(nf_r, nf_c) > 0:  # as the full level: a failure unless NaN may equal NaN (Finite.valid_ok)
            both += int(min(nf_r, nf_c))
            if not ctx.equal_nan:
                bad.setdefault(rs, None)
        e = compare_sample(a, b, tol)
        n += 4
        if e.n_bad:
            n_bad += e.n_bad
            bad.setdefault(rs, None)
        if e.max_abs > max_abs:
            max_abs, worst = e.max_abs, (rs, None, None)
        min_atol = max(min_atol, e.min_atol)
        if rchk is not None and cchk is not None and rchk[rs] != cchk[cs]:
            identical = False
        if a[COL["pad_count"]] - a[COL["pad_finite"]] != b[COL["pad_count"]] - b[COL["pad_finite"]]:
            bad.setdefault(rs, None)
    if "stats" in (ctx.ref.level, ctx.cand.level):
        ctx.skipped.add(wording.STATS_ONLY)
    else:  # e.g. full vs sampled cache: the sampled subset exists on one side only
        ctx.skipped.add(wording.stats_for_lack_of_values(name, ctx.ref.level, ctx.cand.level))
    pads = pad_counts(ctx, r, c, name)
    # ref_only: cells finite in the reference only, i.e. the candidate's excess of non-finite values
    finite = Finite(ref_only=int(more_nonfinite[0]), cand_only=int(more_nonfinite[1]), both=both,
                    equal_nan=ctx.equal_nan, **pads)
    return TensorResult(tensor=name, level="stats", tol=tol, compared=n, max_abs=max_abs, n_bad=n_bad, worst=worst,
                        needed=Needed(atol=max(min_atol, 0.0)), finite=finite, bad_samples=tuple(sorted(bad)),
                        bad_positions=dict(bad), bit_identical=identical if rchk is not None else None)
