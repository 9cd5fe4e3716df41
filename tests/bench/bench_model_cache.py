"""Benchmark 7: the converted-model cache. Whole processes of

    prefill-diff run reference transformers --model smollm2 --prompt "The capital of France is" -q

side by side in each round: ``off`` (no cache: both engines parse and dequantise the GGUF, the tokenizer is
built from its metadata), ``first`` (an empty cache: the same, plus storing both conversions) and ``second``
(the same cache again: both engines load verified safetensors). The machine's load average is printed with
each round, since the other processes on the machine slow every run.

    python tests/bench/run.py model_cache [--smoke]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from prefill_diff.engine.models.args import ModelArgs

PROMPT = "The capital of France is"
FULL = dict(model="smollm2", rounds=3, off=True)
SMOKE = dict(model="tiny", rounds=1, off=False)  # the GGUF tokenizer alone takes most of a minute here
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, vocab_size=49152,
                 tie_embeddings=True)


def write_tiny_gguf(path: str) -> None:
    """A small llama GGUF (F32) carrying SmolLM2's tokenizer metadata, so it loads like a real file."""
    import gguf

    from prefill_diff.engine.models.gguf_loader import smollm2_path
    from prefill_diff.engine.models.gguf_writer import write_gguf
    from prefill_diff.engine.models.snapshot import Snapshot
    from prefill_diff.engine.models.synthetic import synthetic_state
    fields = [(n, f) for n, f in gguf.GGUFReader(smollm2_path()).fields.items() if n.startswith("tokenizer.")]

    def add_tokenizer(self, model):  # in place of gguf_writer's "no_vocab"
        for name, f in fields:
            sub = {"sub_type": f.types[-1]} if f.types[0] == gguf.GGUFValueType.ARRAY else {}
            self.add_key_value(name, f.contents(), f.types[0], **sub)

    plain = gguf.GGUFWriter.add_tokenizer_model
    gguf.GGUFWriter.add_tokenizer_model = add_tokenizer
    try:
        write_gguf(Snapshot("tiny", TINY, synthetic_state(TINY, 3)), path)
    finally:
        gguf.GGUFWriter.add_tokenizer_model = plain


def _one(model: str, cache: str, out: str) -> float:
    cmd = [sys.executable, "-m", "prefill_diff.cli.main", "run", "reference", "transformers", "--model", model,
           "--prompt", PROMPT, "-q", "--out", out, "--force"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env={**os.environ, "PREFILL_DIFF_CACHE": cache}, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-2000:]}")
    return dt


def run(smoke: bool = False) -> dict:
    cfg = SMOKE if smoke else FULL
    with tempfile.TemporaryDirectory(prefix="bench-model-cache-") as tmp:
        model = cfg["model"]
        if model == "tiny":
            write_tiny_gguf(os.path.join(tmp, "tiny.gguf"))
            model = f"gguf:{os.path.join(tmp, 'tiny.gguf')}"
        rounds = []
        for r in range(cfg["rounds"]):
            cache = os.path.join(tmp, f"cache{r}")
            load = os.getloadavg()[0]
            off = _one(model, "off", os.path.join(tmp, "out")) if cfg["off"] else float("nan")
            first = _one(model, cache, os.path.join(tmp, "out"))
            second = _one(model, cache, os.path.join(tmp, "out"))
            rounds.append(dict(off=off, first=first, second=second, load=load))
            print(f"  round {r}: off {off:.1f} s, first {first:.1f} s, second {second:.1f} s "
                  f"(second/first {second / first:.2f}x), load average {load:.2f}", flush=True)
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(tmp, "cache0"))
                   for f in fs)
    med = lambda k: float(np.median([x[k] for x in rounds]))
    return {"config": f"run reference transformers --model {cfg['model']} --prompt {PROMPT!r}, whole processes, "
                      f"{cfg['rounds']} rounds",
            "off (s, median)": med("off"), "first, empty cache (s, median)": med("first"),
            "second, cached (s, median)": med("second"),
            "second / first (median of rounds)": float(np.median([x["second"] / x["first"] for x in rounds])),
            "first / off (median of rounds)": float(np.median([x["first"] / x["off"] for x in rounds])),
            "load average per round": [round(x["load"], 2) for x in rounds],
            "cache size (MiB)": round(size / 2 ** 20, 1)}
