"""Benchmark: decode against one prefill (run reference decode --response-tokens N). The response is our engine's
greedy choice after the built-in prompts; then, side by side in this process, interleaved: our engine prefilling
prompt + response in one forward, decoding the response token by token (one forward per token against the cache),
each bare and recorded into a full trace.

    python tests/bench/run.py decode [--smoke]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from prefill_diff.engine.config import Inputs
from prefill_diff.engine.decode import response_rows
from prefill_diff.engine.native.settings import cache_config
from prefill_diff.jobs.sides import choose_response, prepare_side, record_side

FULL = dict(model="synthetic", tokens=64, repeats=3)
SMOKE = dict(model="seed-2.8", tokens=4, repeats=1)


def _bare(prep) -> float:
    """Our engine's calls, no recorder: seconds."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for c in prep.calls:
            prep.engine.prefill(c.ids, c.mask, c.positions, cache_config(prep.side.run), segments=c.segments,
                                **response_rows(prep, c))
    return time.perf_counter() - t0


def run(smoke: bool = False) -> dict:
    from prefill_diff.engine.models.spec import ModelSpec
    cfg = SMOKE if smoke else FULL
    model = ModelSpec(cfg["model"])
    inputs = choose_response("decode", model, Inputs(response_tokens=cfg["tokens"]))
    preps = {name: prepare_side(name, model, inputs) for name in ("reference", "decode")}
    times = {f"{name} {how}": [] for name in preps for how in ("bare", "recorded")}
    with tempfile.TemporaryDirectory() as d:
        for r in range(cfg["repeats"]):
            for name, prep in preps.items():
                times[f"{name} bare"].append(_bare(prep))
                t0 = time.perf_counter()
                record_side(prep, os.path.join(d, f"{name}{r}.h5"), "full", True)
                times[f"{name} recorded"].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    steps = sum(len(t) - p for t, p in zip(preps["decode"].tokens, preps["decode"].prompt_lengths))
    return {"config": f"model {cfg['model']}, {len(preps['decode'].tokens)} samples, {cfg['tokens']} response tokens "
                      f"each ({steps} decode steps in all), float32, {torch.get_num_threads()} threads",
            **{f"{k} (s, best)": v for k, v in best.items()},
            "decode / one prefill, bare (median of rounds)": float(np.median(
                [a / b for a, b in zip(times["decode bare"], times["reference bare"])])),
            "decode recorded / bare (median of rounds)": float(np.median(
                [a / b for a, b in zip(times["decode recorded"], times["decode bare"])])),
            "ms per decode step, bare": 1e3 * best["decode bare"] / max(steps, 1)}


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
