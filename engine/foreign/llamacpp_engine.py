"""llama.cpp as an engine: its own kernels and quantized matmuls, read node by node (llama-cpp-python 0.3.36).

The model runs in llama.cpp unchanged. ``context_params.cb_eval`` is asked once per graph node; we
observe the nodes we need and copy each after it is computed (CPU backend, f32):

    inp_embd (layer 0) / l_out-(i-1)    -> layer_input
    the matmul by blk.i.attn_output    -> attn_update      kqv_out-i -> attn_heads (per-head output)
      (+ its bias, where the file has one)
    ffn_inp-i                          -> mid (the residual after attention)
    the matmul by blk.i.ffn_down       -> mlp_update (llama's "ffn_out-i" already has the residual added)
      (+ its bias, where the file has one)
    l_out-i                            -> layer_output
    Kcur-i / Vcur-i (last node of each name: keys after RoPE) -> the cache, rounded to the cache type
    result_norm, llama_get_logits_ith  -> final norm and logits at each sequence's last token

Keys come back in our (Hugging Face) layout: for "llama" GGUFs llama.cpp's RoPE works on adjacent
pairs of rows it permuted at conversion; our dim j is its dim 2j, our dim j + d_h/2 its dim 2j+1.
KV positions are llama.cpp's own (``llama_memory_seq_pos_min/max``).

``batching = "unbatched"`` prefills one sequence per context (a reference); ``"packed"`` puts every
prompt into one ``llama_batch`` as its own sequence (``seq_id``), in a unified KV cache: llama.cpp's
own batching (a candidate). Models that are not GGUF files are converted to one (gguf_writer).
The library and the reading of its nodes are in llamacpp_library.py, the GGUF file it loads in llamacpp_gguf.py.

Guarded here, so no user meets them: the default (native) build of llama.cpp segfaults on its first
decode on AMX machines (ggml's AMX matmul, an "extra buffer type"): models load with
``use_extra_bufts = False``. Two OpenMP threads on a busy machine can spin 40x slower:
``OMP_WAIT_POLICY=PASSIVE`` unless the user set it.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..calls import Placement, declare_ops_absent, plan_calls
from ..decode import forward_facts, response_rows
from ..coords import SeqRun
from ..shared.errors import ConfigError, ModelLoadError, PrefillDiffError
from ..models.gguf_writer import check_convertible
from .llamacpp_gguf import GgufFile
from .llamacpp_library import Capture, load_library, log_tail, version

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
CACHE_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}  # the rest are block-quantized: "int8"
FLASH = {True: 1, False: 0, "auto": -1}


def check(prep) -> None:
    """What the llama.cpp engine needs beyond its registry entry: a model it can convert to a GGUF file."""
    snap = prep.snapshot
    gguf = snap.source == "smollm2" or snap.source.startswith("gguf:")
    if gguf and snap.truncated_of is not None:
        raise ConfigError(f"--first-layers {snap.args.n_layers}: llama.cpp loads the GGUF file {snap.source} whole "
                          "(it has no layer limit); a model it converts from our weights is cut (synthetic, hf:DIR)")
    if not gguf:
        check_convertible(snap)


def _cache_round(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """What the cache stores of rows x (tokens, H_kv*d_h), as written by ggml (round to nearest even)."""
    if ggml_type == "f32":
        return x
    if ggml_type == "f16":
        return x.astype(np.float16)
    if ggml_type == "bf16":
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isnan(x), x, r)
    import gguf  # optional: imported when used
    from gguf.quants import dequantize, quantize  # blocks of 32 along each row, as the cache stores them
    qt = getattr(gguf.GGMLQuantizationType, ggml_type.upper())
    return dequantize(quantize(np.ascontiguousarray(x, dtype=np.float32), qt), qt).reshape(x.shape)


# -- running ------------------------------------------------------------------------------------------
def _threads(n: int) -> int:
    """n, or automatic: the CPUs this process may use that the machine's load leaves free, 1 to 4.

    The thread count does not change llama.cpp's results (each output row is one thread's dot product;
    tested), only its speed: on an oversubscribed machine every extra OpenMP thread waits at each node's
    barrier for a CPU (2 threads were 3x slower than 1 on a 2-CPU machine at load 8).
    """
    if n:
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    try:
        busy = max(0.0, os.getloadavg()[0] - 1.0)  # this process's own run counts as one
    except OSError:
        busy = 0.0
    return max(1, min(4, cpus, int(cpus - busy + 0.5)))


class Model:
    """A llama.cpp model loaded from a GGUF file (CPU only, no extra buffer types: see the module notes)."""

    def __init__(self, path: str, snapshot):
        lib = self.lib = load_library()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False  # ggml's AMX path segfaults on the first decode on AMX machines
        self.ptr = lib.llama_model_load_from_file(path.encode(), mp)
        if not self.ptr:
            raise ModelLoadError(f"{snapshot.source}: llama.cpp cannot load {path} ({log_tail()})")
        a = snapshot.args
        vocab = lib.llama_model_get_vocab(self.ptr)
        theirs = {"n_layers": lib.llama_model_n_layer(self.ptr), "dim": lib.llama_model_n_embd(self.ptr),
                  "n_heads": lib.llama_model_n_head(self.ptr), "n_kv_heads": lib.llama_model_n_head_kv(self.ptr),
                  "vocab_size": lib.llama_vocab_n_tokens(vocab)}
        diff = [f"{k} {getattr(a, k)} (ours) vs {v} (llama.cpp)" for k, v in theirs.items() if getattr(a, k) != v]
        if diff:
            self.close()
            raise ModelLoadError(f"{snapshot.source}: llama.cpp reads another model from {path}: " + "; ".join(diff))

    def close(self):
        if self.ptr:
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


def _context(model: Model, cfg, n_tokens: int, n_seqs: int, threads: int, cb):
    """A llama.cpp context for one call: every sequence in one unified KV cache, CPU only, cb_eval set."""
    lib = model.lib
    cp = lib.llama_context_default_params()
    cp.n_ctx = max(256, -(-n_tokens // 256) * 256)
    cp.n_batch = cfg.n_batch
    cp.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
    cp.n_seq_max = n_seqs
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = FLASH[cfg.flash_attn]
    cp.type_k, cp.type_v = GGML_TYPES[cfg.type_k], GGML_TYPES[cfg.type_v]
    cp.kv_unified = True  # one stream: ubatches are consecutive tokens of the batch (split_simple)
    cp.offload_kqv = cp.op_offload = False
    cp.no_perf = True
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = lib.llama_init_from_model(model.ptr, cp)
    if not ctx:
        raise ConfigError(f"llama.cpp refused the context settings ({log_tail()})")
    return ctx


def _decode(lib, ctx, batch, chunk, cap: Capture) -> None:
    """One llama_decode of stream entries (seq, token, position), logits requested for every row."""
    for j, (s, t, p) in enumerate(chunk):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, p, 1
        batch.seq_id[j][0] = s
        batch.logits[j] = 1  # every row: otherwise the last layer keeps only the output rows
    batch.n_tokens = len(chunk)
    rc = lib.llama_decode(ctx, batch)
    if cap.error is not None:
        raise cap.error
    if rc != 0:
        raise ConfigError(f"llama_decode refused the batch (status {rc}): {log_tail()}")


def decode_calls(stream: list, n_batch: int, decode_from: dict) -> list[int]:
    """The first stream index of each llama_decode call: up to ``n_batch`` entries at once, except that a token a
    sequence decodes (its index in its sequence >= ``decode_from[seq]``) is a call of its own (a decode step)."""
    starts, count, seen, prev_alone = [], 0, {}, False
    for i, (s, _, _) in enumerate(stream):
        tok = seen[s] = seen.get(s, -1) + 1
        alone = s in decode_from and tok >= decode_from[s]
        if not starts or alone or prev_alone or count == n_batch:
            starts.append(i)
            count = 0
        count, prev_alone = count + 1, alone
    return starts


def run_call(model: Model, cfg, seqs, n_vocab: int, n_layers: int, threads: int | None = None,
             decode_from: dict | None = None, logits_from: dict | None = None):
    """One llama.cpp context: ``seqs`` is a list of (token ids, positions), each its own seq_id; with
    ``decode_from`` ({seq: token index}) each of those tokens is a llama_decode of its own (decode steps against
    the context's cache); ``logits_from`` ({seq: token index}): the logits from that token on are kept too.

    Returns (Capture with the ubatches, logits per sequence at its last token, resolved flash flag,
    cache positions per sequence from llama.cpp's memory, the call starts, {seq: (token indices, logits)}).
    """
    lib = model.lib
    stream = [(s, int(t), int(p)) for s, (ids, pos) in enumerate(seqs) for t, p in zip(ids, pos)]
    n = len(stream)
    first = {}
    for i, (s, _, _) in enumerate(stream):
        first.setdefault(s, i)  # each sequence's first stream index: its tokens follow in order
    tok_of = [i - first[s] for i, (s, _, _) in enumerate(stream)]
    starts = decode_calls(stream, cfg.n_batch, decode_from or {})
    wanted = {i for i, (s, _, _) in enumerate(stream)
              if s in (logits_from or {}) and logits_from[s] <= tok_of[i] < len(seqs[s][0]) - 1}
    kept = {}
    cap = Capture(n_layers)
    cb = lib.ggml_backend_sched_eval_callback(cap)  # referenced until the context is freed
    ctx = _context(model, cfg, n, len(seqs), threads or _threads(cfg.n_threads), cb)
    batch = lib.llama_batch_init(min(n, cfg.n_batch), 0, 1)
    last = {s: i for i, (s, _, _) in enumerate(stream)}  # stream index of each sequence's last token
    logits, cache_pos = {}, []
    try:
        for c0, c1 in zip(starts, starts[1:] + [n]):
            chunk = stream[c0:c1]
            _decode(lib, ctx, batch, chunk, cap)
            for i in range(c0, c1):
                if i in wanted or i in last.values():
                    row = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i - c0), shape=(n_vocab,)).copy()
                    if i in wanted:
                        kept.setdefault(stream[i][0], ([], []))[0].append(tok_of[i])
                        kept[stream[i][0]][1].append(row)
                    if i == last[stream[i][0]]:
                        logits[stream[i][0]] = row
        mem = lib.llama_get_memory(ctx)
        for s in range(len(seqs)):
            lo, hi = lib.llama_memory_seq_pos_min(mem, s), lib.llama_memory_seq_pos_max(mem, s)
            cache_pos.append(np.arange(lo, hi + 1, dtype=np.int64) if hi >= lo >= 0 else np.zeros(0, np.int64))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        del cb
    return cap, logits, not cap.softmax_seen, cache_pos, starts, {s: (np.array(t), np.stack(z))
                                                                     for s, (t, z) in kept.items()}


def _stack(cap: Capture, key, n: int, layer: int) -> np.ndarray:
    parts = []
    for i, ub in enumerate(cap.ubatches):
        if key not in ub:
            raise PrefillDiffError(f"llama.cpp computed no {key[0]} node for layer {layer} in micro-batch {i} "
                                   "(a model graph this tool does not know)")
        parts.append(ub[key])
    x = np.concatenate(parts, axis=0)  # ubatches are consecutive runs of the batch's tokens
    if x.shape[0] != n:
        raise PrefillDiffError(f"llama.cpp's {key[0]} nodes of layer {layer} hold {x.shape[0]} rows for {n} tokens")
    return x


def _ours(k: np.ndarray, permuted: bool) -> np.ndarray:
    """(tokens, H, d_h) in llama.cpp's layout -> ours: llama dim 2j is our dim j, 2j+1 is j + d_h/2."""
    return np.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1) if permuted else k


class CallCells:
    """Where a call's sequences sit: stream order (how llama.cpp got them) <-> the call's (row, column)."""

    def __init__(self, call):
        ids, valid = call.ids, call.mask.bool()
        seq = (call.segments if call.segments is not None
               else torch.arange(ids.shape[0])[:, None].expand_as(ids)).clone()
        self.valid, self.seq = valid, torch.where(valid, seq, torch.full_like(ids, -1))
        self.tok = torch.full_like(ids, -1)
        self.runs: list[SeqRun] = []  # in stream order
        for s in range(len(call.samples)):
            cells = (self.seq == s).nonzero()
            r, c0, c1 = int(cells[0, 0]), int(cells[0, 1]), int(cells[-1, 1]) + 1
            self.tok[r, c0:c1] = torch.arange(c1 - c0)
            self.runs.append(SeqRun(row=r, seq=s, c0=c0, c1=c1))
        self.shape, self.n = tuple(ids.shape), sum(c1 - c0 for _, _, c0, c1 in self.runs)

    def sequences(self, call) -> list:
        """(token ids, positions) per sequence, for llama.cpp."""
        return [(call.ids[r, c0:c1].tolist(), call.positions[r, c0:c1].tolist()) for r, _, c0, c1 in self.runs]

    def columns(self, stream_starts: list) -> list[int]:
        """Stream indices where llama_decode calls start -> the call's columns (one row: unbatched or packed)."""
        if self.shape[0] != 1:
            raise PrefillDiffError("llama.cpp's calls map to columns only in a call of one row")
        cols = [c for _, _, c0, c1 in self.runs for c in range(c0, c1)]
        return [cols[i] for i in stream_starts]

    def grid(self, rows: np.ndarray) -> np.ndarray:
        """Stream rows (n, width) -> (B, W, width) in the call's cells."""
        out = np.zeros((*self.shape, rows.shape[1]), dtype=rows.dtype)
        at = 0
        for r, _, c0, c1 in self.runs:
            out[r, c0:c1] = rows[at:at + c1 - c0]
            at += c1 - c0
        return out


def _emit_layer(placement, cells: CallCells, cap: Capture, layer: int, prev, cache_pos, cfg, permuted: bool):
    """One layer's states and cache to the recorder; returns the layer output (the next layer's input)."""
    n = cells.n
    out = _stack(cap, ("l_out", layer), n, layer)
    states = {"layer_input": prev, "attn_update": _stack(cap, ("attn_out", layer), n, layer),
              "mid": _stack(cap, ("ffn_inp", layer), n, layer),
              "mlp_update": _stack(cap, ("ffn_down", layer), n, layer), "layer_output": out,
              "attn_heads": _stack(cap, ("kqv_out", layer), n, layer)}
    for name, x in states.items():
        placement.state(layer, name, cells.grid(x.reshape(n, -1)), 0)
    k = _stack(cap, ("Kcur", layer), n, layer)  # (tokens, H_kv, d_h), llama's layout
    v = _stack(cap, ("Vcur", layer), n, layer)
    k = _ours(_cache_round(k.reshape(n, -1), cfg.type_k).reshape(k.shape), permuted)
    v = _cache_round(v.reshape(n, -1), cfg.type_v).reshape(v.shape)
    at = 0
    for r, s, c0, c1 in cells.runs:
        T, p = c1 - c0, cache_pos[s]
        if p.shape[0] != T:
            raise PrefillDiffError(f"llama.cpp's cache of sequence {s} holds positions {p.tolist()[:8]} "
                                   f"for {T} tokens")
        placement.cache(layer, s, np.ascontiguousarray(k[at:at + T].swapaxes(0, 1)),  # (H_kv, T, d_h)
                        np.ascontiguousarray(v[at:at + T].swapaxes(0, 1)), p)
        at += T
    return out


def emit_call(call, placement, cells: CallCells, cap: Capture, logits: dict, cache_pos, n_layers: int, cfg,
              permuted: bool) -> None:
    """Hand one context's nodes to the recorder, in the call's (row, column) coordinates."""
    placement.inputs(call.ids, cells.valid, call.positions, cells.tok, cells.seq)
    prev = _stack(cap, ("inp_embd", None), cells.n, 0)
    for layer in range(n_layers):
        prev = _emit_layer(placement, cells, cap, layer, prev, cache_pos, cfg, permuted)
    norm = _stack(cap, ("result_norm", None), cells.n, n_layers)
    at = 0
    for r, s, c0, c1 in cells.runs:
        at += c1 - c0
        placement.final(s, norm[at - 1], logits[s], (r, c1 - 1), c1 - c0 - 1)


def _run_meta(recorder, prep, gfile: GgufFile, cfg, flash_on: bool, threads: int) -> None:
    """What the trace must say about this run: the weight precision and cache type that set its tolerance."""
    desc = gfile.describe
    dtype = desc["weights_dtype"]
    if flash_on and dtype == "float32":
        dtype = "float16"  # flash attention casts K and V to f16 on the CPU backend
    cache = "float32" if cfg.type_k == cfg.type_v == "f32" else _coarser(cfg.type_k, cfg.type_v)
    prep.record["quantized_weights_digest"] = desc["quantized_weights_digest"]
    prep.record["llama_cpp"] = {
        "version": version(), "gguf": gfile.path if gfile.converted is None else None,
        "converted_from_snapshot": gfile.converted, "arch": desc["arch"], "weight_types": desc["weight_types"],
        "weight_quant": desc["weight_quant"], "flash_attn": flash_on, "flash_attn_setting": cfg.flash_attn,
        "type_k": cfg.type_k, "type_v": cfg.type_v, "n_ubatch": cfg.n_ubatch, "n_batch": cfg.n_batch,
        "n_threads": threads, "kv_unified": True, "use_extra_bufts": False}
    meta = recorder.meta
    recorder.update_meta(engine={**meta.get("engine", {}), "dtype": dtype, "activations": "float32",
                                 "weight_quant": desc["weight_quant"], "flash_attn": flash_on},
                         layout={**meta.get("layout", {}), "dtype": cache,
                                 "llama_cpp_types": [cfg.type_k, cfg.type_v]},
                         record=dict(prep.record))


def plan(prep, positions, pad: int, tp) -> None:
    """The calls of the run's batching (one sequence each, or all as seq_ids of one batch); llama.cpp's library
    is loaded now, so that a missing or broken install is said before either side runs."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)
    load_library()


def execute(prep, recorder):
    """Runs every call, hands the nodes over, then yields each layer."""
    check(prep)
    snap, cfg = prep.snapshot, prep.side.run.options
    load_library()
    threads = _threads(cfg.n_threads)
    gfile = GgufFile(snap, cfg.gguf_type)
    model, flash = None, set()
    try:
        model = Model(gfile.path, snap)
        permuted = gfile.describe["arch"] == "llama"
        for call in prep.calls:
            cells = CallCells(call)
            rows = response_rows(prep, call)
            cap, logits, fl, cache_pos, starts, kept = run_call(model, cfg, cells.sequences(call),
                                                                snap.args.vocab_size, snap.args.n_layers, threads,
                                                                **rows)
            flash.add(fl)
            placement = Placement(recorder, call.runs, call.samples)
            emit_call(call, placement, cells, cap, logits, cache_pos, snap.args.n_layers, cfg, permuted)
            if len(starts) > 1 and rows.get("decode_from"):  # what each cell's forward was: the calls, as columns
                placement.steps(*forward_facts(cells.tok, cells.seq, cells.columns(starts), rows["decode_from"]))
            for s, (toks, z) in kept.items():
                placement.response_logits(s, toks, z)
            del cap
    finally:
        if model is not None:
            model.close()
        gfile.close()
    _run_meta(recorder, prep, gfile, cfg, True in flash, threads)
    ops = getattr(recorder, "ops", None)
    if ops is not None:  # emit_call reads the nodes of the layer states; those of the ops inside a layer are not mapped
        declare_ops_absent(recorder, snap.args, dict.fromkeys(set(ops.declared()["absent"]) - set(
            snap.args.ops_not_computed()), "llama.cpp's graph is read at the layer states' nodes only, not op by op"))
    for layer in range(snap.args.n_layers):
        yield layer
    return prep.record


def _coarser(*types: str) -> str:
    order = ("int8", "float16", "bfloat16", "float32")
    names = [CACHE_DTYPE.get(t, "int8") for t in types]
    return min(names, key=order.index)
