"""Benchmark 4: early stop. `run --fail-fast` on a fault that breaks layer 0 of an L-layer model, against
the full `run` (both traces recorded, then compared) of the same pair.

    python tests/bench/run.py failfast [--smoke]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from prefill_diff.engine.config import Inputs
from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.jobs import run as run_pair, run_lockstep

FULL = dict(overrides=(("dim", 512), ("head_dim", 64), ("hidden_dim", 1408), ("n_heads", 8), ("n_kv_heads", 2),
                       ("n_layers", 16), ("vocab_size", 4096)), lengths=(384, 256, 320), repeats=3)
SMOKE = dict(overrides=(("n_layers", 4),), lengths=(12, 5, 9), repeats=1)


def run(smoke: bool = False) -> dict:
    cfg = SMOKE if smoke else FULL
    spec = ModelSpec("synthetic", overrides=tuple(sorted(cfg["overrides"])))
    snap = load_snapshot(spec)
    L = snap.args.n_layers
    rng = np.random.default_rng(0)
    inputs = Inputs(token_ids=tuple(tuple(int(t) for t in rng.integers(1, snap.args.vocab_size, n))
                                    for n in cfg["lengths"]))
    fast, full, stopped = [], [], None
    for _ in range(cfg["repeats"]):
        t0 = time.perf_counter()
        rep = run_lockstep("reference", "fault:gqa-mapping", spec, inputs).report
        fast.append(time.perf_counter() - t0)
        stopped = (rep.first_break.layer, len(rep.layers), rep.stopped_early)
        t0 = time.perf_counter()
        run_pair("reference", "fault:gqa-mapping", spec, inputs)
        full.append(time.perf_counter() - t0)
    return {"config": f"synthetic {dict(cfg['overrides'])}, prompts of {cfg['lengths']} tokens",
            "first break layer, layers compared, stopped early": stopped,
            "fail-fast (s, best)": min(fast), "full run (s, best)": min(full),
            "fail-fast / full run": min(fast) / min(full), "1/L": 1 / L,
            "target": "about 1/L (plus fixed costs: model build, input preparation)"}


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
