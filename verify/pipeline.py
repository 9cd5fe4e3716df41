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
from ..dumps.reader import LiveTrace, Trace
from ..dumps.recorder import Recorder
from .policy_file import policy_spec, resolve_policy
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
    return None if spec is None else resolve_policy(spec, ref.meta, cand.meta)


def _token_text(*traces) -> dict | None:
    merged = {}
    for t in traces:
        merged.update(t.meta.get("token_text") or {})
    return merged or None


def compare_files(ref_path, cand_path, policy_args=None, fail_fast: bool = False) -> Outcome:
    from ..dumps.ranks import open_any  # a trace file, or a directory of rank traces
    with open_any(ref_path) as ref, open_any(cand_path) as cand:
        report = compare_traces(ref, cand, _policy(policy_args, ref, cand), fail_fast=fail_fast)
        return Outcome(report, str(ref_path), str(cand_path), _token_text(ref, cand))


def float64_side(source: str, model=None, inputs=None):
    """The same execution path as ``source``, in float64 (the golden run of --calibrate)."""
    from dataclasses import replace
    from ..engine.config import load_side
    from ..engine.runner import prepare
    side = load_side(source, model, inputs)
    run = side.run
    layout = run.cache.layout
    if layout.dtype not in (None, "int8"):
        layout = replace(layout, dtype=None)
    run = replace(run, numerical=replace(run.numerical, dtype="float64"), cache=replace(run.cache, layout=layout))
    return prepare(replace(side, run=run))


def run_pair(ref_source: str, cand_source: str, model=None, inputs=None, *, out_dir: str | None = None,
             level: str = "full", force: bool = False, policy_args=None, progress=None,
             calibrate: float | None = None) -> Outcome:
    """Record REF and CAND (into out_dir, or a temporary directory removed afterwards) and compare.

    With ``calibrate=K`` REF is also recorded in float64 and the tolerance is K times REF's own error.
    """
    ref_prep = prepare_side(ref_source, model, inputs)
    cand_prep = prepare_side(cand_source, model, inputs)
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
        if calibrate is not None:
            from .calibrate import calibrated_policy
            if level != "full":
                from ..engine.errors import ConfigError
                raise ConfigError("--calibrate needs full traces (got --level " + level + ")")
            gold = record_side(float64_side(ref_source, model, inputs), os.path.join(out_dir, "ref64.h5"), level,
                               force, progress=None if progress is None else progress("reference, float64"))
            with Trace(ref_path) as ref, Trace(gold) as ref64, Trace(cand_path) as cand:
                report = compare_traces(ref, cand, calibrated_policy(ref, ref64, calibrate))
                outcome = Outcome(report, ref_path, cand_path, _token_text(ref, cand))
        else:
            outcome = compare_files(ref_path, cand_path, policy_args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if tmp is not None:  # the traces are gone: reports must not point at them
        outcome.ref_path = outcome.cand_path = None
        outcome.report.ref["file"] = outcome.report.cand["file"] = None
    return outcome


def compare_with(baseline: str, candidate: str, model=None, inputs=None, *, fail_fast: bool = False,
                 policy_args=None, level: str | None = None) -> Outcome:
    """CI gate: BASELINE.h5 against a trace file, or against a preset/config recorded now."""
    from ..dumps.ranks import is_rank_set, open_any
    if (os.path.isfile(candidate) and not candidate.endswith(".toml")) or is_rank_set(candidate):
        return compare_files(baseline, candidate, policy_args, fail_fast)
    with open_any(baseline) as base:
        samples = base.samples
        from ..engine.config import Inputs
        from ..engine.snapshot import ModelSpec
        spec = model or ModelSpec(**{k: v for k, v in _spec_of(base).items()})
        inputs = inputs or Inputs(token_ids=tuple(samples))
        level = level or base.level
    prep = prepare_side(candidate, spec, inputs)
    tmp = tempfile.mkdtemp(prefix="prefill-diff-")
    try:
        path = record_side(prep, os.path.join(tmp, "cand.h5"), level)
        outcome = compare_files(baseline, path, policy_args, fail_fast)
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
                 policy_args=None) -> Outcome:
    """run --fail-fast: both sides advance one layer at a time into in-memory traces; stop at the first break.

    Nothing is written to disk, and the work after the breaking layer is never done.
    """
    preps = [prepare_side(ref_source, model, inputs), prepare_side(cand_source, model, inputs)]
    if any(p.side.run.tp > 1 for p in preps):
        from ..engine.errors import ConfigError
        raise ConfigError("--fail-fast runs both sides in lockstep in this process; a tensor-parallel side "
                          "(tp > 1) runs in its own processes: drop --fail-fast")
    recs = [Recorder(None, level), Recorder(None, level)]
    gens = [capture(p, r) for p, r in zip(preps, recs)]
    try:
        for g in gens:
            next(g)
        traces = [LiveTrace(recs[0], f"{ref_source} (in memory)"), LiveTrace(recs[1], f"{cand_source} (in memory)")]
        session = Session(*traces, _policy(policy_args, *traces))
        if session.metadata_failed:
            return Outcome(session.finish(stopped_early=True))
        n_layers = traces[0].n_layers
        for layer in range(n_layers):
            if layer:
                for g in gens:
                    next(g)
            lr = session.add_layer(layer)
            if lr.first_break is not None and layer < n_layers - 1:
                return Outcome(session.finish(stopped_early=True), token_text=_token_text(*traces))
        for g in gens:
            for _ in g:
                raise RuntimeError("a side yielded more layers than its model has")
        for t in traces:
            t.refresh()
        return Outcome(session.finish(), token_text=_token_text(*traces))
    finally:
        for g in gens:
            g.close()
        for r in recs:
            r.abort()
