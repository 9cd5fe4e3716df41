"""Every engine prefill-diff runs, declared in one place: its name, its options, what it computes, its module.

An engine is one module (``engine/native/``, ``engine/foreign/``) plus one ``EngineInfo`` here (docs/engines.md
shows how, with vLLM as the worked example). The module implements three functions, each called for a prepared side
(``prepared.Prepared``)::

    check(prep)              refuse, in one line (ConfigError), whatever the engine cannot run; called
                             before any side does any work
    plan(prep, positions, pad, tp)
                             the prefill calls (``prep.calls``) and anything the engine loads or builds first
    execute(prep, recorder)  a generator: run the calls into the recorder, yield each finished layer, return
                             the run record

The entry declares the rest as data, so nothing else in the project asks "which engine is this?":

- ``options``: the engine's own settings, a frozen dataclass read from the TOML table ``[run.<table>]`` and
  checked like every other key (engine/config.py); ``None`` when it has none.
- ``computes``: the precisions it runs on request (verify/calibrate.py's ``precisions`` dicts: ``dtype``,
  ``weight_quant``, ``cache_dtype``). A calibrated verdict's golden (float64) and twin (the candidate's
  precisions) run on the reference's engine when it can run both, else on ours (``twin_maker``).
- ``tp``: whether ``[run] tp > 1`` shards it over processes (engine/parallel.py), else why not.
- ``needs``: the packages it imports in prefill-diff's own process, each with the extra that installs it;
  ``prepared.prepare`` checks them (``missing_packages``) before a side loads its model.

This module imports nothing heavy (no torch): the CLI reads it before any engine loads, and an engine's
module (its third-party package) is imported only when a side runs on it.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import MISSING, dataclass, field, fields

from .shared.errors import ConfigError, PrefillDiffError
from .shared.precisions import ACT_DTYPES, CACHE_DTYPES, FP8_DTYPES

GOLDEN = {"dtype": "float64", "weight_quant": "none", "cache_dtype": "float64"}


@dataclass(frozen=True)
class Computes:
    """The precisions an engine runs on request.

    A KV cache of the activation dtype is always run; ``cache_dtypes`` are the other dtypes its cache may store
    (None: none). An engine that runs only what its model file says (llama.cpp runs a GGUF's own weight types)
    declares only the activation dtype it computes in: it cannot make a twin.
    """
    dtypes: tuple = ()
    cache_dtypes: tuple | None = None
    weight_quants: tuple = ("none",)

    def runs(self, prec: dict) -> bool:
        dtype = prec.get("dtype")
        cache = prec.get("cache_dtype") or dtype
        if dtype not in self.dtypes or prec.get("weight_quant", "none") not in self.weight_quants:
            return False
        return cache == dtype or cache in (self.cache_dtypes or ())


BATCHING_MODES = ("unbatched", "left", "right", "packed")  # engine/config.py BATCHING


@dataclass(frozen=True)
class EngineInfo:
    """One engine: see the module docstring. Its capabilities are declared here, as data: ``prepare()``
    (engine/prepared.py) refuses whatever a run asks that its engine does not declare (``refusals``), in one place,
    naming the engine and the capability; an engine's own ``check`` refuses only what is its own business."""
    name: str  # the value of [run] engine
    module: str  # its module under prefill_diff.engine, imported when a side runs on it
    summary: str
    options: str | None = None  # "module:Class" under prefill_diff.engine: its options dataclass (plain data)
    table: str | None = None  # [run.<table>]: its options
    computes: Computes = field(default_factory=Computes)
    why_not: str = ""  # said when a calibrated verdict needs precisions no engine of ours runs
    # -- what a run may ask of it
    batching: tuple = BATCHING_MODES  # the batching modes it runs
    reuse: bool = False  # [reuse]: a prefix's KV served from our prefix cache
    chunking: bool = False  # [run] chunk_size: a prompt prefilled in chunks against the growing cache
    adapters: bool = False  # a model snapshot with a LoRA adapter
    explicit_positions: bool = False  # [inputs] positions other than 0, 1, 2, ...
    families_not: tuple = ()  # (arch, why) of the model families it does not run
    tp: bool = False  # [run] tp > 1 shards it
    no_tp: str = ""  # why it does not shard
    faults: tuple = ()  # the §2.11 faults (engine/config.py FAULTS) it can inject
    replays_routing: bool = False  # it can run a mixture of experts with given experts forced at given tokens
    replays_ops: str = ""  # the module (under prefill_diff.engine) whose replay_ops(prep, given) runs its ops on a
    # reference's inputs (shared/op_replay.py), "" when it replays none
    any_architecture: bool = False  # it runs a model our engine does not implement (its own classes, no whitelist)
    responses: bool = False  # a response after the prompt: it records the logits at the response's tokens
    generates: bool = False  # it chooses a response itself, greedily (its module's generate(prep, n))
    decode: bool = False  # decode steps after the prefill, against its own cache
    teacher_forcing: bool = False  # decode steps that write given tokens, not the ones it would choose
    op_states: bool = False  # --level ops: it records the op-level states inside a layer (dumps/schema.py OP_TENSORS)
    hints: tuple = ()  # (capability, what to use instead), said with a refusal of that capability
    # -- what it is
    cache_kinds: tuple = ("contiguous",)  # the KV cache layouts it has (engine/models/cache_layout.py CACHE_KINDS)
    unrecorded: tuple = ()  # options never written into a trace (and never read back from one)
    needs: tuple = ()  # (import name, extra of prefill-diff that installs it) for each package it imports; a third
    # item: the pip command that installs a package its extra cannot (one whose own requirements conflict with ours)
    # record.prefill (each sample's tokens from a cache, tokens computed, forward steps): "plan" when its planned
    # calls are its forward steps (prepared.planned_prefill), "run" when the engine records what its scheduler
    # did, "" when it records none
    prefill_steps: str = ""
    precisions_from_config: bool = False  # its configuration alone sets its precisions (record --twin-of PRESET)
    ledger: bool = False  # its module draws contract §2.8's shape ledger (`prefill-diff ledger`)
    # (section, key, option): its options that configs and traces written before the [run.<table>] tables kept in
    # [run] or [cache], read back into its table (engine/config.py's shim)
    legacy_keys: tuple = ()
    # (key, module, attribute): its own record in a trace, meta.record.<key>, declared as plain data beside it
    record_section: tuple | None = None

    @property
    def words(self) -> str:
        """The engine as the reports name it: 'our engine', 'the vllm engine'."""
        return "our engine" if self.name == OURS else f"the {self.name} engine"

    def load(self):
        """The engine's module (check, plan, execute)."""
        return importlib.import_module(f"{__package__}.{self.module}")

    @property
    def options_class(self):
        """Its options dataclass, from its own torch-free module beside the engine (None: it has none)."""
        if self.options is None:
            return None
        module, cls = self.options.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)

    def default_options(self):
        cls = self.options_class
        return None if cls is None else cls()

    def replayer(self):
        """The module whose ``replay_ops`` replays its ops (None: it replays none)."""
        return importlib.import_module(f"{__package__}.{self.replays_ops}") if self.replays_ops else None

    def hint(self, capability: str) -> str:
        return dict(self.hints).get(capability, "")


