"""Typed, frozen results of comparing one tensor, and the cache checks of one layer.

A ``TensorResult`` carries numbers only (its messages are worded in verify/wording.py); its
``__bool__`` is its verdict. Its JSON form (``as_dict``) is documented in docs/report-format.md and
keeps the flat keys of earlier versions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .calibrate import CalibResult
from .metrics import Partial, slab
from .tolerance import Tolerance


def num(x):
    """A metric for JSON: a float, or 'inf', '-inf', 'nan' (JSON has no non-finite numbers)."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


@dataclass(frozen=True, kw_only=True)
class Finite:
    """Finite-mask differences: valid cells finite on one side only or on neither, non-finite padding cells."""
    ref_only: int = 0  # valid cells finite in the reference, not in the candidate
    cand_only: int = 0
    both: int = 0  # valid cells non-finite on both sides
    pad_ref: int = 0  # non-finite padding cells of the reference
    pad_cand: int = 0
    pad_by_sample: tuple = ()  # (reference sample, reference count, candidate count) where the two differ
    equal_nan: bool = False  # non-finite on both sides at the same place counts as agreement
    at: tuple = ()  # (reference sample, first token) where the valid cells' finite masks differ, by sample

    @property
    def valid_ok(self) -> bool:
        """The valid cells agree (a break, if any, is in padding rows only)."""
        return not (self.ref_only or self.cand_only or (self.both and not self.equal_nan))

    @property
    def ok(self) -> bool:
        both = 0 if self.equal_nan else self.both
        return not (self.ref_only or self.cand_only or both or self.pad_ref != self.pad_cand)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True, kw_only=True)
class Needed:
    """The smallest value of each tolerance term that passes, the others kept ("minimum required tolerance")."""
    atol: float = 0.0
    rtol: float = 0.0
    ntol: float = 0.0
    row_rtol: float = 0.0  # under which every row with element errors passes whole


@dataclass(frozen=True, kw_only=True)
class TensorResult:
    """One tensor of one layer (or of the final stage), compared over aligned cells."""
    tensor: str
    level: str  # full | sampled | stats | none
    tol: Tolerance
    compared: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    cosine: float | None = None
    n_bad: int = 0
    worst: tuple | None = None  # (sample, position, channel)
    worst_bound: float | None = None  # the tolerance at the worst element
    worst_values: tuple | None = None  # (reference, candidate) values at the worst element
    max_row_rel: float = 0.0  # largest ||cand - ref|| / ||ref|| over rows (one sample and position)
    rows_by_row_rule: int = 0  # rows with element errors beyond atol/rtol/ntol accepted by row_rtol
    bound_floor: float | None = None  # smallest atol + ntol·rms(ref row): every element may differ at least this much
    needed: Needed = Needed()
    finite: Finite = Finite()
    shape_detail: str | None = None
    bad_samples: tuple = ()
    bad_positions: dict = field(default_factory=dict)  # sample -> first bad position
    heads: tuple | None = None
    kv_heads: tuple | None = None  # cache tensors (full level): the KV heads with values out of tolerance
    bit_identical: bool | None = None
    note: str | None = None
    calib: CalibResult | None = None  # check (1) of a calibrated comparison
    by_phase: dict | None = None  # full level, a side decoded: max abs over prompt rows, response rows

    @property
    def values_ok(self) -> bool:
        return bool(self.calib) if self.calib is not None else self.n_bad == 0

    @property
    def finite_ok(self) -> bool:
        return self.finite.ok

    @property
    def failing_samples(self) -> tuple:
        """The reference samples whose values break the rule used (calibrated: check (1)'s rows)."""
        return self.calib.bad_samples if self.calib is not None else self.bad_samples

    @property
    def n_failing(self) -> int:
        """What broke the rule used: elements out of tolerance, or in a calibrated comparison rows out of it."""
        return self.calib.bad_rows if self.calib is not None else self.n_bad

    @property
    def atol(self) -> float:
        return self.tol.atol

    @property
    def rtol(self) -> float:
        return self.tol.rtol

    @property
    def ntol(self) -> float:
        return self.tol.ntol

    @property
    def row_rtol(self) -> float:
        return self.tol.row_rtol

    def __bool__(self) -> bool:
        return self.shape_detail is None and self.finite_ok and self.values_ok

    def as_dict(self) -> dict:
        f, n = self.finite, self.needed
        d = {"tensor": self.tensor, "level": self.level, "compared": self.compared, "max_abs": num(self.max_abs),
             "max_rel": num(self.max_rel), "mean_abs": num(self.mean_abs), "cosine": self.cosine,
             "n_bad": self.n_failing, "n_bad_unit": "rows" if self.calib is not None else "elements",
             "worst": list(self.worst) if self.worst else None, "min_atol": num(n.atol), "min_rtol": num(n.rtol),
             "min_ntol": num(n.ntol), "min_row_rtol": num(n.row_rtol), "max_row_rel": num(self.max_row_rel),
             "rows_by_row_rule": self.rows_by_row_rule, "worst_bound": num(self.worst_bound),
             "worst_reference": num(self.worst_values[0]) if self.worst_values else None,
             "worst_candidate": num(self.worst_values[1]) if self.worst_values else None,
             "bound_floor": num(self.bound_floor), "finite_ref_only": f.ref_only, "finite_cand_only": f.cand_only,
             "nonfinite_both": f.both, "pad_nonfinite_ref": f.pad_ref, "pad_nonfinite_cand": f.pad_cand,
             "shape_detail": self.shape_detail, "bad_samples": list(self.failing_samples),
             **({} if self.by_phase is None else {"max_abs_by_phase": {k: num(v) for k, v in self.by_phase.items()}}),
             "heads": list(self.heads) if self.heads is not None else None,
             "kv_heads": list(self.kv_heads) if self.kv_heads is not None else None,
             "bit_identical": self.bit_identical, "note": self.note, "equal_nan": f.equal_nan}
        if self.calib is not None:
            d["calibrated"] = self.calib.as_dict()
        d.update(atol=self.atol, rtol=self.rtol, ntol=self.ntol, row_rtol=self.row_rtol, passed=bool(self))
        return d


