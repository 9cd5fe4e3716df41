"""Benchmark 5: what capturing llama.cpp's nodes costs, against llama.cpp's own prefill of the same tokens.

Side by side in one process, interleaved, on the same loaded model and thread count:

    plain    llama_decode of the prompt, no eval callback, logits of the last token only (what a user runs)
    capture  llama_decode with the engine's cb_eval observing the ~8 nodes per layer it records, copying
             each, and logits for every token (llama_cpp_engine.run_call)
    record   the whole llama.cpp side of `prefill-diff run` into an in-memory full trace: load, describe
             the GGUF (digest of quantized weights), decode with capture, hand every tensor to the Recorder
    plain+load  load the model, make a context, decode, free: the fair baseline for `record`

    python tests/bench/run.py llamacpp [--smoke]
"""
from __future__ import annotations

import time

import numpy as np
import torch

SMOKE = dict(model="synthetic", n=12, repeats=2)
FULL = dict(model="smollm2", n=128, repeats=5)


def _plain_ctx(lce, model, cfg, n):
    lib = model.lib
    cp = lib.llama_context_default_params()
    cp.n_ctx = max(256, -(-n // 256) * 256)
    cp.n_batch, cp.n_ubatch, cp.n_seq_max = cfg.n_batch, min(cfg.n_ubatch, cfg.n_batch), 1
    cp.n_threads = cp.n_threads_batch = lce._threads(cfg.n_threads)
    cp.flash_attn_type = lce.FLASH[cfg.flash_attn]
    cp.type_k, cp.type_v = lce.GGML_TYPES[cfg.type_k], lce.GGML_TYPES[cfg.type_v]
    cp.kv_unified, cp.offload_kqv, cp.op_offload, cp.no_perf = True, False, False, True
    return lib.llama_init_from_model(model.ptr, cp)


def _plain_decode(lib, ctx, ids, n_vocab):
    n = len(ids)
    batch = lib.llama_batch_init(n, 0, 1)
    try:
        for j, t in enumerate(ids):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, j, 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = int(j == n - 1)
        batch.n_tokens = n
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        assert lib.llama_decode(ctx, batch) == 0
        dt = time.perf_counter() - t0
        return dt, np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, n - 1), shape=(n_vocab,)).copy()
    finally:
        lib.llama_batch_free(batch)


def run(smoke: bool = False) -> dict:
    from prefill_diff.jobs.sides import record
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.engine.foreign import llamacpp_engine as lce
    from prefill_diff.engine.foreign.llamacpp_gguf import GgufFile
    from prefill_diff.engine.foreign.llamacpp_library import load_library
    from prefill_diff.engine.config import Inputs, load_side
    from prefill_diff.engine.prepared import prepare
    from prefill_diff.engine.models.sources import load_snapshot
    from prefill_diff.engine.models.spec import ModelSpec

    cfg_ = SMOKE if smoke else FULL
    spec = ModelSpec(cfg_["model"])
    snap = load_snapshot(spec)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, snap.args.vocab_size, (cfg_["n"],), generator=g).tolist()
    side = load_side("llama.cpp", spec, Inputs(token_ids=(tuple(ids),)))
    cfg = side.run.options
    lib = load_library()
    gfile = GgufFile(snap, cfg.gguf_type)
    model = lce.Model(gfile.path, snap)
    V = snap.args.vocab_size
    ctx = _plain_ctx(lce, model, cfg, len(ids))
    out = {"config": f"{snap.source} ({gfile.describe['weight_quant'] or gfile.describe['weights_dtype']}), "
                     f"L={snap.args.n_layers}, d={snap.args.dim}, {len(ids)} tokens, 1 sequence, "
                     f"{lce._threads(cfg.n_threads)} threads, flash off, f32 cache"}
    plain, capture, rec, plain_load = [], [], [], []
    try:
        _plain_decode(lib, ctx, ids, V)  # warm-up
        lce.run_call(model, cfg, [(ids, list(range(len(ids))))], snap.args.vocab_size, snap.args.n_layers)
        for _ in range(cfg_["repeats"]):  # interleaved
            dt, z_plain = _plain_decode(lib, ctx, ids, V)
            plain.append(dt)
            t0 = time.perf_counter()
            cap, logits, *_ = lce.run_call(model, cfg, [(ids, list(range(len(ids))))], snap.args.vocab_size,
                                           snap.args.n_layers)
            capture.append(time.perf_counter() - t0)
            agree = float(np.abs(logits[0] - z_plain).max())
            del cap
            t0 = time.perf_counter()
            m2 = lce.Model(gfile.path, snap)
            c2 = _plain_ctx(lce, m2, cfg, len(ids))
            _plain_decode(lib, c2, ids, V)
            lib.llama_free(c2)
            m2.close()
            plain_load.append(time.perf_counter() - t0)
            prep = prepare(side)
            t0 = time.perf_counter()
            record(prep, Recorder(None, "full"))
            rec.append(time.perf_counter() - t0)
    finally:
        lib.llama_free(ctx)
        model.close()
        gfile.close()
    out["plain decode (s, best)"] = min(plain)
    out["capture decode (s, best)"] = min(capture)
    out["capture / plain (median of rounds)"] = float(np.median([c / p for c, p in zip(capture, plain)]))
    out["plain + load (s, best)"] = min(plain_load)
    out["record, full trace in memory (s, best)"] = min(rec)
    out["record / (plain + load) (median of rounds)"] = float(np.median([r / p for r, p in zip(rec, plain_load)]))
    out["logits max abs, capture vs plain"] = agree
    return out
