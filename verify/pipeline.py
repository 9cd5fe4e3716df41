"""The whole job in one call: prepare both sides, record both traces, compare them.

This is the top of the data flow (config -> engine -> dumps -> verify); the CLI only
parses options, calls these functions and renders the result.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from ..dumps.capture import capture, record
from ..dumps.ranks import is_rank_set, open_any  # a trace file, or a directory of rank traces
from ..dumps.reader import LiveTrace, Trace
from ..dumps.recorder import Recorder
from ..engine.errors import PrefillDiffError
from .calibrate import (DEFAULT_FACTOR, Calibration, precision_key, precision_label, precisions, same_precisions,
                        sibling_paths, unit_roundoff)
from .policy_file import policy_spec, resolve_policy, spec_sources
from .report import Report, Session, compare_traces


@dataclass
class Outcome:
    report: Report
    ref_path: str | None = None
    cand_path: str | None = None
    token_text: dict | None = None


def prepare_side(source: str, model=None, inputs=None):
    from ..engine.config import load_side
    from ..engine.runner import prepare
    return prepare(load_side(source, model, inputs))


def record_side(prep, path, level: str = "full", force: bool = False, compression=None, progress=None,
                in_memory: bool = False, tolerance: dict | None = None):
    """Record a prepared side; returns the path (or the open in-memory Recorder).

    ``tolerance`` (a policy spec) is stored in the trace: a baseline declares how it is to be compared.
    """
    if tolerance:
        resolve_policy(tolerance)  # refuse a bad declaration before recording
    if prep.side.run.tp > 1:  # tensor parallel: one process and one trace per rank, in a directory
        from ..dumps.ranks import record_ranks
        if in_memory:
            from ..engine.errors import ConfigError
            raise ConfigError("tensor-parallel runs record one trace file per rank: --fail-fast cannot run them")
        return record_ranks(prep, path, level, force, compression, {"tolerance": tolerance} if tolerance else None)
    rec = Recorder(path, level, force=force, compression=compression, in_memory=in_memory)
    try:
        record(prep, rec, progress=progress, extra_meta={"tolerance": tolerance} if tolerance else None)
    except BaseException:
        rec.abort()
        raise
    return rec if in_memory else str(path)


def _policy(policy_args, ref: Trace, cand: Trace):
    """Flags if given; otherwise None: the comparison uses the reference's declared tolerance or dtype defaults."""
    spec = policy_spec(**policy_args) if policy_args else None
    return None if spec is None else resolve_policy(spec, ref.meta, cand.meta, spec_sources(**policy_args))


def _explicit(policy_args) -> bool:
    return bool(policy_args) and policy_spec(**policy_args) is not None


def _token_text(*traces) -> dict | None:
    merged = {}
    for t in traces:
        merged.update(t.meta.get("token_text") or {})
    return merged or None


# -- calibration: decide, then record the golden and the twin ---------------------------------------------

@dataclass
class CalibPlan:
    """What a calibrated comparison needs besides REF and CAND; ``note`` says why it is off, if it is."""
    use: bool
    factor: float = DEFAULT_FACTOR
    cand_prec: dict | None = None
    twin_is_ref: bool = False  # same precisions: the reference is its own twin
    twin_is_cand: bool = False  # the candidate is the reference's own path at its precisions
    note: str | None = None


def plan_calibration(ref_prec: dict, cand_prec: dict, *, calibrate: bool | None, explicit: bool, level: str,
                     factor: float = DEFAULT_FACTOR, twin_is_cand: bool = False) -> CalibPlan:
    """calibrate None: automatic (on when the precisions differ); True: forced; False: off."""
    from ..engine.errors import ConfigError
    if not factor > 0:
        raise ConfigError(f"--noise-factor must be positive (got {factor})")
    differ = not same_precisions(ref_prec, cand_prec)
    if calibrate and explicit:
        raise ConfigError("--calibrate measures the tolerance; explicit --atol/--rtol/--ntol/--row-rtol/--policy/"
                          "--tolerance declare it: give one or the other")
    use = bool(calibrate) or (calibrate is None and differ and not explicit)
    if not use:
        return CalibPlan(False, factor, cand_prec)
    if level != "full":
        if calibrate:
            raise ConfigError(f"a calibrated comparison needs full traces (got --level {level})")
        return CalibPlan(False, factor, cand_prec, note=f"uncalibrated (--level {level} keeps no full rows)")
    return CalibPlan(True, factor, cand_prec, twin_is_ref=not differ, twin_is_cand=differ and twin_is_cand)


