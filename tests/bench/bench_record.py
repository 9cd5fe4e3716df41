"""Benchmark 1: what recording costs. Prefill with a full, a sampled and a stats trace against the same
prefill with no recorder, interleaved in one process; the median of the per-round ratios and the ratio of
the best times are reported, at n = 1024 and at n = 256 (where the per-dataset costs weigh most; more rounds there, as
one is about a second and a shared machine's noise is of the size of the costs measured), with the
machine's load average.

Each level also reports the time spent inside the recorder during the prefill (its calls, and making and
closing the file), which a shared machine's drift moves far less than the prefill's own time, and a
"statistics only" level reduces every state and cache tensor the stats level reduces (one pass of the
compiled kernel over each) and writes nothing: the part of the stats level's cost no file layout can remove.

    python tests/bench/run.py record [--smoke]
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch

from prefill_diff.dumps import kernels
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.dumps.reductions import slab_stats, slot_rows
from prefill_diff.engine.models.args import ModelArgs
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.calls import Placement
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state

FULL_SIZE = dict(args=ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=2816,
                                vocab_size=32000), batch=4, n=1024, repeats=3, short_n=256, short_repeats=15)
SMOKE_SIZE = dict(args=ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                                 vocab_size=512), batch=2, n=64, repeats=2, short_n=16, short_repeats=2)


NUMPY_STATS = "stats, no kernels"  # the stats level with the numpy code the compiled kernels replace
STATISTICS_ONLY = "statistics only, no file"  # the stats level's reductions, nothing written


class _Timed:
    """A recorder whose method calls are timed together (``inside``, seconds)."""

    def __init__(self, rec):
        self.rec, self.inside = rec, 0.0

    def __getattr__(self, name):
        fn = getattr(self.rec, name)
        if not callable(fn):  # an attribute the engine reads (``ops``: the op-level store, None at this level)
            return fn

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.inside += time.perf_counter() - t0
        return call


class _StatisticsOnly:
    """What the stats level computes per state and cache tensor (slab_stats, the cache as its slots), and no
    more: no bookkeeping, no file."""

    ops = None  # no op-level states: the engine records none

    def __init__(self, args):
        self.H, self.D = args.n_kv_heads, args.head_dim

    def state(self, layer, name, sample, col, x):
        slab_stats(x)

    def cache(self, layer, sample, keys, values, positions):
        T = positions.shape[0]
        slab_stats(slot_rows(keys, T, self.H, self.D))
        slab_stats(slot_rows(values, T, self.H, self.D))

    def __getattr__(self, name):  # begin, inputs, layer_done, final, ...: nothing to do
        return lambda *a, **k: []


def one(engine, ids, mask, pos, level, d, tag):
    """(seconds, trace bytes, seconds inside the recorder) for one prefill; with a trace at ``level`` (None: no
    recorder; NUMPY_STATS: stats without the compiled kernels; STATISTICS_ONLY: the stats level's reductions
    alone)."""
    if level == NUMPY_STATS:
        saved, kernels._MODULE = kernels._MODULE, None
        try:
            return one(engine, ids, mask, pos, "stats", d, tag)
        finally:
            kernels._MODULE = saved
    t0 = time.perf_counter()
    if level is None:
        engine.prefill(ids, mask, pos)
        return time.perf_counter() - t0, 0, 0.0
    B, n = ids.shape
    if level == STATISTICS_ONLY:
        rec = _Timed(_StatisticsOnly(engine.snapshot.args))
        for layer in engine.steps(ids, mask, pos, recorder=Placement(rec, [(b, 0, n, b, 0) for b in range(B)],
                                                                     list(range(B)))):
            rec.layer_done(layer)
        return time.perf_counter() - t0, 0, rec.inside
    path = os.path.join(d, f"{tag}.h5")
    made = time.perf_counter()
    with Recorder(path, level, force=True) as bare:
        rec = _Timed(bare)
        rec.inside = time.perf_counter() - made
        rec.begin([ids[b].tolist() for b in range(B)], n,
                  {"bench": True, "model": {"args": engine.snapshot.args.as_dict()}, "engine": {"dtype": "float32"}})
        place = Placement(rec, [(b, 0, n, b, 0) for b in range(B)], list(range(B)))
        for layer in engine.steps(ids, mask, pos, recorder=place):
            rec.layer_done(layer)
        closing = time.perf_counter()
    dt = time.perf_counter() - t0
    inside = rec.inside + time.perf_counter() - closing
    size = os.path.getsize(path)
    os.unlink(path)
    return dt, size, inside


def _levels(engine, args, B: int, n: int, repeats: int, out_dir: str, kernel: str) -> dict:
    """Interleaved rounds at one prompt length: each level against no recorder, the median of the per-round
    ratios and the ratio of the best times."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab_size, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    pos = torch.arange(n).expand(B, n)
    engine.prefill(ids, mask, pos)  # warm up
    levels = (None, STATISTICS_ONLY, "stats", NUMPY_STATS, "sampled", "full")
    times = {lv: [] for lv in levels}
    inside = {lv: [] for lv in levels}
    sizes = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=out_dir) as d:
        for r in range(repeats):  # interleaved, so drift on a shared machine hits every level alike
            for lv in levels:
                dt, size, spent = one(engine, ids, mask, pos, lv, d,
                                      f"{str(lv).replace(', ', '-').replace(' ', '-')}-{r}")
                times[lv].append(dt)
                inside[lv].append(spent)
                sizes[lv] = size
            os.sync()  # let the written traces reach the disk before the next round is timed
            load.append(os.getloadavg()[0])
    rounds = {lv: [t / b for t, b in zip(times[lv], times[None])] for lv in levels[1:]}
    return {"config": f"d={args.dim} L={args.n_layers} H_q={args.n_heads} H_kv={args.n_kv_heads} B={B} n={n} "
                      f"float32 kernel={kernel}, traces in {out_dir}",
            "load average (1 min) during the rounds, min-max": [min(load), max(load)],
            "cpus": os.cpu_count(), "kernels": kernels.describe(),
            "no recorder (s, best)": min(times[None]),
            **{f"{lv} trace / none (median of rounds)": float(np.median(rounds[lv])) for lv in levels[1:]},
            **{f"{lv} trace / none (best of {repeats} rounds each)": min(times[lv]) / min(times[None])
               for lv in levels[1:]},
            **{f"{lv} trace size (MiB)": sizes[lv] / 2 ** 20 for lv in levels[2:]},
            **{f"{lv}: inside the recorder (ms, median of rounds)": 1000 * float(np.median(inside[lv]))
               for lv in levels[1:]},
            **{f"{lv}: inside the recorder / none (median of rounds)":
               float(np.median([t / b for t, b in zip(inside[lv], times[None])])) for lv in levels[1:]}}


def run(smoke: bool = False, kernel: str = "eager") -> dict:
    cfg = SMOKE_SIZE if smoke else FULL_SIZE
    args, B = cfg["args"], cfg["batch"]
    snap = Snapshot("bench", args, synthetic_state(args, 0))
    engine = Engine(snap, NumericalConfig(kernel=kernel))
    out_dir = os.environ.get("PREFILL_DIFF_BENCH_DIR") or tempfile.gettempdir()
    long = _levels(engine, args, B, cfg["n"], cfg["repeats"], out_dir, kernel)
    short = _levels(engine, args, B, cfg["short_n"], cfg["short_repeats"], out_dir, kernel)
    return {**long, f"n={cfg['short_n']}": short,
            "targets": f"n={cfg['n']}: full <= 1.20, sampled <= 1.05; n={cfg['short_n']}: stats <= 1.03, "
                       "sampled <= 1.10"}


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2))
