"""Calibration, decided and recorded: whether a comparison is calibrated and by which engine (``CalibPlan``), and
the golden and twin traces recorded for it (verify/calibrate.py judges with them)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..dumps.reader import Trace
from ..dumps.schema import FULL_LEVELS
from ..engine.shared.errors import ConfigError
from ..engine.registry import ENGINES, OURS, twin_maker
from ..verify.calibrate import (DEFAULT_FACTOR, Calibration, below_float32, precision_key, precision_label, precisions,
                                same_precisions, sibling_paths, unit_roundoff)
from ..verify.tolerance import Policy
from ..verify import wording
from .options import Judging, SideProgress, progress_for

# -- calibration: decide, then record the golden and the twin ----------------------------------------------

@dataclass(frozen=True)
class CalibPlan:
    """Whether a comparison is calibrated (verify/calibrate.py), and how.

    ``maker``: the engine that runs the golden and the twin (the reference's own when it can run float64 and
    the candidate's precisions, else ours: engine/registry.py). ``note``: why the comparison is not
    calibrated although it would be, for the report's rule.
    """
    use: bool
    factor: float = DEFAULT_FACTOR
    cand_prec: dict | None = None
    twin_is_ref: bool = False  # same precisions: the reference is its own twin
    twin_is_cand: bool = False  # the candidate is the reference's own path at its precisions
    note: str | None = None
    maker: str = OURS
    by_other: bool = False  # the maker is not the reference's own engine (the rule says so)

    @classmethod
    def fixed(cls, factor: float, cand_prec: dict | None, note: str | None = None) -> "CalibPlan":
        """Not calibrated: the fixed per-dtype envelope judges values (``note``: why, when it would have been)."""
        return cls(False, factor, cand_prec, note=note)

    def declined(self, note: str) -> "CalibPlan":
        """This plan, not calibrated after all for a reason found once the traces are open (``note``)."""
        return replace(self, use=False, note=note)

    @property
    def label(self) -> str:
        return precision_label(self.cand_prec)

    def rule_note(self, policy: Policy) -> str | None:
        """The header's rule when the candidate is its own twin (no golden is recorded): ``policy``'s fixed
        envelope judges its numerics."""
        if not (self.use and self.twin_is_cand):
            return None
        return wording.own_twin_rule(self.label, policy.name)

    def calibration(self, golden: Trace, twin: Trace | None) -> Calibration:
        return Calibration(golden, twin, self.factor, unit_roundoff(self.cand_prec), self.label,
                           self.maker if self.by_other else None, ENGINES[self.maker].words)


def check_calibration(judging: Judging, *, explicit: bool, level: str) -> None:
    """A contradictory calibration request is refused before anything runs."""
    calibrate, factor = judging.calibrate, judging.factor
    if not factor > 0:
        raise ConfigError(f"--noise-factor must be positive (got {factor})")
    if calibrate and explicit:
        raise ConfigError("--calibrate measures the tolerance; explicit --atol/--rtol/--ntol/--row-rtol/--policy/"
                          "--tolerance declare it: give one or the other")
    if judging.exact and level not in FULL_LEVELS:
        raise ConfigError(f"--exact compares every element bit for bit: it needs --level full or ops (got --level "
                          f"{level})")
    if calibrate and level not in FULL_LEVELS:
        raise ConfigError(f"a calibrated comparison needs full traces (got --level {level})")


def plan_calibration(ref_prec: dict, cand_prec: dict, *, calibrate: bool | None, explicit: bool, level: str,
                     factor: float = DEFAULT_FACTOR, twin_is_cand: bool = False, ref_engine: str = OURS,
                     cand_engine: str = OURS) -> CalibPlan:
    """calibrate None: automatic, on whenever either side computes below float32 or the precisions differ (and
    nothing is declared); True: forced; False: off. The precisions are the ones the traces record."""
    check_calibration(Judging(calibrate=calibrate, factor=factor), explicit=explicit, level=level)
    differ = not same_precisions(ref_prec, cand_prec)
    wanted = differ or below_float32(ref_prec) or below_float32(cand_prec)
    if not (bool(calibrate) or (calibrate is None and wanted and not explicit)):
        return CalibPlan.fixed(factor, cand_prec)
    if level not in FULL_LEVELS:
        return CalibPlan.fixed(factor, cand_prec, note=f"--level {level} keeps no full rows")
    if differ and twin_is_cand:
        return CalibPlan(True, factor, cand_prec, twin_is_cand=True)
    maker = twin_maker(ref_engine, cand_prec)
    if maker is None:
        why = ENGINES[cand_engine].why_not if cand_engine in ENGINES else ""
        return CalibPlan.fixed(factor, cand_prec, note=f"our engine cannot run the candidate's precisions "
                               f"({precision_label(cand_prec)})" + (f"; {why}" if why else ""))
    # the reference is its own twin when it made its own trace at the candidate's precisions
    return CalibPlan(True, factor, cand_prec, twin_is_ref=not differ, maker=maker, by_other=maker != ref_engine)


def record_calibration(ref_side, plan: CalibPlan, golden_path: str, twin_path: str, *, force: bool = False,
                       progress: SideProgress | None = None, snapshot=None,
                       routing: dict | None = None) -> tuple[str, str | None]:
    """Record the golden (and the twin) of ``ref_side`` for the plan's candidate precisions, by the plan's maker;
    ``routing``: experts to force, in the reference's samples (routing replay: every side takes the same)."""
    from . import sides  # the engine (torch): imported when a side runs
    made = sides.calibration_sides(ref_side, plan.cand_prec, plan.twin_is_ref, plan.label, plan.maker)
    paths = []
    for side, path, label in ((made.golden, golden_path, "golden (float64)"),
                              (made.twin, twin_path, f"twin ({plan.label})")):
        if side is None:
            paths.append(None)
            continue
        prep = sides.prepare(side, snapshot, routing=routing)
        paths.append(sides.record_side(prep, path, "full", force, progress=progress_for(progress, label)))
    return paths[0], paths[1]


def engine_of(meta: dict) -> str:
    eng = meta.get("engine")
    return str(eng.get("name") or OURS) if isinstance(eng, dict) else OURS


def plan_for(ref, cand, judging: Judging, *, explicit: bool, level: str, twin_is_cand: bool = False) -> CalibPlan:
    """The calibration plan from what the two traces record (or, in lockstep, the two recorders' meta): their
    precisions and engines."""
    return plan_calibration(precisions(ref.meta), precisions(cand.meta), calibrate=judging.calibrate,
                            explicit=explicit, level=level, factor=judging.factor, twin_is_cand=twin_is_cand,
                            ref_engine=engine_of(ref.meta), cand_engine=engine_of(cand.meta))


def siblings_beside(ref_path: str, plan: CalibPlan) -> tuple[str, str | None] | None:
    """(golden path, twin path or None) recorded beside REF for the plan's precisions, or None if absent."""
    golden, twin = sibling_paths(ref_path)
    twin = None if plan.twin_is_ref else twin.format(key=precision_key(plan.cand_prec))
    if os.path.isfile(golden) and (twin is None or os.path.isfile(twin)):
        return golden, twin
    return None
