"""Tensor-parallel runs against the unsharded run, side by side in this process: wall time of recording one
side (tp=1 in process, with the default thread count and with one thread; tp=2 spawned, one thread per
rank: start-up, init_process_group, loading and sharding, prefill and recording), each rank's phases,
and the size of each rank's trace against the unsharded trace.

    python tests/bench/bench_tp.py [--repeats 3] [--smoke]

Sizes: the default synthetic model with the built-in prompts (70, 45, 9 tokens), and a medium synthetic
model (dim 512, 8 layers, 8 query / 4 KV heads, MLP 1536) with three prompts of 256 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

from prefill_diff.engine.config import Inputs
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.jobs.sides import prepare_side, record_side

MEDIUM = ModelSpec("synthetic", 0, tuple(sorted(dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64,
                                                      hidden_dim=1536, vocab_size=4096).items())))


def _size(path) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


def measure(name: str, spec, inputs, repeats: int) -> dict:
    import torch
    default_threads = torch.get_num_threads()
    times = {"tp1": [], "tp1_1thread": [], "tp2": []}
    startup, init, sizes = [], [], {}
    phases = {"prepare_s": [], "prefill_record_s": [], "teardown_s": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            # alternate, so that all three see the same machine load; tp1 with the default thread count and with
            # one thread (each tp2 rank runs one thread: on 2 busy cores, 2 threads in one process can be slower)
            for source, key in (("reference", "tp1"), ("reference", "tp1_1thread"), ("tp2", "tp2")):
                torch.set_num_threads(1 if key == "tp1_1thread" else default_threads)
                prep = prepare_side(source, spec, inputs)
                t0 = time.perf_counter()
                path = record_side(prep, os.path.join(d, f"{key}-{i}.h5"))
                times[key].append(time.perf_counter() - t0)
                if key == "tp2":
                    from prefill_diff.dumps.reader import Trace
                    for r in range(2):
                        with Trace(os.path.join(path, f"rank{r}.h5")) as t:
                            p = t.meta["parallel"]
                            startup.append(p["startup_s"])
                            init.append(p["init_process_group_s"])
                            phases["prepare_s"].append(p["prepare_s"])
                            phases["prefill_record_s"].append(p["prefill_record_s"])
                            phases["teardown_s"].append(times[key][-1] - p["done_after_s"])
                    sizes["rank0"] = os.path.getsize(os.path.join(path, "rank0.h5"))
                    sizes["rank1"] = os.path.getsize(os.path.join(path, "rank1.h5"))
                else:
                    sizes["unsharded"] = _size(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    torch.set_num_threads(default_threads)
    return {"case": name, "repeats": repeats, "tp1_s": round(med["tp1"], 3),
            "tp1_1thread_s": round(med["tp1_1thread"], 3), "tp2_s": round(med["tp2"], 3),
            "ratio_tp2_over_tp1": round(med["tp2"] / med["tp1"], 2),
            "ratio_tp2_over_tp1_1thread": round(med["tp2"] / med["tp1_1thread"], 2),
            "rank_startup_s_median": round(statistics.median(startup), 3),
            "init_process_group_s_median": round(statistics.median(init), 3),
            "tp2_minus_startup_s": round(med["tp2"] - statistics.median(startup), 3),
            "rank_phases_s_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
            "ratio_rank_prefill_record_over_tp1_1thread": round(statistics.median(phases["prefill_record_s"])
                                                                / med["tp1_1thread"], 2),
            "trace_bytes": sizes,
            "rank_over_unsharded": round(sizes["rank0"] / sizes["unsharded"], 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="the small case only, once")
    a = ap.parse_args()
    import torch
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch_threads_tp1": torch.get_num_threads(), "torch_threads_per_rank": 1}}
    out["small"] = measure("synthetic, 3 prompts (70, 45, 9 tokens)", None, None, 1 if a.smoke else a.repeats)
    if not a.smoke:
        toks = tuple(tuple((7 * s + 3 * i) % 4000 + 1 for i in range(256)) for s in range(3))
        out["medium"] = measure("synthetic dim 512 x 8 layers, 3 prompts of 256 tokens", MEDIUM,
                                Inputs(token_ids=toks), a.repeats)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
