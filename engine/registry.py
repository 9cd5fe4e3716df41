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
from dataclasses import dataclass, field, fields

from .shared.errors import ConfigError, PrefillDiffError
from .shared.precisions import ACT_DTYPES, CACHE_DTYPES, FP8_DTYPES

GOLDEN = {"dtype": "float64", "weight_quant": "none", "cache_dtype": "float64"}


@dataclass(frozen=True)
class Computes:
    """The precisions an engine runs on request.

    ``cache_dtypes`` None: its KV cache always has the activation dtype. An engine that runs only what its
    model file says (llama.cpp runs a GGUF's own weight types) declares nothing: it cannot make a twin.
    """
    dtypes: tuple = ()
    cache_dtypes: tuple | None = None
    weight_quants: tuple = ("none",)

    def runs(self, prec: dict) -> bool:
        dtype = prec.get("dtype")
        cache = prec.get("cache_dtype") or dtype
        if dtype not in self.dtypes or prec.get("weight_quant", "none") not in self.weight_quants:
            return False
        return cache == dtype if self.cache_dtypes is None else cache in self.cache_dtypes


# -- the engines' own options: one frozen dataclass each, the TOML table [run.<table>] --------------------

def _positive(name: str, v, limit: int = 2 ** 31 - 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit:
        raise ConfigError(f"{name} must be an integer from 1 to {limit} (got {v!r})")


@dataclass(frozen=True)
class TransformersOptions:
    """[run.transformers]: Hugging Face transformers' own model."""
    attn_implementation: str = "eager"  # eager | sdpa

    def __post_init__(self):
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ConfigError(f"attn_implementation must be 'eager' or 'sdpa' (got {self.attn_implementation!r})")


GGML_MAX_N_THREADS = 512  # ggml's own limit on a computation's threads (ggml.h)
LLAMACPP_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # ggml type names


@dataclass(frozen=True)
class LlamaCppOptions:
    """[run.llamacpp]: llama.cpp's own knobs. The defaults are llama.cpp's own."""
    flash_attn: bool | str = "auto"  # true | false | "auto" (llama.cpp decides; on a CPU it turns it on)
    n_ubatch: int = 512  # physical batch: tokens per graph computation
    n_batch: int = 2048  # logical batch: tokens per llama_decode call
    type_k: str = "f16"  # KV cache types (ggml names)
    type_v: str = "f16"
    n_threads: int = 0  # 0: the CPUs this process may use that the load leaves free, 1-4 (llama.cpp's default: 4)
    gguf_type: str = "f32"  # a model that is not a GGUF file is converted to one with these weights: f32 | f16

    def __post_init__(self):
        if self.flash_attn not in (True, False, "auto"):
            raise ConfigError(f"flash_attn must be true, false or \"auto\" (got {self.flash_attn!r})")
        for key in ("n_ubatch", "n_batch"):
            _positive(key, getattr(self, key))
        if not isinstance(self.n_threads, int) or isinstance(self.n_threads, bool) or \
                not 0 <= self.n_threads <= GGML_MAX_N_THREADS:
            raise ConfigError(f"n_threads must be an integer from 0 (automatic) to {GGML_MAX_N_THREADS}, ggml's "
                              f"limit (got {self.n_threads!r})")
        for key in ("type_k", "type_v"):
            if getattr(self, key) not in LLAMACPP_CACHE_TYPES:
                raise ConfigError(f"{key} must be one of {', '.join(LLAMACPP_CACHE_TYPES)} "
                                  f"(got {getattr(self, key)!r})")
        if self.type_v not in ("f32", "f16", "bf16") and self.flash_attn is False:
            raise ConfigError(f"llama.cpp needs flash attention for a quantized V cache "
                              f"(type_v={self.type_v!r} with flash_attn=false)")
        if self.gguf_type not in ("f32", "f16"):
            raise ConfigError(f"gguf_type must be 'f32' or 'f16' (got {self.gguf_type!r})")


# vLLM's own arguments that prefill-diff sets from its own configuration, or never lets a config choose
VLLM_REFUSED_ARGS = {"model": "[model] source", "tokenizer": "nothing (prompts go to vLLM as token ids)",
                     "trust_remote_code": "nothing (code from a model directory is never run)",
                     "dtype": "[run] dtype", "kv_cache_dtype": "[cache] dtype (fp8_e4m3, fp8_e5m2)",
                     "skip_tokenizer_init": "nothing", "enforce_eager": "nothing", "max_logprobs": "nothing",
                     "enable_prefix_caching": "[run.vllm] prefix_caching", "block_size": "[run.vllm] block_size"}


@dataclass(frozen=True)
class VllmOptions:
    """[run.vllm]: vLLM in the user's own Python environment (engine/foreign/vllm_engine.py).

    ``python`` is the interpreter of that environment (else $PREFILL_DIFF_VLLM_PYTHON, else this one when it has
    vLLM); it is never recorded in a trace, so a trace can never choose what runs. ``engine_args`` go to
    vLLM's ``LLM()`` as they are, checked by vLLM's own EngineArgs before the model loads."""
    python: str | None = None
    engine_args: dict = field(default_factory=dict)
    prefix_caching: bool = False
    warm: bool = False  # first fill the prefix cache with each prompt's leading full blocks, then prefill
    block_size: int = 32
    kv_cache_mib: int = 256  # vLLM's KV cache space, in MiB (its automatic sizing fails on small CPU machines)

    def __post_init__(self):
        if self.python is not None and (not isinstance(self.python, str) or not self.python.strip()):
            raise ConfigError(f"python must be the path of a Python interpreter (got {self.python!r})")
        if not isinstance(self.engine_args, dict):
            raise ConfigError(f"engine_args must be a table of vLLM LLM() arguments (got {self.engine_args!r})")
        refused = sorted(set(self.engine_args) & set(VLLM_REFUSED_ARGS))
        if refused:
            raise ConfigError("engine_args may not set " + "; ".join(
                f"{k} (set by {VLLM_REFUSED_ARGS[k]})" for k in refused))
        for key in ("prefix_caching", "warm"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false (got {getattr(self, key)!r})")
        if self.warm and not self.prefix_caching:
            raise ConfigError("warm = true fills vLLM's prefix cache: it needs prefix_caching = true")
        _positive("block_size", self.block_size, 4096)
        _positive("kv_cache_mib", self.kv_cache_mib, 1 << 20)

    def __hash__(self):  # engine_args is a dict: frozen dataclasses hash their fields
        return hash((self.python, tuple(sorted((k, repr(v)) for k, v in self.engine_args.items())),
                     self.prefix_caching, self.warm, self.block_size, self.kv_cache_mib))


# -- the registry ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineInfo:
    """One engine: see the module docstring."""
    name: str  # the value of [run] engine
    module: str  # its module under prefill_diff.engine, imported when a side runs on it
    summary: str
    options: type | None = None
    table: str | None = None  # [run.<table>]: its options
    computes: Computes = field(default_factory=Computes)
    why_not: str = ""  # said when a calibrated verdict needs precisions no engine of ours runs
    tp: bool = False  # [run] tp > 1 shards it
    no_tp: str = ""  # why it does not shard
    faults: tuple = ()  # the §2.11 faults (engine/config.py FAULTS) it can inject
    unrecorded: tuple = ()  # options never written into a trace (and never read back from one)
    replays_routing: bool = False  # it can run a mixture of experts with given experts forced at given tokens
    needs: tuple = ()  # (import name, extra of prefill-diff that installs it) for each package it imports
    # record.prefill (each sample's tokens from a cache, tokens computed, forward steps): "plan" when its planned
    # calls are its forward steps (prepared.planned_prefill), "run" when the engine records what its scheduler
    # did, "" when it records none
    prefill_steps: str = ""
    any_architecture: bool = False  # it runs a model our engine does not implement (its own classes, no whitelist)
    precisions_from_config: bool = False  # its configuration alone sets its precisions (record --twin-of PRESET)
    ledger: bool = False  # its module draws contract §2.8's shape ledger (`prefill-diff ledger`)
    legacy_keys: tuple = ()  # its options that traces written before the [run.<table>] tables kept in [run]

    @property
    def words(self) -> str:
        """The engine as the reports name it: 'our engine', 'the vllm engine'."""
        return "our engine" if self.name == OURS else f"the {self.name} engine"

    def load(self):
        """The engine's module (check, plan, execute)."""
        return importlib.import_module(f"{__package__}.{self.module}")

    def default_options(self):
        return None if self.options is None else self.options()


ENGINES = {e.name: e for e in (
    EngineInfo("native", "native.engine", "our engine: the contract's layer template, every execution path",
               computes=Computes(ACT_DTYPES, CACHE_DTYPES, ("none", "int8")), tp=True,
               faults=("last-column", "skip-kv", "position-restart", "gqa-mapping", "unmasked-padding",
                       "adapter-mismatch", "masked-row-softmax", "tp-missing-allreduce", "tp-kv-shard",
                       "window-off-by-one", "router-norm-topk", "router-topk-off-by-one",
                       "shared-gate-dropped"), replays_routing=True, prefill_steps="plan",
               precisions_from_config=True, ledger=True),
    EngineInfo("transformers", "foreign.hf_engine", "Hugging Face transformers' own model, recorded through hooks",
               TransformersOptions, "transformers", Computes(ACT_DTYPES), tp=True, replays_routing=True,
               needs=(("transformers", "hf"), ("safetensors", "hf")), prefill_steps="plan", any_architecture=True,
               precisions_from_config=True, legacy_keys=("attn_implementation",)),
    EngineInfo("llama.cpp", "foreign.llamacpp_engine", "llama.cpp through llama-cpp-python, read node by node",
               LlamaCppOptions, "llamacpp", Computes(),
               "llama.cpp also quantizes activations to Q8 inside its matmuls on quantized weights",
               no_tp="llama.cpp runs the whole model in one process",
               needs=(("llama_cpp", "llamacpp"), ("gguf", "llamacpp"))),
    EngineInfo("vllm", "foreign.vllm_engine", "vLLM (its scheduler, paged KV cache, prefix cache, chunked prefill, kernels), "
               "run in the user's own environment and captured through hooks", VllmOptions, "vllm",
               Computes(("float32", "bfloat16", "float16"), ("float32", "bfloat16", "float16") + FP8_DTYPES),
               no_tp="prefill-diff runs vLLM in one process", faults=("cache-write", "position-restart"),
               unrecorded=("python",),
               # in prefill-diff's process: the model is written for vLLM as a Hugging Face checkpoint
               needs=(("transformers", "hf"), ("safetensors", "hf")), prefill_steps="run"),
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
    return set() if info.options is None else {f.name for f in fields(info.options)}


class MissingPackage(PrefillDiffError):
    """An engine's package is not installed in this environment (exit status 2)."""


def missing_packages(info: EngineInfo) -> None:
    """Refuse, in one line naming the extra that installs them, the packages ``info`` needs that this
    environment lacks (found without importing them)."""
    missing = [(name, extra) for name, extra in info.needs if _absent(name)]
    if missing:
        extras = ",".join(dict.fromkeys(extra for _, extra in missing))
        raise MissingPackage(f"the {info.name} engine needs {', '.join(name for name, _ in missing)}, missing from "
                             f"prefill-diff's environment: pip install 'prefill-diff[{extras}]'")


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
