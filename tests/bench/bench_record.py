"""Benchmark 1: what recording costs. Prefill with a full, a sampled and a stats trace against the same
prefill with no recorder, interleaved in one process; the median of the per-round ratios and the ratio of
the best times are reported, at n = 1024 and at n = 256 (where the per-dataset costs weigh most; more rounds there, as
one is about a second and a shared machine's noise is of the size of the costs measured), with the
machine's load average. At n = 256 the recorder is also timed alone: the prefill's calls replayed into it,
and the statistics alone, against the best prefill without a recorder.

    python tests/bench/run.py record [--smoke]
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch

from prefill_diff.dumps import native
from prefill_diff.dumps.recorder import Recorder, _slot_rows, slab_stats
from prefill_diff.engine.model import ModelArgs
from prefill_diff.engine.prefill import Engine, NumericalConfig
from prefill_diff.engine.runner import Placement
from prefill_diff.engine.snapshot import Snapshot
from prefill_diff.engine.synthetic import synthetic_state

FULL_SIZE = dict(args=ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=2816,
                                vocab_size=32000), batch=4, n=1024, repeats=3, short_n=256, short_repeats=15)
SMOKE_SIZE = dict(args=ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                                 vocab_size=512), batch=2, n=64, repeats=2, short_n=16, short_repeats=2)


NUMPY_STATS = "stats, no kernels"  # the stats level with the numpy code the compiled kernels replace


def one(engine, ids, mask, pos, level, d, tag):
    """Seconds for one prefill; with a trace at ``level`` (None: no recorder; NUMPY_STATS: stats without the
    compiled kernels)."""
    if level == NUMPY_STATS:
        saved, native._MODULE = native._MODULE, None
        try:
            return one(engine, ids, mask, pos, "stats", d, tag)
        finally:
            native._MODULE = saved
    t0 = time.perf_counter()
    if level is None:
        engine.prefill(ids, mask, pos)
        return time.perf_counter() - t0, 0
    path = os.path.join(d, f"{tag}.h5")
    B, n = ids.shape
    with Recorder(path, level, force=True) as rec:
        rec.begin([ids[b].tolist() for b in range(B)], n,
                  {"bench": True, "model": {"args": engine.snapshot.args.as_dict()}, "engine": {"dtype": "float32"}})
        place = Placement(rec, [(b, 0, n, b, 0) for b in range(B)], list(range(B)))
        for layer in engine.steps(ids, mask, pos, recorder=place):
            rec.layer_done(layer)
    dt = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.unlink(path)
    return dt, size


class _Capture:
    """A recorder that keeps every call, tensors copied, to replay them into a real one."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*a):
            self.calls.append((name, tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in a)))
            return []
        return call


def _replayed(engine, ids, mask, pos, out_dir: str, rounds: int) -> dict:
    """The recorder alone: one prefill's calls captured, then replayed into a Recorder at each level (file made,
    written, closed and renamed), without the prefill's own compute in between, so a shared machine's drift
    does not hide a few milliseconds; and the statistics alone (the compiled one-pass reduction of every
    state and cache tensor, which reads each once): the part of the stats level no file layout can remove."""
    B, n = ids.shape
    cap = _Capture()
    cap.begin([ids[b].tolist() for b in range(B)], n,
              {"bench": True, "model": {"args": engine.snapshot.args.as_dict()}, "engine": {"dtype": "float32"}})
    place = Placement(cap, [(b, 0, n, b, 0) for b in range(B)], list(range(B)))
    for layer in engine.steps(ids, mask, pos, recorder=place):
        cap.layer_done(layer)
    H, D = engine.snapshot.args.n_kv_heads, engine.snapshot.args.head_dim

    def replay(level):
        path = os.path.join(out_dir, f"replay-{level}.h5")
        t0 = time.perf_counter()
        with Recorder(path, level, force=True) as rec:
            for name, a in cap.calls:
                getattr(rec, name)(*a)
        dt = time.perf_counter() - t0
        os.unlink(path)
        return dt

    def statistics(_):
        t0 = time.perf_counter()
        for name, a in cap.calls:
            if name == "state":
                slab_stats(a[4])
            elif name == "cache":
                T = a[4].shape[0]
                slab_stats(_slot_rows(a[2], T, H, D))
                slab_stats(_slot_rows(a[3], T, H, D))
        return time.perf_counter() - t0

    sides = {"statistics alone": statistics, **{lv: replay for lv in ("stats", "sampled", "full")}}
    times = {k: [] for k in sides}
    for _ in range(rounds):
        for k, fn in sides.items():
            times[k].append(fn(k))
    return {k: 1000 * float(np.median(v)) for k, v in times.items()}


