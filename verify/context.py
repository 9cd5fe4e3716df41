"""What every comparer of one evidence level needs: both traces, the policy, the alignment, the calibration.

The comparers (verify/full.py, sampled.py, stats.py, cache.py, final.py) are functions of a
``Context``; they add what they could not check to ``skipped`` and what a reader should know to
``notes``, the two collections the report shows.
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, NamedTuple

import numpy as np

from ..dumps.reader import Trace, TraceError
from ..dumps.rows import read_ahead
from .align import Alignment
from .calibrate import CalibAcc, Calibration
from .tolerance import Policy, Tolerance

# In a calibrated comparison the values are judged by the candidate's row error against the float64 golden,
# relative to the twin's; this tolerance only gathers the candidate-vs-reference metrics for the report.
METRICS_ONLY = Tolerance(float("inf"), 0.0)


class Rows(NamedTuple):
    """One aligned pair's sample rows: the reference's row ``rs``, the candidate's row ``cs`` and, in a
    calibrated comparison, the golden's and the twin's row ``rs`` (None where there is none)."""
    rs: int
    cs: int
    ref: np.ndarray
    cand: np.ndarray
    golden: np.ndarray | None = None
    twin: np.ndarray | None = None


@dataclass
class Context:
    ref: Trace
    cand: Trace
    policy: Policy
    align: Alignment
    calib: Calibration | None = None
    notes: list = field(default_factory=list)
    skipped: set = field(default_factory=set)

    @property
    def pairs(self):
        return self.align.pairs

    @property
    def equal_nan(self) -> bool:
        return self.policy.equal_nan

    @property
    def noise_of(self) -> str | None:
        """A calibrated comparison's twin precisions, in words."""
        return None if self.calib is None else self.calib.label

    @cached_property
    def any_decoded(self) -> bool:
        """Either trace computed a cell in a decode step."""
        return any(bool((t.rows["step"] >= 0).any()) for t in (self.ref, self.cand))

    def decoded(self, rs: int, cs: int, ref_cols, cand_cols):
        """Which aligned cells either side computed in a decode step (None when neither trace decoded at all)."""
        if not self.any_decoded:
            return None
        return (self.ref.rows["step"][rs][ref_cols] >= 0) | (self.cand.rows["step"][cs][cand_cols] >= 0)

    def value_tol(self, name: str, layer: int | None = None) -> Tolerance:
        return METRICS_ONLY if self.calib is not None else self.policy.tol(name, layer)

    def calib_acc(self, heads: int | None = None) -> CalibAcc | None:
        return None if self.calib is None else CalibAcc(self.calib.factor, self.calib.floor, heads)

    def calib_datasets(self, layer: int, name: str):
        """The golden's and the twin's dataset of one tensor (twin None: the reference is the twin)."""
        if self.calib is None:
            return None, None

        def get(t):
            v = t.layer(layer)
            ds = v.cache(name[len("cache_"):]) if name.startswith("cache_") else v.state(name)
            if ds is None:
                raise TraceError(f"{t.name}: layer {layer} has no full {name} (a calibrated comparison needs full "
                                 "golden and twin traces)")
            return ds
        return get(self.calib.golden), None if self.calib.twin is None else get(self.calib.twin)

    def rows(self, rd, cd, gd=None, td=None) -> Iterator[Rows]:
        """The rows of every aligned pair, in order, of the reference's ``rd``, the candidate's ``cd`` and the
        golden's ``gd`` and twin's ``td`` (calib_datasets), the next pair's read ahead (dumps.reader.read_ahead).
        A pair's rows are valid until the next pair is requested."""
        sources = [(self.ref, rd), (self.cand, cd)]
        if gd is not None:
            sources.append((self.calib.golden, gd))
        if td is not None:
            sources.append((self.calib.twin, td))
        steps = [(rs, cs, rs, rs)[:len(sources)] for rs, cs in self.pairs]  # golden and twin: the reference's rows
        with closing(read_ahead(sources, steps)) as each:
            for (rs, cs), got in zip(self.pairs, each):
                yield Rows(rs, cs, got[0], got[1], got[2] if gd is not None else None,
                           got[-1] if td is not None else None)

    def kv_heads_read(self, heads) -> tuple | None:
        """The KV heads g(h) = ⌊h·H_kv/H_q⌋ that query heads ``heads`` read, by the reference's model."""
        hq, hkv = self.ref.args.get("n_heads"), self.ref.args.get("n_kv_heads")
        if not heads or not isinstance(hq, int) or not isinstance(hkv, int) or hq < 1:
            return None
        return tuple(sorted({h * hkv // hq for h in heads}))