def calibration_sides(ref_side, cand_prec: dict, twin_is_ref: bool):
    """(golden side, twin side or None) of a calibrated comparison, from the reference's own side."""
    from dataclasses import replace
    from ..engine.config import at_precision, in_float64
    run = ref_side.run
    golden = replace(ref_side, run=in_float64(run, f"{ref_side.origin}, float64 golden"),
                     origin=f"{ref_side.origin} (float64 golden)")
    if twin_is_ref:
        return golden, None
    label = precision_label(cand_prec)
    twin = replace(ref_side, run=at_precision(run, cand_prec, f"{ref_side.origin} in {label}"),
                   origin=f"{ref_side.origin} (twin in {label})")
    return golden, twin


def _twin_is_cand(ref_prep, cand_prep, cand_prec: dict) -> bool:
    """The candidate is exactly the reference's path at the candidate's precisions (e.g. the bf16 preset)."""
    from dataclasses import replace
    from ..engine.config import at_precision
    twin = at_precision(ref_prep.side.run, cand_prec, "")
    return (replace(twin, name="") == replace(cand_prep.side.run, name="") and ref_prep.tokens == cand_prep.tokens
            and ref_prep.snapshot is cand_prep.snapshot)


def _rule_note(plan: CalibPlan) -> str | None:
    if plan.note:
        return plan.note
    if plan.use and plan.twin_is_cand:
        return (f"calibrated: the candidate is the reference's own path in {precision_label(plan.cand_prec)} (its "
                f"twin), so it adds no error beyond its numerics; numerics: candidate vs reference within the fixed "
                f"envelope")
    return None


def check_coverage(ref_tokens, cand_tokens, allow_subset: bool) -> None:
    """`run`: both sides must prefill the same requests; found before either side runs."""
    from ..engine.errors import ConfigError
    if allow_subset:
        return
    cand = set(map(tuple, cand_tokens))
    missing = [i for i, t in enumerate(ref_tokens) if tuple(t) not in cand]
    if missing:
        raise ConfigError(f"the two sides prefill different prompts: reference sample{'s' if len(missing) > 1 else ''} "
                          f"{missing} of {len(ref_tokens)} have no counterpart among the candidate's "
                          f"{len(cand_tokens)} (a config sets its own [inputs]?); pass --allow-subset to compare "
                          "the common ones")


def compare_files(ref_path, cand_path, policy_args=None, fail_fast: bool = False, *, calibrate: bool | None = None,
                  factor: float = DEFAULT_FACTOR, allow_subset: bool = False) -> Outcome:
    """Two trace files. A golden and twin recorded beside REF (`record --twin-of`) make the verdict calibrated."""
    with open_any(ref_path) as ref, open_any(cand_path) as cand:
        ref_prec, cand_prec = precisions(ref.meta), precisions(cand.meta)
        plan = plan_calibration(ref_prec, cand_prec, calibrate=calibrate, explicit=_explicit(policy_args),
                                level="full" if ref.level == cand.level == "full" else
                                ({ref.level, cand.level} - {"full"}).pop(), factor=factor)
        if calibrate is None and ref.meta.get("tolerance") is not None:
            plan = CalibPlan(False, factor, cand_prec)  # the baseline declares its tolerance
        paths = _sibling_calibration(str(ref_path), cand_prec, plan.twin_is_ref) if plan.use else None
        if plan.use and paths is None:
            if calibrate:
                from ..engine.errors import ConfigError
                g, t = sibling_paths(str(ref_path))
                raise ConfigError(f"--calibrate needs the golden and twin recorded beside {ref_path} "
                                  f"({g}, {t.format(key=precision_key(cand_prec))}): record them with "
                                  "`prefill-diff record CONFIG -o REF.h5 --twin-of PRECISION`")
            plan = CalibPlan(False, factor, cand_prec)
        if not plan.use:
            report = compare_traces(ref, cand, _policy(policy_args, ref, cand), fail_fast=fail_fast,
                                    allow_subset=allow_subset, rule_note=plan.note)
            return Outcome(report, str(ref_path), str(cand_path), _token_text(ref, cand))
        with open_any(paths[0]) as golden, (open_any(paths[1]) if paths[1] else _Null()) as twin:
            calib = Calibration(golden, twin, factor, unit_roundoff(cand_prec), precision_label(cand_prec))
            report = compare_traces(ref, cand, None, fail_fast=fail_fast, calib=calib, allow_subset=allow_subset)
            return Outcome(report, str(ref_path), str(cand_path), _token_text(ref, cand))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _sibling_calibration(ref_path: str, cand_prec: dict, twin_is_ref: bool):
    """(golden path, twin path or None) recorded beside REF for these precisions, or None if absent."""
    golden, twin = sibling_paths(ref_path)
    twin = None if twin_is_ref else twin.format(key=precision_key(cand_prec))
    if os.path.isfile(golden) and (twin is None or os.path.isfile(twin)):
        return golden, twin
    return None


