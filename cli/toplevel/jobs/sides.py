"""One side of a job: prepare it with the engine, drive its layers into a trace Recorder.

This is the bridge from ``engine/`` to ``dumps/``: the engine yields layers to any recorder that has the
engine's recorder interface, and this module owns the loop around it (begin, layer by layer, the metadata
known only at the end). It imports the engine, and so torch: the job package imports it only when a side
runs, so that comparing two trace files never loads torch.
"""
from __future__ import annotations

import importlib
import os
import secrets
import shutil
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from ..dumps.rank_merge import annotate, rank_dir
from ..dumps.placement import TraceExistsError
from ..dumps.recorder import Recorder
from ..engine import parallel
from ..engine.config import Inputs, Side, at_precision, in_float64, load_side, on_engine, precision_of, run_from_dict
from ..engine.engines import execute, token_texts, trace_meta
from ..engine.shared.errors import ConfigError, PrefillDiffError
from ..engine.shared.untrusted import check_name_length, partial_sibling
from ..engine.prepared import Prepared, greedy_response, prepare
from ..engine.registry import OURS
from ..engine.models.spec import ModelSpec
from ..verify.calibrate import parse_precision_key

OnLayer = Callable[[int], None]  # a progress callback, called with each finished layer's index


def prepare_side(source: str, model: ModelSpec | None = None, inputs: Inputs | None = None, *,
                 routing: dict | None = None) -> Prepared:
    """A preset or config file, with the shared model and prompts, ready to run (model loaded, requests checked);
    ``routing``: experts to force (routing replay, prepare's)."""
    return prepare(load_side(source, model, inputs), routing=routing)


def choose_response(source: str, model: ModelSpec | None, inputs: Inputs | None, who: str = "candidate"):
    """``inputs`` with ``response_tokens`` resolved: the response of that many tokens that SOURCE's engine
    chooses greedily from each prompt (``who`` chose it, as the traces say), given to every side alike; as they
    are when they ask for none."""
    if inputs is None or not inputs.response_tokens:
        return inputs
    chosen = greedy_response(load_side(source, model, inputs), inputs.response_tokens)
    return replace(inputs, responses=chosen, response_texts=(), response_tokens=None, response_chosen_by=who)


def capture(prep: Prepared, recorder: Recorder, extra_meta: dict | None = None) -> Iterator[int]:
    """Run a prepared side into ``recorder``: a generator yielding each completed layer.

    Returns the run record (also written into the trace's meta).
    """
    section = record_section(prep.side.run.info)
    if section is not None:  # the engine's own record, checked against its declaration
        recorder.declare_record(*section)
    recorder.begin([list(t) for t in prep.tokens], prep.n_cols, {**trace_meta(prep), **(extra_meta or {})})
    record = yield from _layers(execute(prep, recorder), recorder)
    ids = [t for row in prep.tokens for t in row] + recorder.final_top_ids()
    recorder.update_meta(record=record, token_text=token_texts(prep, ids))
    return record


def record_section(info) -> tuple | None:
    """(key, declared rows, engine name) of the engine's own record, ``meta.record.<key>``, from the declaration its
    registry entry points to (``record_section``: key, module, attribute); None when it has none."""
    if info.record_section is None:
        return None
    key, module, attribute = info.record_section
    return key, getattr(importlib.import_module(f"prefill_diff.engine.{module}"), attribute), info.name


def _layers(steps, recorder: Recorder):
    """Yield the engine's layers, marking each done in the recorder; return the engine's run record."""
    while True:
        try:
            layer = next(steps)
        except StopIteration as stop:
            return stop.value
        recorder.layer_done(layer)
        yield layer


def record(prep: Prepared, recorder: Recorder, progress: OnLayer | None = None,
           extra_meta: dict | None = None) -> dict:
    """Run and close: the whole trace, written atomically."""
    if progress is not None and hasattr(progress, "set_total"):  # a display that shows "n of L layers"
        progress.set_total(prep.snapshot.args.n_layers)
    with recorder:
        gen = capture(prep, recorder, extra_meta)
        while True:
            try:
                layer = next(gen)
            except StopIteration as stop:
                return stop.value
            if progress is not None:
                progress(layer)