_NATIVE_LEGACY = tuple(("run", k, k) for k in ("kernel", "block_size", "training", "dropout_seed", "compile",
                                               "invariants")) + \
    (("cache", "kind", "cache_kind"), ("cache", "page_size", "page_size"), ("cache", "key_rotation", "key_rotation"))

ENGINES = {e.name: e for e in (
    EngineInfo("native", "native.engine", "our engine: the contract's layer template, every execution path",
               "native.settings:NativeOptions", "native",
               computes=Computes(ACT_DTYPES, CACHE_DTYPES, ("none", "int8")), reuse=True, chunking=True,
               adapters=True, explicit_positions=True, responses=True, generates=True, decode=True, tp=True,
               faults=("last-column", "skip-kv", "position-restart", "gqa-mapping", "unmasked-padding",
                       "adapter-mismatch", "masked-row-softmax", "tp-missing-allreduce", "tp-kv-shard",
                       "window-off-by-one", "router-norm-topk", "router-topk-off-by-one",
                       "shared-gate-dropped", "decode-position", "decode-stale-cache", "decode-mask", "stale-param"),
               replays_routing=True, replays_ops="native.replay", op_states=True,
               cache_kinds=("contiguous", "paged"),
               prefill_steps="plan", precisions_from_config=True, ledger=True, legacy_keys=_NATIVE_LEGACY),
    EngineInfo("transformers", "foreign.hf_engine", "Hugging Face transformers' own model, recorded through hooks",
               "foreign.hf_options:TransformersOptions", "transformers", Computes(ACT_DTYPES),
               batching=("unbatched", "left", "right"), explicit_positions=True, responses=True, generates=True,
               decode=True, tp=True, faults=("stale-param",),
               replays_routing=True, replays_ops="foreign.hf_replay", op_states=True,
               any_architecture=True,
               hints=(("reuse", "use our engine for prefix reuse"), ("chunking", "use our engine for chunked prefill"),
                      ("weight_quant", "use our engine for weight quantisation")),
               needs=(("transformers", "hf"), ("safetensors", "hf")), prefill_steps="plan",
               precisions_from_config=True, legacy_keys=(("run", "attn_implementation", "attn_implementation"),),
               record_section=("transformers", "foreign.hf_record", "TRANSFORMERS")),
    EngineInfo("fsdp2", "foreign.fsdp2_engine", "transformers' model under torch FSDP2 (fully_shard on each layer and "
               "the root, a mixed-precision policy), data parallel over spawned gloo ranks: a trainer's forward",
               "foreign.fsdp2_options:Fsdp2Options", "fsdp2", Computes(("float32", "bfloat16", "float16")),
               batching=("unbatched", "left", "right"), explicit_positions=True, responses=True, decode=True,
               replays_routing=True, replays_ops="foreign.fsdp2_engine", op_states=True, any_architecture=True,
               hints=(("reuse", "use our engine for prefix reuse"), ("chunking", "use our engine for chunked prefill"),
                      ("weight_quant", "use our engine for weight quantisation"),
                      ("dtype", "FSDP2's policy here computes in float32, bfloat16 or float16")),
               no_tp="FSDP2 shards parameters, not heads: its ranks are data parallel ([run.fsdp2] ranks)",
               needs=(("transformers", "hf"), ("safetensors", "hf")), prefill_steps="plan",
               precisions_from_config=True, record_section=("fsdp2", "foreign.hf_record", "FSDP2")),
    EngineInfo("llama.cpp", "foreign.llamacpp_engine", "llama.cpp through llama-cpp-python, read node by node",
               "foreign.llamacpp_options:LlamaCppOptions", "llamacpp", Computes(("float32",)),
               "llama.cpp also quantizes activations to Q8 inside its matmuls on quantized weights",
               batching=("unbatched", "packed"), explicit_positions=True, responses=True, decode=True,
               hints=(("batching", "llama.cpp batches sequences without padding: use batching = \"packed\" (several "
                                   "seq_ids in one llama_batch) or \"unbatched\""),
                      ("chunking", "use [run.llamacpp] n_batch / n_ubatch"),
                      ("dtype", "llama.cpp computes in float32; its weights' type is the GGUF's"),
                      ("weight_quant", "quantize the GGUF instead"),
                      ("cache_dtype", "use [run.llamacpp] type_k / type_v")),
               no_tp="llama.cpp runs the whole model in one process",
               needs=(("llama_cpp", "llamacpp"), ("gguf", "llamacpp")),
               record_section=("llama_cpp", "foreign.llamacpp_record", "RECORD")),
    EngineInfo("vllm", "foreign.vllm_engine", "vLLM (its scheduler, paged KV cache, prefix cache, chunked prefill, "
               "kernels), run in the user's own environment and captured through hooks",
               "foreign.vllm_options:VllmOptions", "vllm",
               Computes(("float32", "bfloat16", "float16"), FP8_DTYPES),
               batching=("unbatched", "packed"), families_not=(
                   ("olmo2", "vLLM has no OLMo 2 class of its own: it runs it through its transformers backend, "
                             "whose layers the worker does not read"),),
               hints=(("batching", "vLLM never pads: \"packed\" submits every prompt to one engine, \"unbatched\" "
                                   "one at a time"),
                      ("reuse", "vLLM's own prefix cache: [run.vllm] prefix_caching = true, warm = true"),
                      ("chunking", "vLLM's chunked prefill: [run.vllm] engine_args = { max_num_batched_tokens = N }"),
                      ("dtype", "vLLM runs float32, bfloat16 or float16"),
                      ("weight_quant", "a quantized checkpoint is vLLM's own business"),
                      ("cache_dtype", "vLLM's KV cache holds the activation dtype, fp8_e4m3 or fp8_e5m2"),
                      ("explicit_positions", "vLLM numbers positions itself, from 0")),
               no_tp="prefill-diff runs vLLM in one process",
               faults=("cache-write", "position-restart", "decode-position"), responses=True, decode=True,
               replays_ops="foreign.vllm_engine", op_states=True,
               cache_kinds=("paged",), unrecorded=("python",),
               # in prefill-diff's process: the model is written for vLLM as a Hugging Face checkpoint
               needs=(("transformers", "hf"), ("safetensors", "hf")), prefill_steps="run",
               record_section=("vllm", "foreign.vllm_record", "RECORD")),
    EngineInfo("torchtitan", "foreign.torchtitan_engine", "TorchTitan's own model (the trainer's forward: its "
               "Qwen3 and Llama 3 blocks, flex attention, its HF state-dict adapters), recorded through hooks",
               "foreign.torchtitan_options:TorchTitanOptions", "torchtitan", Computes(("float32", "bfloat16")),
               batching=("unbatched", "packed"), responses=True,
               families_not=tuple((arch, "TorchTitan's dense Qwen3 and Llama 3 only") for arch in (
                   "qwen2", "olmo2", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                   "granite")),
               hints=(("batching", "TorchTitan trains on packed documents without padding (split where the positions "
                                   "restart at 0): use batching = \"packed\" or \"unbatched\""),
                      ("decode", "TorchTitan's trainer has no KV cache: a response is scored in one prefill "
                                 "(decode = false)"),
                      ("dtype", "TorchTitan's model runs float32 or bfloat16 here")),
               no_tp="prefill-diff runs TorchTitan's model in one process",
               needs=(("torchtitan", "torchtitan", "pip install --no-deps torchtitan==0.3.0"),
                      ("triton", "torchtitan"), ("tyro", "torchtitan"),
                      ("spmd_types", "torchtitan")), prefill_steps="plan", precisions_from_config=True),
)}
OURS = "native"


