"""Benchmark 3: our reference engine against Hugging Face transformers' LlamaForCausalLM on the same
weights, configuration and thread count: eager against eager, sdpa against sdpa. Both compute the first-
step logits of the last position only (transformers: logits_to_keep=1), as a prefill does.

    python tests/bench/run.py engine [--smoke]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from prefill_diff.engine.models.args import ModelArgs
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state

FULL = dict(args=ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=2816,
                           vocab_size=32000), batch=4, n=1024, repeats=3)
SMOKE = dict(args=ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                            vocab_size=512), batch=2, n=64, repeats=2)


def run(smoke: bool = False) -> dict:
    from prefill_diff.engine.foreign.hf_engine import build_model
    cfg = SMOKE if smoke else FULL
    args, B, n = cfg["args"], cfg["batch"], cfg["n"]
    snap = Snapshot("bench", args, synthetic_state(args, 0))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab_size, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    pos = torch.arange(n).expand(B, n)
    out = {"config": f"d={args.dim} L={args.n_layers} H_q={args.n_heads} H_kv={args.n_kv_heads} B={B} n={n} "
                     f"float32, {torch.get_num_threads()} threads"}
    for kernel in ("eager", "sdpa"):
        ours = Engine(snap, NumericalConfig(kernel=kernel))
        hf = build_model(snap, "float32", kernel)
        ours_t, hf_t, ratios = [], [], []

        def run_hf():
            with torch.no_grad():
                return hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)

        a, b = ours.prefill(ids, mask, pos), run_hf()  # warm-up, and the two agree
        agree = float((a.next_logits - b.logits[:, -1]).abs().max())
        for _ in range(cfg["repeats"]):  # interleaved
            t0 = time.perf_counter()
            ours.prefill(ids, mask, pos)
            ours_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_hf()
            hf_t.append(time.perf_counter() - t0)
            ratios.append(ours_t[-1] / hf_t[-1])
        out[f"{kernel}: ours (s, best)"] = min(ours_t)
        out[f"{kernel}: transformers (s, best)"] = min(hf_t)
        out[f"{kernel}: ours / transformers (median of rounds)"] = float(np.median(ratios))
        out[f"{kernel}: logits max abs difference"] = agree
        del ours, hf
    out["target"] = "ours / transformers <= 1.0"
    return out


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