@dataclass(frozen=True, kw_only=True)
class CacheResult:
    """A layer's cache lengths and positions against the reference's, exactly."""
    lengths_ok: bool = True
    positions_ok: bool = True
    detail: str | None = None
    sample: int | None = None
    position: int | None = None
    samples: tuple = ()

    def __bool__(self) -> bool:
        return self.lengths_ok and self.positions_ok


class Accumulator:
    """Streaming error metrics of one tensor: merges the per-slab metrics of verify.metrics."""

    def __init__(self, tol: Tolerance, equal_nan: bool):
        self.tol, self.equal_nan = tol, equal_nan
        self.p = Partial()

    def add(self, r: np.ndarray, c: np.ndarray, sample: int, toks: np.ndarray, heads: int | None = None):
        """r, c: (T, W) aligned rows of one sample (one row per position); toks: their token indices."""
        self.p.merge(slab(r, c, self.tol, self.equal_nan, sample, toks, heads))

    def result(self, tensor: str, level: str, *, pad_ref: int = 0, pad_cand: int = 0, pad_by_sample: tuple = (),
               **kw) -> TensorResult:
        p = self.p
        cos = float(p.rc / np.sqrt(p.rr * p.cc)) if p.rr > 0 and p.cc > 0 else (1.0 if p.rr == p.cc == 0 and p.n
                                                                                   else None)
        return TensorResult(
            tensor=tensor, level=level, tol=self.tol, compared=p.n, max_abs=p.max_abs, max_rel=p.max_rel,
            mean_abs=p.sum_abs / p.n if p.n else 0.0, cosine=cos, n_bad=p.n_bad,
            worst=None if p.worst is None else p.worst[1:4], worst_bound=None if p.worst is None else p.worst[4],
            worst_values=None if p.worst is None else p.worst[5:7],
            max_row_rel=p.max_row_rel, rows_by_row_rule=p.rows_by_row_rule,
            bound_floor=p.bound_floor if np.isfinite(p.bound_floor) else None,
            needed=Needed(atol=p.min_atol, rtol=p.min_rtol, ntol=p.min_ntol, row_rtol=p.min_row_rtol),
            finite=Finite(ref_only=p.fin[0], cand_only=p.fin[1], both=p.fin[2], pad_ref=pad_ref, pad_cand=pad_cand,
                          pad_by_sample=tuple(pad_by_sample), equal_nan=self.equal_nan,
                          at=tuple(sorted(p.nonfinite.items()))),
            bad_samples=tuple(sorted(p.bad_samples)), bad_positions=dict(p.bad_samples),
            heads=None if p.head_bad is None else tuple(int(h) for h in np.flatnonzero(p.head_bad)), **kw)