def record_calibration(ref_side, cand_prec: dict, out_dir: str, *, twin_is_ref: bool, force: bool = False,
                       progress=None, snapshot=None, golden_path=None, twin_path=None) -> tuple[str, str | None]:
    """Record the golden (and the twin) of ``ref_side`` for a candidate of precisions ``cand_prec``."""
    from ..engine.runner import prepare
    golden_side, twin_side = calibration_sides(ref_side, cand_prec, twin_is_ref)
    golden = record_side(prepare(golden_side, snapshot), golden_path or os.path.join(out_dir, "golden.h5"), "full",
                         force, progress=None if progress is None else progress("golden (float64)"))
    twin = None
    if twin_side is not None:
        twin = record_side(prepare(twin_side, snapshot), twin_path or os.path.join(out_dir, "twin.h5"), "full", force,
                           progress=None if progress is None else progress(f"twin ({precision_label(cand_prec)})"))
    return golden, twin


def run_pair(ref_source: str, cand_source: str, model=None, inputs=None, *, out_dir: str | None = None,
             level: str = "full", force: bool = False, policy_args=None, progress=None,
             calibrate: bool | None = None, factor: float = DEFAULT_FACTOR, allow_subset: bool = False) -> Outcome:
    """Record REF and CAND (into out_dir, or a temporary directory removed afterwards) and compare.

    When their precisions differ (or ``calibrate`` is True) the reference's path is also recorded in float64
    (the golden) and at the candidate's precisions (the twin), and the verdict is calibrated
    (verify/calibrate.py); explicit tolerance flags switch that off.
    """
    from ..engine.config import precision_of
    ref_prep = prepare_side(ref_source, model, inputs)
    cand_prep = prepare_side(cand_source, model, inputs)
    check_coverage(ref_prep.tokens, cand_prep.tokens, allow_subset)
    cand_prec = precision_of(cand_prep.side.run)
    plan = plan_calibration(precision_of(ref_prep.side.run), cand_prec, calibrate=calibrate,
                            explicit=_explicit(policy_args), level=level, factor=factor,
                            twin_is_cand=_twin_is_cand(ref_prep, cand_prep, cand_prec))
    tmp = None
    if out_dir is None:
        tmp = out_dir = tempfile.mkdtemp(prefix="prefill-diff-")
    else:
        os.makedirs(out_dir, exist_ok=True)
    try:
        ref_path = record_side(ref_prep, os.path.join(out_dir, "ref.h5"), level, force,
                               progress=None if progress is None else progress("reference"))
        cand_path = record_side(cand_prep, os.path.join(out_dir, "cand.h5"), level, force,
                                progress=None if progress is None else progress("candidate"))
        if plan.use and not plan.twin_is_cand:
            gold, twin = record_calibration(ref_prep.side, cand_prec, out_dir, twin_is_ref=plan.twin_is_ref,
                                            force=force, progress=progress, snapshot=ref_prep.snapshot)
            with open_any(ref_path) as ref, open_any(cand_path) as cand, open_any(gold) as golden, \
                    (open_any(twin) if twin else _Null()) as tw:
                calib = Calibration(golden, tw, factor, unit_roundoff(cand_prec), precision_label(cand_prec))
                report = compare_traces(ref, cand, None, calib=calib, allow_subset=allow_subset)
                outcome = Outcome(report, ref_path, cand_path, _token_text(ref, cand))
        else:
            with open_any(ref_path) as ref, open_any(cand_path) as cand:
                report = compare_traces(ref, cand, _policy(policy_args, ref, cand), allow_subset=allow_subset,
                                        rule_note=_rule_note(plan))
                outcome = Outcome(report, ref_path, cand_path, _token_text(ref, cand))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if tmp is not None:  # the traces are gone: reports must not point at them
        outcome.ref_path = outcome.cand_path = None
        outcome.report.ref["file"] = outcome.report.cand["file"] = None
    return outcome