def record_side(prep: Prepared, path, level: str = "full", force: bool = False, compression=None,
                progress: OnLayer | None = None, in_memory: bool = False, tolerance: dict | None = None):
    """Record a prepared side; returns the path (or the open in-memory Recorder).

    ``tolerance`` (a policy spec, already checked) is stored in the trace: a baseline declares how it is to be
    compared. A tensor-parallel side writes a directory of rank traces and returns its path.
    """
    extra = {"tolerance": tolerance} if tolerance else None
    if prep.side.run.tp > 1:
        if in_memory:
            raise ConfigError("tensor-parallel runs record one trace file per rank: --fail-fast cannot run them")
        return record_ranks(prep, path, level, force, compression, extra)
    rec = Recorder(path, level, force=force, compression=compression, in_memory=in_memory)
    try:
        record(prep, rec, progress=progress, extra_meta=extra)
    except BaseException:
        rec.abort()
        raise
    return rec if in_memory else str(path)


# -- the sides a calibrated verdict adds (verify/calibrate.py) ----------------------------------------------

@dataclass(frozen=True)
class CalibrationSides:
    golden: Side  # the reference's path in float64
    twin: Side | None  # the reference's path at the candidate's precisions; None: the reference is its own twin


def calibration_sides(ref_side: Side, cand_prec: dict, twin_is_ref: bool, label: str,
                      maker: str = OURS) -> CalibrationSides:
    """The golden and twin of a calibrated comparison: the reference's own execution path, run by ``maker``
    (the reference's engine, or ours when the reference's cannot run float64 or the candidate's precisions)."""
    run = ref_side.run if maker == ref_side.run.engine else on_engine(ref_side.run, maker)
    by = "" if maker == ref_side.run.engine else f", by the {maker} engine"
    golden = replace(ref_side, run=in_float64(run, f"{ref_side.origin}, float64 golden"),
                     origin=f"{ref_side.origin} (float64 golden{by})")
    if twin_is_ref:
        return CalibrationSides(golden, None)
    twin = replace(ref_side, run=at_precision(run, cand_prec, f"{ref_side.origin} in {label}"),
                   origin=f"{ref_side.origin} (twin in {label}{by})")
    return CalibrationSides(golden, twin)


def twin_is_cand(ref: Prepared, cand: Prepared) -> bool:
    """The candidate is exactly the reference's path at the candidate's precisions (e.g. the bf16 preset)."""
    twin = at_precision(ref.side.run, precision_of(cand.side.run), "")
    return (replace(twin, name="") == replace(cand.side.run, name="") and ref.tokens == cand.tokens
            and ref.snapshot is cand.snapshot)


def precisions_of(source: str, model: ModelSpec | None = None, inputs: Inputs | None = None) -> dict:
    """The precisions ``record --twin-of`` names: a precision key (bfloat16, float16, float32-kvint8, …: what
    the golden and twin files are named by) or a preset or config of an engine whose precisions its
    configuration sets, read without loading its model."""
    prec = parse_precision_key(source)
    if prec is not None:
        return prec
    run = load_side(source, model, inputs).run
    if not run.info.precisions_from_config:
        raise ConfigError(f"--twin-of {source}: the {run.engine} engine's precisions are known only once it has run "
                          "(its model file's weight types, its kernels); give them as a precision instead, e.g. "
                          "float16 (llama.cpp with flash attention or F16 weights) or float32-kvfloat16 (an f16 "
                          "KV cache)")
    return precision_of(run)


def baseline_side(meta: dict, name: str, samples, model: ModelSpec | None = None,
                  inputs: Inputs | None = None) -> Side:
    """A baseline trace's own side (model, prompts, run config), to record its golden and twin from."""
    spec = model or baseline_spec(meta)
    ins = inputs or Inputs(token_ids=tuple(samples))
    side = meta.get("side") or {}
    return Side(spec, ins, run_from_dict(side.get("run"), f"{name}: recorded run configuration"),
                side.get("origin") or "baseline")


def baseline_spec(meta: dict) -> ModelSpec:
    """The model a baseline trace was recorded with (its ``model.spec``; older traces name only the source)."""
    model = meta.get("model") or {}
    return ModelSpec.from_description(model.get("spec") or {"source": model.get("source", "synthetic")})


# -- tensor parallel: one process and one trace per rank ---------------------------------------------------

