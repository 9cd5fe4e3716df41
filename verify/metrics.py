"""Error metrics of one slab of aligned rows, in one blocked pass over reused buffers.

A slab is (T, W): T rows (one per aligned position) of width W. The slab is read from memory
once: |c - r|, the signed relative error, their extremes and the per-row sums (squares of r, c
and c - r, sum of |c - r|) come from one loop of the compiled kernel (dumps/kernels.py; a large
slab shared with a helper thread), or, without it, from numpy calls on one block of rows at a
time while the block is in the CPU cache, into preallocated buffers. The element-wise tolerance
bound is only evaluated exactly on rows that a cheap screen cannot clear:

    a row passes for sure when  max_i |d_i| <= atol + ntol·rms(ref row)   (rtol·|ref| >= 0)
                          or when ||d|| <= row_rtol·||ref||                (the row rule)

so a passing comparison costs little more than a bare ``abs(a - b).max()``. For rows cleared
by the screen, ``min_atol`` and ``min_ntol`` are upper bounds (still passing values, maybe not
the smallest); on rows checked exactly they are exact. Sums of squares are per row in the
slab's dtype, then added in float64.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..dumps import kernels

_local = threading.local()
BLOCK_BYTES = 256 * 1024  # bytes of one operand per block: the four operands of a block stay in L2


def _buf(name: str, shape, dtype) -> np.ndarray:
    """A per-thread scratch buffer, reused across slabs (no page faults per slab)."""
    dtype = np.dtype(dtype)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    b = bufs.get((name, dtype))
    size = math.prod(shape)
    if b is None or b.size < size:
        b = bufs[(name, dtype)] = np.empty(max(size, 1), dtype=dtype)
    return b[:size].reshape(shape)


_ONES: dict = {}


def _ones(n: int, dtype) -> np.ndarray:
    """n ones, kept (row sums as dot products)."""
    key = (n, np.dtype(dtype).str)
    if key not in _ONES:
        _ONES[key] = np.ones(n, dtype=dtype)
    return _ONES[key]


@dataclass
class Partial:
    """Mergeable metrics of one or more slabs."""
    n: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    sum_abs: float = 0.0
    rr: float = 0.0  # sum of squares of ref
    cc: float = 0.0  # of cand
    rc: float = 0.0  # sum of ref*cand
    max_row_rel: float = 0.0
    bound_floor: float = float("inf")  # smallest atol + ntol·rms(row): every element may differ this much
    n_bad: int = 0
    min_atol: float = 0.0
    min_rtol: float = 0.0
    min_ntol: float = 0.0
    min_row_rtol: float = 0.0
    rows_by_row_rule: int = 0
    worst: tuple | None = None  # (excess, sample, token, channel, bound, reference value, candidate value)
    fin: list = field(default_factory=lambda: [0, 0, 0])  # ref-only finite, cand-only finite, both non-finite
    bad_samples: dict = field(default_factory=dict)  # sample -> first bad token (None: padding)
    nonfinite: dict = field(default_factory=dict)  # sample -> first token whose valid cells' finite masks differ
    head_bad: np.ndarray | None = None

    def merge(self, o: "Partial") -> None:
        self.n += o.n
        for k in ("max_abs", "max_rel", "max_row_rel", "min_atol", "min_rtol", "min_ntol", "min_row_rtol"):
            setattr(self, k, max(getattr(self, k), getattr(o, k)))
        self.bound_floor = min(self.bound_floor, o.bound_floor)
        for k in ("sum_abs", "rr", "cc", "rc", "n_bad", "rows_by_row_rule"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        if o.worst is not None and (self.worst is None or o.worst[0] > self.worst[0]):
            self.worst = o.worst
        self.fin = [a + b for a, b in zip(self.fin, o.fin)]
        for s, t in o.bad_samples.items():
            self.bad_samples.setdefault(s, t)
        for s, t in o.nonfinite.items():
            self.nonfinite.setdefault(s, t)
        if o.head_bad is not None:
            self.head_bad = o.head_bad if self.head_bad is None else (self.head_bad | o.head_bad)


class _Rows(NamedTuple):
    """What one pass over a slab gives: per-row sums (views into reused per-thread buffers) and extremes."""
    rr: np.ndarray  # squared norm of each reference row
    dd: np.ndarray  # of each row of c - r
    cc: np.ndarray  # of each candidate row
    dsum: np.ndarray  # sum of |c - r| over each row
    gmax: float  # largest |c - r| (NaN or inf if the slab holds one)
    qmax: float  # largest and smallest signed relative error (c - r) / r, NaN ignored
    qmin: float


def _pass(r: np.ndarray, c: np.ndarray) -> _Rows:
    """Every sum and extreme the metrics need: one pass of the compiled kernel (dumps/kernels.py) over rows
    with contiguous values, shared with a helper thread for a large slab (_shared_pass); else _numpy_pass."""
    k = kernels.compiled()
    if k is not None and r.dtype == c.dtype and r.dtype in kernels.FLOAT_TYPES and r.strides[1] == r.itemsize \
            and c.strides[1] == c.itemsize and r.strides[0] >= 0 and c.strides[0] >= 0 \
            and (k.unaligned_ok or (r.flags.aligned and c.flags.aligned)):
        T = r.shape[0]
        rr, dd, cc, dsum = (_buf(n, (T,), np.float64) for n in ("rr", "dd", "cc", "dsum"))
        if SHARE_BYTES is not None and r.nbytes >= SHARE_BYTES and T >= 2:
            gmax, qmax, qmin = _shared_pass(k, r, c, (rr, dd, cc, dsum))
        else:
            gmax, qmax, qmin = k.row_pass(r, c, rr, dd, cc, dsum)
        return _Rows(rr=rr, dd=dd, cc=cc, dsum=dsum, gmax=gmax, qmax=qmax, qmin=qmin)
    return _numpy_pass(r, c)


# A slab of at least this many bytes per side is shared with a helper thread (None: never). Reading the rows
# from memory is what bounds the kernel, and two cores read faster than one (a warm full-size compare: 0.56 s
# against 0.68 s; docs/performance.md). The kernel hands out rows 16 at a time, so a helper that is late or
# descheduled costs at most one chunk's wait; a helper that starts after the slab is done touches nothing.
SHARE_BYTES: int | None = 1 << 20


def _new_helper() -> None:
    """The helper thread's executor; a forked child gets a new one (the parent's thread is not there)."""
    global _HELPER
    _HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-diff-metrics")


_new_helper()
os.register_at_fork(after_in_child=_new_helper)


def _shared_pass(k, r, c, out) -> tuple:
    """k.row_pass over the slab by this thread and the helper together; the two slots' raw extremes finished as
    the single call finishes them."""
    state = np.zeros(2, dtype=np.int64)
    slots = np.array([[0.0, -np.inf, np.inf, 0.0]] * 2)
    _HELPER.submit(k.row_pass, r, c, *out, state, slots[1], False)  # not waited for: see SHARE_BYTES
    k.row_pass(r, c, *out, state, slots[0], True)  # returns when every row is done, by either thread
    gmax, qmax, qmin = float(slots[:, 0].max()), float(slots[:, 1].max()), float(slots[:, 2].min())
    none = qmax < qmin  # no quotient was a number
    return (math.nan if slots[:, 3].any() else gmax), (math.nan if none else qmax), (math.nan if none else qmin)



def _numpy_pass(r: np.ndarray, c: np.ndarray) -> _Rows:
    """_pass in numpy, block by block so that each block stays in cache.

    Each block of rows (BLOCK_BYTES per operand) is read from memory once, by the subtraction; the
    other nine numpy calls on it find it in the CPU cache, and |c - r| is kept only for the block
    (written to memory, it would double the traffic). Row sums are dot products, one row each
    (np.vecdot): no threaded BLAS call on a whole slab, which on a loaded 2-core machine waits for a
    busy core (it made slabs three times slower).
    """
    T, W = r.shape
    dt = r.dtype
    rows = max(1, min(T, BLOCK_BYTES // (W * dt.itemsize)))
    d, q = _buf("db", (rows, W), dt), _buf("q", (rows, W), dt)
    rr, dd, cc, dsum = (_buf(k, (T,), dt) for k in ("rr", "dd", "cc", "dsum"))
    n_blocks = -(-T // rows)
    hi, qhi, qlo = (_buf(k, (n_blocks,), dt) for k in ("hi", "qhi", "qlo"))
    ones = _ones(W, dt)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for k, i in enumerate(range(0, T, rows)):
            j = min(i + rows, T)
            rb, cb, db, qb = r[i:j], c[i:j], d[:j - i], q[:j - i]
            np.subtract(cb, rb, out=db)  # inf - inf -> nan, 3e38 - -3e38 -> inf: the caller handles both
            np.divide(db, rb, out=qb)  # signed relative error; 0/0 -> nan, x/0 -> ±inf
            np.vecdot(db, db, out=dd[i:j])
            np.abs(db, out=db)
            hi[k] = np.maximum.reduce(db, axis=None)
            qhi[k], qlo[k] = np.fmax.reduce(qb, axis=None), np.fmin.reduce(qb, axis=None)
            np.vecdot(db, ones, out=dsum[i:j])
            np.vecdot(rb, rb, out=rr[i:j])
            np.vecdot(cb, cb, out=cc[i:j])
    return _Rows(rr=rr, dd=dd, cc=cc, dsum=dsum, gmax=float(hi.max()), qmax=float(np.fmax.reduce(qhi)),
                 qmin=float(np.fmin.reduce(qlo)))


def slab(r: np.ndarray, c: np.ndarray, tol, equal_nan: bool, sample: int, toks: np.ndarray,
         heads: int | None = None, _scaled: bool = False) -> Partial:
    """Metrics of aligned rows r (reference) and c (candidate), (T, W)."""
    p = Partial()
    if r.size == 0:
        return p
    dt = np.result_type(r.dtype, c.dtype, np.float32)
    if r.dtype != dt or c.dtype != dt:
        r, c = r.astype(dt), c.astype(dt)
    W = r.shape[1]
    s = _pass(r, c)
    if not np.isfinite(s.gmax):  # again, on the finite elements only (the others zeroed on both sides)
        r, c = _finite_part(r, c, p, equal_nan, sample, toks)
        s = _pass(r, c)
    gmax = s.gmax
    a, nt = tol.atol, tol.ntol
    rr, dd = s.rr, s.dd
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is detected below and handled
        p.sum_abs = float(s.dsum.sum(dtype=np.float64))
        rr_sum, dd_sum = float(rr.sum(dtype=np.float64)), float(dd.sum(dtype=np.float64))
        p.rr, p.cc = rr_sum, float(s.cc.sum(dtype=np.float64))
        p.rc = (p.rr + p.cc - dd_sum) / 2  # ||c - r||² = ||c||² + ||r||² - 2<r, c>
    p.n = r.size
    p.max_abs = gmax
    if not _scaled and not all(np.isfinite((rr_sum, dd_sum, p.cc, p.sum_abs))):
        return _rescaled(p, r, c, tol, equal_nan, sample, toks, heads)
    if np.isfinite(rr_sum):
        p.bound_floor = a + nt * float(np.sqrt(rr.min() / W))
    if gmax == 0.0:
        return p
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        row_rel = np.sqrt(dd) / np.sqrt(rr)  # 0/0 -> nan (an all-zero row equal on both sides), x/0 -> inf
    p.max_row_rel = float(np.fmax.reduce(row_rel))
    p.max_rel = max(s.qmax, -s.qmin)
    rms = np.sqrt(rr / W)
    rms_min = float(rms.min())
    if gmax <= a + nt * rms_min:  # every row passes: the largest error is within the smallest row's bound
        p.min_atol = max(0.0, gmax - nt * rms_min)
        p.min_ntol = (gmax - a) / rms_min if gmax > a else 0.0
        return p
    _screen(p, r, c, rms, row_rel, tol, sample, toks, heads)
    return p


def _screen(p: Partial, r, c, rms, row_rel, tol, sample, toks, heads) -> None:
    """Row by row: a row passes for sure if its largest error is within atol + ntol·rms, or by the row rule;
    the element rule is evaluated exactly on the others."""
    a, nt = tol.atol, tol.ntol
    d = _buf("d", r.shape, r.dtype)  # |c - r| again, whole (a slab that is not cleared at once is rare)
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(c, r, out=d)
    np.abs(d, out=d)
    dmax = d.max(axis=1)
    by_elem = dmax <= a + nt * rms
    whole = row_rel <= tol.row_rtol if tol.row_rtol > 0 else np.zeros(d.shape[0], dtype=bool)
    if by_elem.any():
        p.min_atol = max(0.0, float((dmax - nt * rms)[by_elem].max()))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            need_n = np.where(dmax > a, (dmax - a) / rms, 0.0)[by_elem]
        p.min_ntol = float(np.fmax.reduce(np.where(np.isnan(need_n), np.inf, need_n)))
    cleared = by_elem | whole
    if not cleared.all():
        _exact(p, np.flatnonzero(~cleared), d, r, c, rms, row_rel, whole, tol, sample, toks, heads)


def _rescaled(p: Partial, r, c, tol, equal_nan, sample, toks, heads) -> Partial:
    """The slab again, in float64 and divided by its largest magnitude s, when a sum of squares overflowed.

    Finite values whose squares overflow (|x| > 1.8e19 in float32, a flipped exponent bit) would
    otherwise make a row's RMS infinite, and with it the ntol bound: a silent pass. Dividing by s
    (and atol with it) leaves every pass/fail decision and every relative metric unchanged; the
    absolute ones are multiplied back. (float64 magnitudes above 1e154 may still give infinite
    sums of squares, hence an infinite or undefined cosine; the element rule stays exact.)
    """
    s = max(float(np.abs(r).max()), float(np.abs(c).max()))
    q = slab(r.astype(np.float64) / s, c.astype(np.float64) / s, replace(tol, atol=tol.atol / s), equal_nan,
             sample, toks, heads, _scaled=True)
    with np.errstate(over="ignore"):
        q.max_abs, q.sum_abs, q.min_atol = q.max_abs * s, q.sum_abs * s, q.min_atol * s
        q.bound_floor = q.bound_floor * s
        q.rr, q.cc, q.rc = q.rr * s * s, q.cc * s * s, q.rc * s * s
    if q.worst is not None:
        excess, *where, bound, ref, cand = q.worst
        q.worst = (excess * s, *where, bound * s, ref * s, cand * s)
    q.fin, q.nonfinite = p.fin, p.nonfinite  # counted before the non-finite elements were zeroed
    for k, t in p.bad_samples.items():
        q.bad_samples.setdefault(k, t)
    return q


def _finite_part(r, c, p: Partial, equal_nan: bool, sample: int, toks):
    """Count finite-mask differences; return the slab with non-finite elements zeroed."""
    fr, fc = np.isfinite(r), np.isfinite(c)
    both = ~fr & ~fc
    n_both = int(both.sum())
    if equal_nan:
        same = both & ((np.isnan(r) & np.isnan(c)) | (r == c))
        n_both -= int(same.sum())
        both = both & ~same
    p.fin = [int((fr & ~fc).sum()), int((~fr & fc).sum()), n_both]
    differ = (fr != fc) | both
    if differ.any():
        p.nonfinite.setdefault(sample, int(toks[int(np.argmax(differ.any(axis=1)))]))
    ok = fr & fc
    if (~ok).any():
        p.bad_samples.setdefault(sample, int(toks[int(np.argmax((~ok).any(axis=1)))]))
    return np.where(ok, r, 0), np.where(ok, c, 0)


def _exact(p: Partial, rows, d, r, c, rms, row_rel, whole, tol, sample, toks, heads):
    """The element rule on the rows the screen could not clear (rows accepted by row_rtol are counted)."""
    a, rt, nt = tol.atol, tol.rtol, tol.ntol
    d, ar, rms_r = d[rows], np.abs(r[rows]), rms[rows][:, None]
    slack = d - rt * ar - nt * rms_r  # > atol: the element rule fails
    elem_bad = (slack > a).any(axis=1)
    if elem_bad.any():
        p.min_row_rtol = max(p.min_row_rtol, float(row_rel[rows][elem_bad].max()))
    keep = ~whole[rows]
    p.rows_by_row_rule += int((elem_bad & ~keep).sum())
    if not keep.any():
        return
    rows, d, ar, rms_r, slack = rows[keep], d[keep], ar[keep], rms_r[keep], slack[keep]
    excess = slack - a
    bad = excess > 0
    p.n_bad += int(bad.sum())
    i = int(np.argmax(excess))
    row, ch = divmod(i, d.shape[1])
    bound = float(a + rt * ar.flat[i] + nt * rms_r[row, 0])
    at = (rows[row], ch)
    p.worst = (float(excess.flat[i]), sample, int(toks[rows[row]]), int(ch), bound, float(r[at]), float(c[at]))
    if bad.any():
        p.bad_samples.setdefault(sample, int(toks[rows[int(np.argmax(bad.any(axis=1)))]]))
        if heads:
            p.head_bad = bad.reshape(bad.shape[0], heads, -1).any(axis=(0, 2))
    p.min_atol = max(p.min_atol, float(slack.max()))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        num_r = d - a - nt * rms_r
        num_n = d - a - rt * ar
        need_r = np.where(num_r > 0, num_r / ar, 0.0)
        need_n = np.where(num_n > 0, num_n / rms_r, 0.0)
    p.min_rtol = max(p.min_rtol, float(np.nan_to_num(need_r, nan=np.inf, posinf=np.inf).max()))
    p.min_ntol = max(p.min_ntol, float(np.nan_to_num(need_n, nan=np.inf, posinf=np.inf).max()))
