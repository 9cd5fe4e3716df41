"""Benchmark 9: what recording vLLM costs, against vLLM's own prefill of the same prompt.

Side by side, alternated, each a whole process (the vLLM side always is one):

    bare    a Python process of the vLLM environment: import vllm, LLM() with the arguments the worker uses,
            generate one token of the prompt (what a user runs)
    record  `prefill-diff record vllm --model M --tokens ... -o T.h5 --level full`: our process (model load,
            the checkpoint written for vLLM), the worker (vLLM with the capture hooks), the transfer of every
            tensor to our process and the HDF5 write

Also: the worker's start-up (its ``import vllm`` and ``LLM()``, as it reports them) against a bare
``python -c "import vllm"``; and, per vllm preset, the largest relative row error per layer against the
float32 reference (the agreement behind each verdict).

    PREFILL_DIFF_VLLM_PYTHON=... python tests/bench/run.py vllm [--smoke]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SMOKE = dict(model="synthetic", n=64, response=4, repeats=1, presets=("vllm", "vllm-decode"))
FULL = dict(model="smollm2", n=1024, response=64, repeats=3,
            presets=("vllm", "vllm-chunked", "vllm-prefix-cache", "vllm-bf16", "vllm-fp8-kv", "vllm-decode"))

BARE = """
import json, sys, time
t0 = time.perf_counter()
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t1 = time.perf_counter()
args = json.loads(sys.argv[1])
llm = LLM(**args["engine_args"])
t2 = time.perf_counter()
llm.generate([TokensPrompt(prompt_token_ids=args["ids"])], SamplingParams(max_tokens=args["max_tokens"],
             temperature=0.0, ignore_eos=True, detokenize=False), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2}))
"""


def _timed(cmd, env=None) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {out.stderr[-2000:]}")
    return time.perf_counter() - t0, out.stdout


def run(smoke: bool = False) -> dict:
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.engine.config import Inputs, load_side
    from prefill_diff.engine.prepared import prepare
    from prefill_diff.engine.models.spec import ModelSpec
    from prefill_diff.engine.foreign.vllm_engine import ENV, interpreter, model_directory, request
    cfg = SMOKE if smoke else FULL
    python = interpreter(load_side("vllm").run.options)
    env = {**os.environ, ENV: python, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    spec = ModelSpec(cfg["model"])
    ids = [1 + (7 * i) % 90 for i in range(cfg["n"])]  # inside every built-in vocabulary
    side = load_side("vllm", spec, Inputs(token_ids=(tuple(ids),)))
    prep = prepare(side)
    out = {"model": cfg["model"], "tokens": cfg["n"]}
    with tempfile.TemporaryDirectory() as tmp:
        req = request(prep, model_directory(prep.snapshot, tmp))
        args = dict(model=req["model_dir"], dtype=req["dtype"], kv_cache_dtype="auto", enforce_eager=True,
                    skip_tokenizer_init=True, max_model_len=req["max_model_len"], block_size=req["block_size"],
                    enable_prefix_caching=False, kv_cache_memory_bytes=req["kv_cache_bytes"])
        bare, rec, worker, bare_dec, dec, dec_worker = [], [], [], [], [], []
        trace = os.path.join(tmp, "t.h5")
        toks = ",".join(map(str, ids))
        resp = ",".join(str(1 + (11 * i) % 90) for i in range(cfg["response"]))
        for _ in range(cfg["repeats"]):
            dt, text = _timed([python, "-c", BARE, json.dumps({"engine_args": args, "ids": ids, "max_tokens": 1})],
                              env)
            bare.append((dt, json.loads(text.strip().splitlines()[-1])))
            # decode: a bare generate of as many tokens (greedy, not forced) against the teacher-forced capture
            _, text = _timed([python, "-c", BARE, json.dumps({"engine_args": {**args, "max_model_len": args[
                "max_model_len"] + 2 * cfg["response"]}, "ids": ids, "max_tokens": cfg["response"] + 1})], env)
            bare_dec.append(json.loads(text.strip().splitlines()[-1]))
            dt, _ = _timed([sys.executable, "-m", "prefill_diff", "run", "transformers", "vllm-decode", "--model",
                            cfg["model"], "--tokens", toks, "--response-ids", resp, "--out", tmp, "--force", "-q"],
                           env)
            dec.append(dt)
            with Trace(os.path.join(tmp, "cand.h5")) as t:
                dec_worker.append(t.meta["record"]["vllm"]["timing"])
            dt, _ = _timed([sys.executable, "-m", "prefill_diff", "record", "vllm", "--model", cfg["model"],
                            "--tokens", toks, "-o", trace, "--level", "full", "--force"], env)
            with Trace(trace) as t:
                worker.append(t.meta["record"]["vllm"]["timing"])
            rec.append(dt)
        imp = [_timed([python, "-c", "import vllm"], env)[0] for _ in range(cfg["repeats"])]
    med = statistics.median
    out["bare_s"] = med(b[0] for b in bare)
    out["record_s"] = med(rec)
    out["record_over_bare"] = out["record_s"] / out["bare_s"]
    out["bare_generate_s"] = med(b[1]["generate_s"] for b in bare)
    out["worker_generate_s"] = med(w["generate_s"] for w in worker)
    out["worker_startup_s"] = med(w["import_s"] + w["load_s"] for w in worker)
    out["import_vllm_s"] = med(imp)
    out["startup_over_import"] = out["worker_startup_s"] / out["import_vllm_s"]
    out["run_transformers_vllm_decode_s"] = med(dec)
    out["decode_bare_generate_s"] = med(b["generate_s"] for b in bare_dec)
    out["decode_worker_generate_s"] = med(w["generate_s"] for w in dec_worker)
    out["decode_capture_over_bare_generate"] = out["decode_worker_generate_s"] / out["decode_bare_generate_s"]
    out["agreement"] = _agreement(cfg, env)
    return out


def _agreement(cfg: dict, env: dict) -> dict:
    """Per preset: the verdict and the largest relative row error of each layer against the float32 reference."""
    got = {}
    for preset in cfg["presets"]:
        response = ["--response-ids", "31,32,33,34"] if "decode" in preset else []
        done = subprocess.run([sys.executable, "-m", "prefill_diff", "run", "reference", preset, "--model",
                               cfg["model"], "--json", "-", *response], capture_output=True, text=True, env=env)
        if done.returncode == 2:  # refused before anything ran (vLLM's CPU fp8 cache needs AVX-512 or AMX)
            got[preset] = {"verdict": "refused", "why": done.stdout.strip() or done.stderr.strip()}
            continue
        rep = json.loads(done.stdout)
        got[preset] = {"verdict": rep["verdict"], "rule": rep["rule"].split(" (")[0],
                       "max_row_rel_per_layer": [max(float(t["max_row_rel"]) for t in lr["tensors"].values())
                                                 for lr in rep["layers"]]}
    return got
