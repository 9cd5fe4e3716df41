"""Benchmark 5: the cost of a calibrated verdict. `run reference CAND` with a bf16 candidate that is not the
reference's own path (a left-padded batch in bfloat16), calibrated (golden in float64 and twin in bfloat16
recorded too) against the same pair with `--no-calibrate` (the fixed envelope), interleaved in rounds.

    python tests/bench/run.py calibrate [--smoke]
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from prefill_diff.engine.config import Inputs
from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.jobs import Judging, run as run_pair

FULL = dict(overrides=(("dim", 512), ("head_dim", 64), ("hidden_dim", 1408), ("n_heads", 8), ("n_kv_heads", 2),
                       ("n_layers", 8), ("vocab_size", 4096)), lengths=(256, 192, 224), repeats=3)
SMOKE = dict(overrides=(("n_layers", 2),), lengths=(12, 5, 9), repeats=1)


def run(smoke: bool = False) -> dict:
    cfg = SMOKE if smoke else FULL
    spec = ModelSpec("synthetic", overrides=tuple(sorted(cfg["overrides"])))
    snap = load_snapshot(spec)
    rng = np.random.default_rng(0)
    inputs = Inputs(token_ids=tuple(tuple(int(t) for t in rng.integers(1, snap.args.vocab_size, n))
                                    for n in cfg["lengths"]))
    with tempfile.TemporaryDirectory() as d:
        cand = os.path.join(d, "cand.toml")
        with open(cand, "w") as f:
            f.write('preset = "batched-left"\n[run]\ndtype = "bfloat16"\n')
        plain, calibrated, ratios, verdicts = [], [], [], set()
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            a = run_pair("reference", cand, spec, inputs, judging=Judging(calibrate=False)).report
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = run_pair("reference", cand, spec, inputs).report
            calibrated.append(time.perf_counter() - t0)
            ratios.append(calibrated[-1] / plain[-1])
            verdicts.add((a.verdict, b.verdict, b.calibration.split(":")[0]))
    return {"config": f"synthetic {dict(cfg['overrides'])}, prompts of {cfg['lengths']} tokens, "
                      "candidate batched-left in bfloat16",
            "plain_run_s": round(float(np.median(plain)), 3), "calibrated_run_s": round(float(np.median(calibrated)), 3),
            "ratio_median": round(float(np.median(ratios)), 3), "ratios": [round(r, 3) for r in ratios],
            "load_avg": os.getloadavg()[0], "verdicts": sorted(verdicts), "target": "<= 3x"}