def _levels(engine, args, B: int, n: int, repeats: int, out_dir: str, kernel: str, replay: bool = False) -> dict:
    """Interleaved rounds at one prompt length: each level against no recorder, the median of the per-round
    ratios and the ratio of the best times."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab_size, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    pos = torch.arange(n).expand(B, n)
    engine.prefill(ids, mask, pos)  # warm up
    levels = (None, "stats", NUMPY_STATS, "sampled", "full")
    times = {lv: [] for lv in levels}
    sizes = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=out_dir) as d:
        for r in range(repeats):  # interleaved, so drift on a shared machine hits every level alike
            for lv in levels:
                dt, size = one(engine, ids, mask, pos, lv, d, f"{str(lv).replace(', ', '-').replace(' ', '-')}-{r}")
                times[lv].append(dt)
                sizes[lv] = size
            os.sync()  # let the written traces reach the disk before the next round is timed
            load.append(os.getloadavg()[0])
        alone = _replayed(engine, ids, mask, pos, d, repeats) if replay else None
        load.append(os.getloadavg()[0])
    rounds = {lv: [t / b for t, b in zip(times[lv], times[None])] for lv in levels[1:]}
    return {"config": f"d={args.dim} L={args.n_layers} H_q={args.n_heads} H_kv={args.n_kv_heads} B={B} n={n} "
                      f"float32 kernel={kernel}, traces in {out_dir}",
            "load average (1 min) during the rounds, min-max": [min(load), max(load)],
            "cpus": os.cpu_count(), "kernels": native.describe(),
            "no recorder (s, best)": min(times[None]),
            **{f"{lv} trace / none (median of rounds)": float(np.median(rounds[lv])) for lv in levels[1:]},
            **{f"{lv} trace / none (best of {repeats} rounds each)": min(times[lv]) / min(times[None])
               for lv in levels[1:]},
            **{f"{lv} trace size (MiB)": sizes[lv] / 2 ** 20 for lv in levels[1:]},
            **({} if alone is None else {
                "recorder alone, this prefill's calls replayed (ms, median of rounds)": alone,
                "recorder alone / no recorder (best)": {k: v / 1000 / min(times[None]) for k, v in alone.items()}})}


def run(smoke: bool = False, kernel: str = "eager") -> dict:
    cfg = SMOKE_SIZE if smoke else FULL_SIZE
    args, B = cfg["args"], cfg["batch"]
    snap = Snapshot("bench", args, synthetic_state(args, 0))
    engine = Engine(snap, NumericalConfig(kernel=kernel))
    out_dir = os.environ.get("PREFILL_DIFF_BENCH_DIR") or tempfile.gettempdir()
    long = _levels(engine, args, B, cfg["n"], cfg["repeats"], out_dir, kernel)
    short = _levels(engine, args, B, cfg["short_n"], cfg["short_repeats"], out_dir, kernel, replay=True)
    return {**long, f"n={cfg['short_n']}": short,
            "targets": f"n={cfg['n']}: full <= 1.20, sampled <= 1.05; n={cfg['short_n']}: stats <= 1.03, "
                       "sampled <= 1.10"}


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2))