def baseline_side(base: Trace, model=None, inputs=None):
    """The baseline's own side (model, prompts, run config), to record its golden and twin from."""
    from ..engine.config import Inputs, Side, run_from_dict
    from ..engine.spec import ModelSpec
    spec = model or ModelSpec(**_spec_of(base))
    ins = inputs or Inputs(token_ids=tuple(base.samples))
    run = run_from_dict((base.meta.get("side") or {}).get("run"), f"{base.name}: recorded run configuration")
    return Side(spec, ins, run, (base.meta.get("side") or {}).get("origin") or "baseline")


def compare_with(baseline: str, candidate: str, model=None, inputs=None, *, fail_fast: bool = False,
                 policy_args=None, level: str | None = None, calibrate: bool | None = None,
                 factor: float = DEFAULT_FACTOR, allow_subset: bool = False) -> Outcome:
    """CI gate: BASELINE.h5 against a trace file, or against a preset/config recorded now."""
    if (os.path.isfile(candidate) and not candidate.endswith(".toml")) or is_rank_set(candidate):
        return compare_files(baseline, candidate, policy_args, fail_fast, calibrate=calibrate, factor=factor,
                             allow_subset=allow_subset)
    from ..engine.config import Inputs, precision_of
    from ..engine.spec import ModelSpec
    with open_any(baseline) as base:
        spec = model or ModelSpec(**_spec_of(base))
        inputs = inputs or Inputs(token_ids=tuple(base.samples))
        level = level or base.level
        base_prec, declared = precisions(base.meta), base.meta.get("tolerance") is not None
        base_meta_side, base_err = None, None
        try:
            base_meta_side = baseline_side(base, spec, inputs)
        except PrefillDiffError as e:  # an old or foreign baseline without a usable run record: no twin
            base_err = str(e)
    prep = prepare_side(candidate, spec, inputs)
    cand_prec = precision_of(prep.side.run)
    # the baseline's declared tolerance wins unless --calibrate asks otherwise
    plan = plan_calibration(base_prec, cand_prec, calibrate=False if calibrate is None and declared else calibrate,
                            explicit=_explicit(policy_args), level=level, factor=factor)
    if plan.use and base_meta_side is None:
        if calibrate:
            raise PrefillDiffError(f"cannot calibrate against {baseline}: {base_err}")
        plan = CalibPlan(False, factor, cand_prec)
    tmp = tempfile.mkdtemp(prefix="prefill-diff-")
    try:
        path = record_side(prep, os.path.join(tmp, "cand.h5"), level)
        siblings = _sibling_calibration(baseline, cand_prec, plan.twin_is_ref) if plan.use else None
        if plan.use and siblings is None:
            siblings = record_calibration(base_meta_side, cand_prec, tmp, twin_is_ref=plan.twin_is_ref,
                                          snapshot=prep.snapshot if prep.side.model == spec else None)
        if plan.use:
            with open_any(baseline) as ref, open_any(path) as cand, open_any(siblings[0]) as golden, \
                    (open_any(siblings[1]) if siblings[1] else _Null()) as tw:
                calib = Calibration(golden, tw, factor, unit_roundoff(cand_prec), precision_label(cand_prec))
                report = compare_traces(ref, cand, None, fail_fast=fail_fast, calib=calib, allow_subset=allow_subset)
                outcome = Outcome(report, baseline, None, _token_text(ref, cand))
        else:
            outcome = compare_files(baseline, path, policy_args, fail_fast, calibrate=False, allow_subset=allow_subset)
        outcome.cand_path = None
        outcome.report.cand["file"] = None  # recorded into a temporary file, removed below
        return outcome
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _spec_of(trace: Trace) -> dict:
    """The baseline's model spec, so a config recorded against it uses the same model."""
    spec = trace.model.get("spec") or {}
    out = {"source": spec.get("source", trace.model.get("source", "synthetic")), "seed": spec.get("seed", 0)}
    if spec.get("overrides"):
        out["overrides"] = tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                        for k, v in spec["overrides"].items()))
    if spec.get("adapter"):
        out["adapter"] = tuple(sorted(spec["adapter"].items()))
    return out


