"""Benchmark: what the op level costs against the layer level. Side by side in this process, rounds interleaved,
medians of the per-round ratios:

- recording (jobs.sides.record_side, what `record` and `run` call, on a side prepared once) at --level full and
  at --level ops, our engine and transformers (whose op states come from hooks on more modules): seconds and
  trace bytes, ops / full;
- `compare` (jobs.compare_files) of the same pair of ops-level traces, transformers' against ours, judged with
  the tolerance and with --exact: seconds, exact / tolerance;
- `run --replay-ops`'s replay (jobs.replay.replay_ops: the reference's inputs read, our engine's ops run on them,
  judged bit for bit) on transformers' trace, against one ops-level recording of our engine: seconds, replay /
  record, and the engine's part of it alone (the rest reads the traces and judges the bits).

Torch runs on one thread here (restored after): with two threads on a shared two-core machine one forward's time
swung tenfold between rounds (0.6 s to 7 s), with one it stays within a few per cent.

    python tests/bench/run.py ops [--smoke]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.config import Inputs
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.jobs import Judging, compare_files
from prefill_diff.jobs.replay import replay_input, replay_ops
from prefill_diff.jobs.sides import prepare_side, record_side

# full: a model wider and deeper than the built-in one, three prompts of a few hundred tokens; smoke: the built-in
# synthetic model and prompts
FULL = dict(overrides=(("dim", 512), ("head_dim", 64), ("hidden_dim", 1408), ("n_heads", 8), ("n_kv_heads", 2),
                       ("n_layers", 8), ("vocab_size", 4096)), lengths=(256, 192, 128), repeats=5)
SMOKE = dict(overrides=(), lengths=None, repeats=1)
THREADS = 1
ENGINES = ("reference", "transformers")  # our engine, one sample at a time; transformers' own model
LEVELS = ("full", "ops")


def _timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return time.perf_counter() - t0, out


def _median_ratio(num: list, den: list) -> float:
    return float(np.median([a / b for a, b in zip(num, den)]))


def _record(preps: dict, d: str, repeats: int) -> tuple:
    """Interleaved rounds of every engine at every level; returns (seconds, bytes) per (engine, level) and the
    last round's ops-level traces."""
    secs = {(e, lv): [] for e in preps for lv in LEVELS}
    size, kept = {}, {}
    for e, prep in preps.items():  # warm up: the first forward pays one-off costs
        os.unlink(record_side(prep, os.path.join(d, f"warm-{e}.h5"), "full", True))
    for r in range(repeats):
        for e, prep in preps.items():
            for lv in LEVELS:
                dt, path = _timed(record_side, prep, os.path.join(d, f"{e}-{lv}-{r}.h5"), lv, True)
                secs[(e, lv)].append(dt)
                size[(e, lv)] = os.path.getsize(path)
                if lv == "ops" and r == repeats - 1:
                    kept[e] = path
                else:
                    os.unlink(path)
        os.sync()  # the written traces reach the disk before the next round is timed
    return secs, size, kept


def run(smoke: bool = False) -> dict:
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _run(SMOKE if smoke else FULL)
    finally:
        torch.set_num_threads(saved)


def _run(cfg: dict) -> dict:
    spec = ModelSpec("synthetic", overrides=tuple(sorted(cfg["overrides"])))
    inputs = None
    preps = {e: prepare_side(e, spec, inputs) for e in ENGINES}
    args = preps["reference"].snapshot.args
    if cfg["lengths"]:
        rng = np.random.default_rng(0)
        inputs = Inputs(token_ids=tuple(tuple(int(t) for t in rng.integers(1, args.vocab_size, n))
                                        for n in cfg["lengths"]))
        preps = {e: prepare_side(e, spec, inputs) for e in ENGINES}
    tokens = [len(t) for t in preps["reference"].tokens]
    repeats = cfg["repeats"]
    load = [os.getloadavg()[0]]
    out_dir = os.environ.get("PREFILL_DIFF_BENCH_DIR") or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=out_dir) as d:
        secs, size, kept = _record(preps, d, repeats)
        load.append(os.getloadavg()[0])
        ref, cand = kept["transformers"], kept["reference"]
        tol, exact, verdicts = [], [], {}
        for _ in range(repeats):  # compare, judged with the tolerance and bit for bit, interleaved
            for how, times in (("tolerance", tol), ("exact", exact)):
                dt, got = _timed(compare_files, ref, cand, Judging(exact=how == "exact"))
                times.append(dt)
                verdicts[how] = "pass" if got.report else "fail"
                if how == "exact":
                    exact_result = got.report.exact
        load.append(os.getloadavg()[0])
        replay, engine_part, recorded, replayed_ops = [], [], [], 0
        for r in range(repeats):  # our engine's replay on transformers' trace against one recording of ours
            dt, _ = _timed(record_side, preps["reference"], os.path.join(d, f"again-{r}.h5"), "ops", True)
            recorded.append(dt)
            os.unlink(os.path.join(d, f"again-{r}.h5"))
            with Trace(ref) as rt, Trace(cand) as ct:
                dt, res = _timed(replay_ops, rt, ct, preps["reference"], exact_result)
                given = replay_input(rt)
                dt_engine, _ = _timed(preps["reference"].side.run.info.replayer().replay_ops, preps["reference"], given)
            replay.append(dt)
            engine_part.append(dt_engine)
            replayed_ops = sum(len(ops) for _, ops in res.layers)
        load.append(os.getloadavg()[0])
    rec = {}
    for e in ENGINES:
        rec[e] = {**{f"{lv} (s, median)": float(np.median(secs[(e, lv)])) for lv in LEVELS},
                  **{f"{lv} trace (MiB)": size[(e, lv)] / 2 ** 20 for lv in LEVELS},
                  "ops / full, seconds (median of rounds)": _median_ratio(secs[(e, "ops")], secs[(e, "full")]),
                  "ops / full, bytes": size[(e, "ops")] / size[(e, "full")]}
    return {"config": f"synthetic d={args.dim} L={args.n_layers} H_q={args.n_heads} H_kv={args.n_kv_heads} "
                      f"hidden={args.hidden_dim}, prompts of {tokens} tokens, float32, {torch.get_num_threads()} "
                      f"threads, {repeats} rounds, traces in {out_dir}",
            "load average (1 min): start, after record, compare, replay": load,
            "record": rec,
            "compare": {"pair": "transformers' ops trace (reference) against ours (candidate)",
                        "verdicts": verdicts,
                        "tolerance (s, median)": float(np.median(tol)), "exact (s, median)": float(np.median(exact)),
                        "exact / tolerance (median of rounds)": _median_ratio(exact, tol)},
            "replay": {"ops replayed": replayed_ops, "replay (s, median)": float(np.median(replay)),
                       "the engine's replay alone (s, median)": float(np.median(engine_part)),
                       "one ops-level recording of ours (s, median)": float(np.median(recorded)),
                       "replay / recording (median of rounds)": _median_ratio(replay, recorded),
                       "the engine's replay alone / recording (median of rounds)":
                           _median_ratio(engine_part, recorded)}}


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
