"""The jobs of prefill-diff: ``run``, ``record`` and ``compare``, as plain functions — the Python API.

The CLI parses its options, calls one of these and renders what it returns; a Python program can call them
the same way (README, "From Python"). Data flows one way: a side is prepared by the engine and recorded into
a trace (``sides.py``), and two traces are compared by ``verify/``. The tolerance policy is resolved here,
once, and passed down; whether traces are kept is known before the report is built; ``calibration.py``
decides whether a comparison is calibrated and records its golden and twin; ``options.py`` holds the types a
job takes and returns.

``sides.py`` imports the engine (and torch); it is imported only when a side runs, so comparing two trace
files never loads torch.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from typing import Callable

from ..dumps.provenance import timestamp
from ..dumps.rank_merge import is_rank_set, open_any
from ..dumps.reader import LiveTrace, Trace
from ..dumps.recorder import Recorder
from ..dumps.schema import FULL_LEVELS, LEVELS
from ..engine.shared.errors import ConfigError, PrefillDiffError
from ..engine.registry import ENGINES, missing_packages, twin_maker
from ..verify.calibrate import precision_key, precision_label, precisions, same_precisions, sibling_paths
from ..verify.policy_file import resolve_policy
from ..verify.report import Report, Session, compare_traces
from ..verify.routing import forced_routing, replay_cells, wants_replay
from .calibration import (CalibPlan, check_calibration, engine_of, plan_calibration, plan_for, record_calibration,
                          siblings_beside)
from .replay import check_replay, replay_ops
from .options import (JUDGED, Judging, Outcome, Recorded, SideProgress, Tolerance, phase, progress_for,
                      resolve)

__all__ = ["run", "record", "compare", "compare_files", "run_lockstep", "load_sides", "check_tolerance",
           "is_trace", "Outcome", "Recorded", "Tolerance", "Judging", "JUDGED", "CalibPlan", "record_calibration",
           "plan_calibration"]


def _import_sides():
    """The half of a job that runs the engine (sides.py: torch), imported when a side runs."""
    from . import sides
    return sides


def load_sides(*sources: str, model=None, inputs=None) -> list:
    """Each preset or config file read and checked now, before the engine (torch) is imported, so that a typo or a
    bad value is said at once; returns their sides."""
    from ..engine.config import load_side  # plain data: no torch
    return [load_side(source, model, inputs) for source in sources]


def check_coverage(ref_tokens, cand_tokens, allow_subset: bool) -> None:
    """`run`: both sides must prefill the same requests; found before either side runs."""
    if allow_subset:
        return
    cand = set(map(tuple, cand_tokens))
    missing = [i for i, t in enumerate(ref_tokens) if tuple(t) not in cand]
    if missing:
        raise ConfigError(f"the two sides prefill different prompts: reference sample{'s' if len(missing) > 1 else ''} "
                          f"{missing} of {len(ref_tokens)} have no counterpart among the candidate's "
                          f"{len(cand_tokens)} (a config sets its own [inputs]?); pass --allow-subset to compare "
                          "the common ones")


def _judge_open(ref: Trace, cand: Trace, judging: Judging, plan: CalibPlan, siblings, *,
                kept=(True, True)) -> Report:
    """Compare two open traces, opening the golden and twin of a calibrated plan.

    ``kept``: (REF, CAND), False for a temporary trace (the report names no file for it)."""
    with ExitStack() as stack:
        calib = None
        if plan.use and siblings is not None:
            golden = stack.enter_context(open_any(siblings[0]))
            twin = stack.enter_context(open_any(siblings[1])) if siblings[1] else None
            calib = plan.calibration(golden, twin)
        files = (ref.name if kept[0] else None, cand.name if kept[1] else None)
        policy = resolve(None if calib else judging.tolerance, ref, cand)
        return compare_traces(ref, cand, policy,
                              fail_fast=judging.fail_fast, calib=calib, allow_subset=judging.allow_subset,
                              allow_identity=judging.allow_identity, exact=judging.exact,
                              rule_note=None if calib else plan.rule_note(policy),
                              uncalibrated=None if calib else plan.note, files=files)


# -- the three jobs ----------------------------------------------------------------------------------------

def run(ref: str, cand: str, model=None, inputs=None, *, out_dir: str | None = None, level: str = "full",
        force: bool = False, judging: Judging = JUDGED, progress: SideProgress | None = None) -> Outcome:
    """Prefill REF and CAND (presets or config files), record both traces, compare them.

    Traces go into ``out_dir`` (kept) or a temporary directory (removed). When either side computes below
    float32, or their precisions differ (or ``calibrate`` is True), the reference's path is also recorded in
    float64 (the golden) and at the candidate's precisions (the twin), and the verdict is calibrated;
    ``judging.tolerance`` declares a fixed rule instead. ``judging.fail_fast`` runs the sides in lockstep in
    memory and stops at the first break (no trace files).
    """
    timestamp()  # a bad SOURCE_DATE_EPOCH is refused before any model loads
    ref_side, cand_side = load_sides(ref, cand, model=model, inputs=inputs)
    if judging.fail_fast:
        if out_dir:
            raise ConfigError("--fail-fast keeps no traces; drop --out")
        return run_lockstep(ref, cand, model, inputs, level=level, judging=judging)
    explicit = judging.tolerance.declared
    check_calibration(judging, explicit=explicit, level=level)
    if judging.replay_ops:
        check_replay(cand_side.run.engine)
    sides = _import_sides()
    for side in (ref_side, cand_side):  # either engine's missing package is said before any model loads
        missing_packages(side.run.info)
    if inputs is not None and inputs.response_tokens:  # the candidate chooses the response both sides then see
        phase(progress, "choosing the response (the candidate's greedy tokens)")
        inputs = sides.choose_response(cand, model, inputs)
        ref_side, cand_side = load_sides(ref, cand, model=model, inputs=inputs)
    phase(progress, "loading the model and preparing both sides")
    ref_prep, cand_prep = sides.prepare(ref_side), sides.prepare(cand_side)
    check_coverage(ref_prep.tokens, cand_prep.tokens, judging.allow_subset)
    keep = out_dir is not None
    work = out_dir if keep else tempfile.mkdtemp(prefix="prefill-diff-")
    os.makedirs(work, exist_ok=True)
    lock = _hold_out_dir(work) if keep else None
    try:
        paths = [sides.record_side(p, os.path.join(work, name), level, force, progress=progress_for(progress, label))
                 for p, name, label in ((ref_prep, "ref.h5", "reference"), (cand_prep, "cand.h5", "candidate"))]
        with open_any(paths[0]) as r, open_any(paths[1]) as c:
            plan = plan_for(r, c, judging, explicit=explicit, level=level,
                             twin_is_cand=sides.twin_is_cand(ref_prep, cand_prep))
            siblings = None
            if plan.use and not plan.twin_is_cand:
                siblings = record_calibration(ref_prep.side, plan, os.path.join(work, "golden.h5"),
                                              os.path.join(work, "twin.h5"), force=force, progress=progress,
                                              snapshot=ref_prep.snapshot)
            phase(progress, "comparing")
            report = _judge_open(r, c, judging, plan, siblings, kept=(keep, keep))
            forced, forced_ref, rounds, flips = {}, {}, 0, 0
            while _replays(cand_prep) and rounds < REPLAY_ROUNDS and wants_replay(report, forced):
                # routing replay: the candidate again, the reference's experts forced at its near ties
                flips += len(report.unreplayed)
                forced = forced_routing(replay_cells(report), forced)
                forced_ref = forced_routing(replay_cells(report), forced_ref, side="reference")
                again = sides.prepare_side(cand, model, inputs, routing=forced)
                paths[1] = sides.record_side(again, os.path.join(work, f"cand-replay{rounds + 1}.h5"), level, force,
                                           progress=progress_for(progress, "candidate, routing replayed"))
                rounds += 1
                if siblings is not None:  # the golden and the twin take the same experts there
                    siblings = record_calibration(ref_prep.side, plan, os.path.join(work, f"golden-replay{rounds}.h5"),
                                                  os.path.join(work, f"twin-replay{rounds}.h5"), force=force,
                                                  progress=progress, snapshot=ref_prep.snapshot,
                                                  routing=forced_ref)
                phase(progress, "comparing")
                with open_any(paths[1]) as c2:
                    report = _judge_open(r, c2, judging, plan, siblings, kept=(keep, keep))
            if rounds:
                report = replace(report, replayed=_replayed(forced), replayed_flips=flips)
            if judging.replay_ops:
                phase(progress, "replaying the candidate's ops on the reference's inputs")
                with open_any(paths[1]) as c2:
                    report = replace(report, replay=replay_ops(r, c2, cand_prep, report.exact))
    finally:
        if lock is not None:
            os.close(lock)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return Outcome(report, *(paths if keep else (None, None)))


OUT_LOCK = ".prefill-diff.lock"  # in a run's --out directory, held while the run writes and reads its traces


def _hold_out_dir(out_dir: str) -> int:
    """An exclusive lock on ``out_dir`` for this run (a lock file inside it; the descriptor is returned): a second
    run into the same directory at the same time would overwrite the traces this one is judging."""
    path = os.path.join(out_dir, OUT_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: cannot create its lock file ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"--out {out_dir} is being written by another prefill-diff run now; give this run its own "
                          "--out directory") from None
    except OSError:
        pass  # a file system without locks: run unlocked
    return fd


REPLAY_ROUNDS = 3  # a replayed run may flip elsewhere within noise: each round forces those too


def _replays(prep) -> bool:
    """The side's engine can force a mixture of experts' routing (and the model has experts)."""
    return ENGINES[prep.side.run.engine].replays_routing and bool(prep.snapshot.args.n_experts)


def _replayed(forced: dict) -> tuple:
    return tuple({"layer": layer, "sample": s, "position": t, "experts": list(ids)}
                 for layer, cells in sorted(forced.items()) for (s, t), ids in sorted(cells.items()))


def check_tolerance(tolerance: Tolerance | None) -> dict | None:
    """The declared tolerance as a spec to store, refused now if bad."""
    spec = tolerance.spec() if tolerance is not None else None
    if spec:
        resolve_policy(spec)
    return spec


def record(config: str, output: str, model=None, inputs=None, *, level: str = "full", compression=None,
           force: bool = False, tolerance: Tolerance | None = None, twin_of: str | None = None,
           progress: SideProgress | None = None, on_written: Callable[[Recorded], None] | None = None) -> Recorded:
    """Prefill CONFIG and write its trace to OUTPUT (a tensor-parallel side: a directory of rank traces).

    ``tolerance`` is stored in the trace (a baseline declares how it is compared). ``twin_of`` (a preset or
    config) also records the float64 golden and the twin at its precisions beside the trace; ``on_written``
    is called once the trace itself is complete, before them.
    """
    spec = check_tolerance(tolerance)  # before the model loads
    timestamp()
    if twin_of is not None and level not in FULL_LEVELS:
        raise ConfigError(f"--twin-of records full golden and twin traces; it needs --level full (got {level})")
    side, = load_sides(config, model=model, inputs=inputs)
    sides = _import_sides()
    if inputs is not None and inputs.response_tokens:  # the recorded side chooses its own response
        inputs = sides.choose_response(config, model, inputs, who="self")
        side, = load_sides(config, model=model, inputs=inputs)
    phase(progress, "loading the model")
    prep = sides.prepare(side)
    path = sides.record_side(prep, output, level, force, compression, progress=progress_for(progress, "recording"),
                           tolerance=spec)
    done = Recorded(str(path), level, prep.snapshot.args.n_layers, len(prep.tokens))
    if on_written is not None:
        on_written(done)
    if twin_of is None:
        return done
    prec = sides.precisions_of(twin_of, model, inputs)
    with open_any(done.path) as t:
        own, engine = precisions(t.meta), engine_of(t.meta)
    maker = twin_maker(engine, prec)
    if maker is None:
        raise ConfigError(f"--twin-of {twin_of}: no engine of ours runs {precision_label(prec)} (a golden in float64 "
                          "and a twin at those precisions), so a comparison against it cannot be calibrated")
    plan = CalibPlan(True, cand_prec=prec, twin_is_ref=same_precisions(prec, own), maker=maker,
                     by_other=maker != engine)
    golden, twin = sibling_paths(done.path)  # beside what was written (a tensor-parallel side: its directory)
    got = record_calibration(prep.side, plan, golden, twin.format(key=precision_key(prec)), force=force,
                             snapshot=prep.snapshot)
    return Recorded(done.path, level, done.n_layers, done.n_samples, got[0], got[1], plan.label)


def is_trace(path: str) -> bool:
    """A trace file or a directory of rank traces (not a preset name or a config file)."""
    return (os.path.isfile(path) and not path.endswith(".toml")) or is_rank_set(path)


def compare(baseline: str, candidate: str, model=None, inputs=None, *, level: str | None = None,
            judging: Judging = JUDGED, progress: SideProgress | None = None) -> Outcome:
    """BASELINE (a trace) against CANDIDATE: a trace, or a preset/config recorded now with the baseline's
    model and prompts (unless ``model``/``inputs`` are given). A golden and twin recorded beside BASELINE
    (`record --twin-of`) make the verdict calibrated; for a candidate recorded now they are recorded too."""
    timestamp()  # a bad SOURCE_DATE_EPOCH is refused before any model loads
    if is_trace(candidate):
        return compare_files(baseline, candidate, judging, progress)
    return _compare_recorded(baseline, candidate, model, inputs, level, judging, progress)


def _declared_by(ref: Trace, judging: Judging) -> bool:
    """A declared rule: the flags', or the baseline's own unless --calibrate asks otherwise."""
    return judging.tolerance.declared or (judging.calibrate is None and ref.meta.get("tolerance") is not None)


def compare_files(ref_path, cand_path, judging: Judging = JUDGED, progress: SideProgress | None = None) -> Outcome:
    """Two trace files. A golden and twin recorded beside REF (`record --twin-of`) make the verdict calibrated."""
    with open_any(ref_path) as ref, open_any(cand_path) as cand:
        phase(progress, "comparing")
        plan = plan_for(ref, cand, judging, explicit=_declared_by(ref, judging),
                         level=max(ref.level, cand.level, key=LEVELS.index))
        siblings = siblings_beside(str(ref_path), plan) if plan.use else None
        if plan.use and siblings is None:
            g, t = sibling_paths(str(ref_path))
            key = precision_key(plan.cand_prec)
            if judging.calibrate:
                raise ConfigError(f"--calibrate needs the golden and twin recorded beside {ref_path} "
                                  f"({g}, {t.format(key=key)}): record them with "
                                  "`prefill-diff record CONFIG -o REF.h5 --twin-of PRECISION`")
            plan = plan.declined(f"no golden and twin beside {ref_path}: record it with --twin-of {key} to "
                                 "calibrate")
        report = _judge_open(ref, cand, judging, plan, siblings)
    return Outcome(report, str(ref_path), str(cand_path))


def _compare_recorded(baseline: str, candidate: str, model, inputs, level: str | None, judging: Judging,
                      progress: SideProgress | None = None) -> Outcome:
    """``compare BASELINE PRESET``: record the candidate (and, calibrated, the baseline's golden and twin)
    into a temporary directory, with the baseline's model and prompts, and compare."""
    load_sides(candidate)  # a typo is said before the baseline is read
    sides = _import_sides()
    with open_any(baseline) as base:
        side, why_not = None, None
        try:  # the baseline's own side, to record its golden and twin from
            side = sides.baseline_side(base.meta, base.name, base.samples, model, inputs)
        except PrefillDiffError as e:  # an old or foreign baseline without a usable run record: no twin
            why_not = str(e)
        spec = model or sides.baseline_spec(base.meta)
        ins = inputs or sides.Inputs(token_ids=tuple(base.samples))
        level = level or base.level
    check_calibration(judging, explicit=judging.tolerance.declared, level=level)
    if judging.calibrate and side is None:
        raise PrefillDiffError(f"cannot calibrate against {baseline}: {why_not}")
    cand_side = sides.load_side(candidate, spec, ins)
    phase(progress, f"loading the model to record {candidate} with the baseline's prompts")
    prep = sides.prepare(cand_side)
    tmp = tempfile.mkdtemp(prefix="prefill-diff-")
    try:
        path = sides.record_side(prep, os.path.join(tmp, "cand.h5"), level,
                                 progress=progress_for(progress, "candidate"))
        with open_any(baseline) as ref, open_any(path) as cand:
            plan = plan_for(ref, cand, judging, explicit=_declared_by(ref, judging), level=level)
            siblings = siblings_beside(baseline, plan) if plan.use else None
            if plan.use and siblings is None and side is None:  # judged with the fixed envelope; the rule says why
                plan = plan.declined(f"the baseline's own run cannot be rebuilt: {why_not}")
            elif plan.use and siblings is None:
                siblings = record_calibration(side, plan, os.path.join(tmp, "golden.h5"),
                                              os.path.join(tmp, "twin.h5"), progress=progress,
                                              snapshot=prep.snapshot if prep.side.model == spec else None)
            phase(progress, "comparing")
            report = _judge_open(ref, cand, judging, plan, siblings, kept=(True, False))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Outcome(report, baseline, None)


def run_lockstep(ref: str, cand: str, model=None, inputs=None, *, level: str = "full",
                 judging: Judging = JUDGED) -> Outcome:
    """run --fail-fast: both sides advance one layer at a time into in-memory traces; stop at the first break.

    Nothing is written to disk, and the work after the breaking layer is never done. A calibrated comparison
    runs its golden and twin in the same lockstep, planned once both sides have recorded their first layer
    (by then each engine has said what precisions it ran). Routing flips within noise are replayed as ``run``
    replays them: the whole lockstep again, the candidate's router forced at those tokens.
    """
    inputs = _import_sides().choose_response(cand, model, inputs)  # the candidate's own response, for both sides
    out = _run_lockstep(ref, cand, model, inputs, level, judging)
    forced, forced_ref, rounds, flips = {}, {}, 0, 0
    while out.replays and rounds < REPLAY_ROUNDS and wants_replay(out.report, forced):
        flips += len(out.report.unreplayed)
        forced = forced_routing(replay_cells(out.report), forced)
        forced_ref = forced_routing(replay_cells(out.report), forced_ref, side="reference")
        out = _run_lockstep(ref, cand, model, inputs, level, judging, routing=(forced, forced_ref))
        rounds += 1
    if rounds:
        out = replace(out, report=replace(out.report, replayed=_replayed(forced), replayed_flips=flips))
    return out


def _run_lockstep(ref: str, cand: str, model, inputs, level: str, judging: Judging,
                  routing: tuple | None = None) -> Outcome:
    """run_lockstep once; ``routing``: the experts to force (the candidate's samples, the reference's) or None."""
    explicit = judging.tolerance.declared
    check_calibration(judging, explicit=explicit, level=level)
    sides = _import_sides()
    forced, forced_ref = routing or ({}, {})
    preps = [sides.prepare_side(ref, model, inputs), sides.prepare_side(cand, model, inputs, routing=forced)]
    if any(p.side.run.tp > 1 for p in preps):
        raise ConfigError("--fail-fast runs both sides in lockstep in this process; a tensor-parallel side "
                          "(tp > 1) runs in its own processes: drop --fail-fast")
    check_coverage(preps[0].tokens, preps[1].tokens, judging.allow_subset)
    twin_is_cand = sides.twin_is_cand(*preps)
    names = [f"{ref} (in memory)", f"{cand} (in memory)"]
    recs, gens = [], []
    try:
        for p in preps:
            _start(sides, p, level, recs, gens)
        plan = plan_for(recs[0], recs[1], judging, explicit=explicit, level=level, twin_is_cand=twin_is_cand)
        calibrated = plan.use and not plan.twin_is_cand
        if calibrated:
            made = sides.calibration_sides(preps[0].side, plan.cand_prec, plan.twin_is_ref, plan.label, plan.maker)
            for side in (made.golden, made.twin):
                if side is not None:
                    prep = sides.prepare(side, preps[0].snapshot, routing=forced_ref)  # every side: the same experts
                    _start(sides, prep, level, recs, gens)
                    names.append(f"{side.origin} (in memory)")
        return Outcome(_lockstep(gens, recs, names, plan, calibrated, judging), replays=_replays(preps[1]))
    finally:
        for g in gens:
            g.close()
        for r in recs:
            r.abort()


def _start(sides, prep, level: str, recs: list, gens: list) -> None:
    """A side's in-memory recorder and generator, advanced through its first layer."""
    recs.append(Recorder(None, level))
    gens.append(sides.capture(prep, recs[-1]))
    next(gens[-1])


def _lockstep(gens, recs, names, plan: CalibPlan, calibrated: bool, judging: Judging) -> Report:
    """Every side has recorded layer 0: compare it, then advance every side one layer at a time; stop at the
    first break."""
    traces = [LiveTrace(r, n) for r, n in zip(recs, names)]
    calib = plan.calibration(traces[2], traces[3] if len(traces) > 3 else None) if calibrated else None
    policy = resolve(None if calib else judging.tolerance, *traces[:2])
    session = Session(traces[0], traces[1], policy, calib, judging.allow_subset,
                      None if calib else plan.rule_note(policy), uncalibrated=None if calib else plan.note,
                      allow_identity=judging.allow_identity, in_memory=True, exact=judging.exact)
    if session.metadata_failed:
        return session.finish(stopped_early=True)
    n_layers = traces[0].n_layers
    for layer in range(n_layers):
        if layer:
            for g in gens:
                next(g)
        if session.add_layer(layer).first_break is not None and layer < n_layers - 1:
            return session.finish(stopped_early=True)
    for g in gens:
        for _ in g:
            raise RuntimeError("a side yielded more layers than its model has")
    for t in traces:
        t.refresh()
    return session.finish()