def record_ranks(prep: Prepared, path, level: str = "full", force: bool = False, compression=None,
                 extra_meta: dict | None = None) -> str:
    """Record a tensor-parallel side: spawn its ranks, each writing ``rank{r}.h5``; returns the directory."""
    tp = prep.side.run.tp
    if level == "sampled":
        raise ConfigError("--level sampled is not supported for tensor-parallel runs (each rank would draw its "
                          "channel subset from its own shard); use full or stats")
    out = rank_dir(path, tp)
    check_name_length(out, f"the tp={tp} trace directory")
    if os.path.exists(out) and not force:
        raise TraceExistsError(f"{out} exists; pass --force to overwrite it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out} exists and is not a directory (a tp={tp} run writes a directory of rank traces)")
    parent = os.path.dirname(os.path.abspath(out))
    tmp = partial_sibling(os.path.join(parent, os.path.basename(out)))
    os.makedirs(tmp)
    try:
        try:
            parallel.launch(_rank_worker, tp, (prep.side, tmp, level, compression, extra_meta or {},
                                               secrets.token_hex(8)))
        except Exception as e:
            _raise_rank_error(tmp, tp, e)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _raise_rank_error(tmp, tp, exc):
    errors = parallel.rank_errors(tmp, tp)
    bad = [e for e in errors if e[1] == "input"]
    if bad:
        raise PrefillDiffError(bad[0][2]) from None
    killed = getattr(exc, "signal_name", None)  # torch.multiprocessing's ProcessExitedException
    if killed:
        raise PrefillDiffError(f"tensor-parallel rank {getattr(exc, 'error_index', '?')} was killed by {killed} (the "
                               "kernel's out-of-memory killer, a timeout or a person); no trace was written") from None
    taken = [(r, msg) for r, _, msg in errors if any(w in msg for w in PORT_TAKEN)]
    if taken:
        raise PrefillDiffError(f"tensor-parallel rank {taken[0][0]} could not open the rendezvous port on 127.0.0.1: "
                               "another process took it after it was found free; run again") from None
    if errors:
        r, _, msg = errors[0]
        raise RuntimeError(f"tensor-parallel rank {r} failed: {msg}") from None
    raise RuntimeError(f"tensor-parallel ranks failed: {str(exc).splitlines()[0][:300]}") from None


# how c10d says the rendezvous port is taken (its TCPStore server cannot bind)
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def _record_rank(ctx, side: Side, tmp: str, level: str, compression, extra_meta: dict, run_id: str,
                 started: float) -> None:
    """This rank's trace: its shard of the model, its own model args in meta, the mesh in meta.parallel."""
    t0 = time.time()
    prep = prepare(side)
    t1 = time.time()
    args = prep.snapshot.args
    meta = trace_meta(prep)["model"]
    meta["args"] = ctx.local_args(args).as_dict()
    par = {**ctx.describe(args), "model_args": args.as_dict(), "run_id": run_id,
           "layout": "one trace per rank: DIR/rank{r}.h5"}
    rec = Recorder(os.path.join(tmp, f"rank{ctx.rank}.h5"), level, compression=compression)
    with rec:
        for _ in capture(prep, rec, {**extra_meta, "model": meta, "parallel": par}):
            pass
        rec.flush()  # the layers' small datasets and the final outputs, which annotate marks
        annotate(rec.f, args, ctx.rank, ctx.world)
        t2 = time.time()  # seconds: preparing (load, shard), prefill + recording; spawn -> done
        rec.update_meta(parallel={**par, "prepare_s": t1 - t0, "prefill_record_s": t2 - t1,
                                  "done_after_s": (t2 - started) if started else None})


def _rank_worker(rank, world, port, started, side, tmp, level, compression, extra_meta, run_id,
                 exit_on_error: bool = True):
    """One rank's process: join the group, record rank{rank}.h5; errors go to error-rank{rank}.txt."""
    def body():
        ctx = parallel.init_group(rank, world, port, None if side.run.fault is None else side.run.fault.name,
                                  started)
        _record_rank(ctx, side, tmp, level, compression, extra_meta, run_id, started)
    parallel.run_rank(tmp, rank, body, exit_on_error=exit_on_error)


def record_this_rank(side: Side, out_dir, level: str = "full", compression=None, run_id: str | None = None) -> str:
    """Record this process's rank of a tp run launched by ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT in the environment): writes ``out_dir/rank{RANK}.h5``; returns its path. Bad input raises."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != side.run.tp:
        raise ConfigError(f"torchrun started {world} processes, the run asks for tp={side.run.tp}")
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or \
        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    os.makedirs(out_dir, exist_ok=True)
    _rank_worker(rank, world, None, 0.0, side, out_dir, level, compression, {}, run_id, exit_on_error=False)
    return os.path.join(out_dir, f"rank{rank}.h5")