def run_lockstep(ref_source: str, cand_source: str, model=None, inputs=None, *, level: str = "full",
                 policy_args=None, calibrate: bool | None = None, factor: float = DEFAULT_FACTOR,
                 allow_subset: bool = False) -> Outcome:
    """run --fail-fast: both sides advance one layer at a time into in-memory traces; stop at the first break.

    Nothing is written to disk, and the work after the breaking layer is never done. A calibrated comparison
    runs its golden and twin in the same lockstep.
    """
    from ..engine.config import precision_of
    from ..engine.runner import prepare
    preps = [prepare_side(ref_source, model, inputs), prepare_side(cand_source, model, inputs)]
    if any(p.side.run.tp > 1 for p in preps):
        from ..engine.errors import ConfigError
        raise ConfigError("--fail-fast runs both sides in lockstep in this process; a tensor-parallel side "
                          "(tp > 1) runs in its own processes: drop --fail-fast")
    check_coverage(preps[0].tokens, preps[1].tokens, allow_subset)
    cand_prec = precision_of(preps[1].side.run)
    plan = plan_calibration(precision_of(preps[0].side.run), cand_prec, calibrate=calibrate,
                            explicit=_explicit(policy_args), level=level, factor=factor,
                            twin_is_cand=_twin_is_cand(preps[0], preps[1], cand_prec))
    names = [f"{ref_source} (in memory)", f"{cand_source} (in memory)"]
    calibrated = plan.use and not plan.twin_is_cand
    if calibrated:
        golden, twin = calibration_sides(preps[0].side, cand_prec, plan.twin_is_ref)
        for side in (golden, twin):
            if side is not None:
                preps.append(prepare(side, preps[0].snapshot))
                names.append(f"{side.origin} (in memory)")
    recs = [Recorder(None, level) for _ in preps]
    gens = [capture(p, r) for p, r in zip(preps, recs)]
    try:
        for g in gens:
            next(g)
        traces = [LiveTrace(r, n) for r, n in zip(recs, names)]
        calib = None
        if calibrated:
            calib = Calibration(traces[2], traces[3] if len(traces) > 3 else None, factor, unit_roundoff(cand_prec),
                                precision_label(cand_prec))
        session = Session(traces[0], traces[1], None if calibrated else _policy(policy_args, *traces[:2]), calib,
                          allow_subset, None if calibrated else _rule_note(plan))
        if session.metadata_failed:
            return Outcome(session.finish(stopped_early=True))
        n_layers = traces[0].n_layers
        for layer in range(n_layers):
            if layer:
                for g in gens:
                    next(g)
            lr = session.add_layer(layer)
            if lr.first_break is not None and layer < n_layers - 1:
                return Outcome(session.finish(stopped_early=True), token_text=_token_text(*traces[:2]))
        for g in gens:
            for _ in g:
                raise RuntimeError("a side yielded more layers than its model has")
        for t in traces:
            t.refresh()
        return Outcome(session.finish(), token_text=_token_text(*traces[:2]))
    finally:
        for g in gens:
            g.close()
        for r in recs:
            r.abort()