def having(capability: str) -> str:
    """The engines that declare ``capability``, in words: 'the transformers engine', 'our engine or the vllm
    engine'."""
    names = [e.words for e in ENGINES.values() if getattr(e, capability)]
    return " or ".join(names) if names else "no engine"


def engine(name: str) -> EngineInfo:
    """The registry entry of ``name``; an unknown name is refused with the known ones."""
    info = ENGINES.get(name)
    if info is None:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)} (got {name!r})")
    return info


def option_names(info: EngineInfo) -> set:
    cls = info.options_class
    return set() if cls is None else {f.name for f in fields(cls)}


def option_default(info: EngineInfo, name: str):
    """The default of one of ``info``'s options."""
    f = {f.name: f for f in fields(info.options_class)}[name]
    return f.default_factory() if f.default is MISSING else f.default


def refusals(info: EngineInfo, run, args, adapter: bool, positions_given: bool, response: bool = False) -> list[str]:
    """What ``run`` (engine/config.py RunConfig) asks of its engine that the engine does not declare, each with the
    engine's hint: empty when it runs everything asked. ``args``: the model's ModelArgs; ``adapter``: the snapshot
    carries one; ``positions_given``: the inputs set positions other than 0, 1, 2, ...; ``response``: the inputs give
    a response after the prompts."""
    asked = []
    if run.batching not in info.batching:
        asked.append(("batching", f"batching={run.batching!r}"))
    if run.reuse is not None and not info.reuse:
        asked.append(("reuse", "prefix reuse ([reuse])"))
    if run.chunk_size and not info.chunking:
        asked.append(("chunking", f"chunked prefill (chunk_size={run.chunk_size})"))
    if run.dtype not in info.computes.dtypes:
        asked.append(("dtype", f"dtype={run.dtype!r}"))
    if run.weight_quant not in info.computes.weight_quants:
        asked.append(("weight_quant", f"weight_quant={run.weight_quant!r}"))
    if not info.computes.runs({"dtype": run.dtype, "cache_dtype": run.cache_dtype}) and \
            run.dtype in info.computes.dtypes:
        asked.append(("cache_dtype", f"[cache] dtype={run.cache_dtype!r}"))
    if adapter and not info.adapters:
        asked.append(("adapters", "a LoRA adapter"))
    if positions_given and not info.explicit_positions:
        asked.append(("explicit_positions", "explicit position ids"))
    if response and not info.responses:
        asked.append(("responses", "a response after the prompt (--response, [inputs] responses)"))
    if run.decode and not info.decode:
        asked.append(("decode", "decode steps (decode = true)"))
    why = dict(info.families_not).get(args.arch)
    if why is not None:
        asked.append(("families", f"a model of the {args.arch} family ({why})"))
    out = []
    for cap, what in asked:
        hint = info.hint(cap)
        if hint:
            out.append(f"{what} ({hint})")
        elif cap in ("reuse", "chunking", "adapters", "explicit_positions", "responses", "decode"):
            out.append(f"{what} ({having(cap)} runs it)")
        else:
            out.append(what)
    return out


class MissingPackage(PrefillDiffError):
    """An engine's package is not installed in this environment (exit status 2)."""


def missing_packages(info: EngineInfo) -> None:
    """Refuse, in one line naming the extra that installs them, the packages ``info`` needs that this
    environment lacks (found without importing them)."""
    missing = [(name, extra, *how) for name, extra, *how in info.needs if _absent(name)]
    if missing:
        extras = ",".join(dict.fromkeys(m[1] for m in missing))
        then = "".join(f" && {m[2]}" for m in missing if len(m) > 2)
        raise MissingPackage(f"the {info.name} engine needs {', '.join(m[0] for m in missing)}, missing from "
                             f"prefill-diff's environment: pip install 'prefill-diff[{extras}]'{then}")


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent package missing, or a module whose spec is unset
        return True


def twin_maker(ref_engine: str, cand_prec: dict) -> str | None:
    """The engine that runs a calibrated comparison's golden and twin: the reference's own when it can run
    float64 and the candidate's precisions, else ours; None when ours cannot run them either."""
    for name in (ref_engine, OURS):
        info = ENGINES.get(name)
        if info is not None and info.computes.runs(GOLDEN) and info.computes.runs(cand_prec):
            return name
    return None
