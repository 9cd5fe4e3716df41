"""Run configurations: *how* to prefill (a preset or a TOML file) and *what* (model, inputs).

A config file is TOML. Every key is checked; an unknown key is an error, never ignored::

    preset = "batched-left"          # optional: start from a preset, then override

    [model]                          # what model (shared with the other side unless set here)
    source = "synthetic"             # synthetic | seed-2.8 | hf:<dir> | gguf:<file> | smollm2
    seed = 0
    n_layers = 6                     # synthetic models: any ModelArgs field
    [model.adapter]                  # optional LoRA on the attention projections
    id = "demo"; rank = 4; seed = 1; scale = 1.0

    [inputs]                         # what prompts (shared unless set here)
    token_ids = [[1, 2, 3], [4, 5]]  # or prompts = ["text", ...] with a tokenizer
    positions = [[0, 1, 2], [0, 1]]  # optional explicit position ids
    segments = [[[0, 2]], []]        # optional spans a reuse boundary may not cut

    [run]                            # how, in what every engine means the same way
    engine = "native"                # an engine of engine/registry.py: native | transformers | llama.cpp | vllm
    batching = "unbatched"           # unbatched | left | right | packed
    dtype = "float32"                # float64 | float32 | bfloat16 | float16
    chunk_size = 0
    [run.native]                     # the engine's own options, one table per engine (registry's options):
    kernel = "eager"                 #   [run.native] kernel, block_size, training, dropout_seed, compile,
    cache_kind = "contiguous"        #   invariants, cache_kind, page_size, key_rotation; [run.llamacpp] flash_attn,
    key_rotation = "post"            #   n_ubatch, n_batch, type_k, ...; [run.transformers] attn_implementation

    [cache]                          # the KV cache's precision
    dtype = "int8"                   # default: the activation dtype; int8_scales = "per-token" | "per-head"

    [reuse]                          # prefix KV reuse (contract §2.9)
    prefix_len = 4

    [fault]                          # one §2.11 fault
    name = "gqa-mapping"

This module imports no torch (the model's vocabulary is engine/models/, the engines and their options classes are
engine/registry.py's): a config is read and checked, and a typo or a bad value said with the file
and the section, before any engine loads.
"""
from __future__ import annotations

import os
import typing
from dataclasses import asdict, dataclass, fields, replace

from . import registry
from .shared.errors import ConfigError, PrefillDiffError, did_you_mean
from .shared.untrusted import check_int64, check_prompt_text, read_small_file
from .models.args import MODEL_PRESETS, ModelArgs  # no torch
from .models.spec import ModelSpec
from .presets import PRESETS
from .models.cache_layout import CacheLayout, one_of  # no torch
from .shared.precisions import ACT_DTYPES, WEIGHT_QUANTS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BATCHING = ("unbatched", "left", "right", "packed")
FAULTS = ("last-column", "skip-kv", "position-restart", "gqa-mapping", "unmasked-padding",
          "adapter-mismatch", "masked-row-softmax", "tp-missing-allreduce", "tp-kv-shard", "cache-write",
          "window-off-by-one", "router-norm-topk", "router-topk-off-by-one", "shared-gate-dropped",
          "decode-position", "decode-stale-cache", "decode-mask", "stale-param")
ROUTER_FAULTS = ("router-norm-topk", "router-topk-off-by-one", "shared-gate-dropped")  # MoE: in the MLP
DECODE_FAULTS = ("decode-position", "decode-stale-cache", "decode-mask")  # in decode steps only


@dataclass(frozen=True)
class Inputs:
    """What to prefill: token ids (or text prompts) per sample."""
    token_ids: tuple = ()
    prompts: tuple = ()
    positions: tuple | None = None
    segments: tuple | None = None
    pad_id: int | None = None
    attention_mask: tuple | None = None  # per sample, aligned with token_ids: 0 marks padding in the row
    # a response per sample, after its prompt: token ids, or texts for a model with a tokenizer. Both sides see
    # prompt + response; a side with [run] decode = true writes the response token by token (decode steps)
    responses: tuple | None = None
    response_texts: tuple = ()
    response_tokens: int | None = None  # a response of this many tokens, the candidate's own greedy choice
    response_chosen_by: str | None = None  # who chose ``responses``: None (given) or "candidate"

    def __post_init__(self):
        for i, p in enumerate(self.prompts if isinstance(self.prompts, (list, tuple)) else ()):
            if isinstance(p, str):
                check_prompt_text(p, i)
        for i, p in enumerate(self.response_texts if isinstance(self.response_texts, (list, tuple)) else ()):
            if isinstance(p, str):
                check_prompt_text(p, i)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in ((), None)}


@dataclass(frozen=True)
class ReuseConfig:
    """Prefix reuse: an earlier request of the first prefix_len tokens filled the prefix cache."""
    prefix_len: int = 4
    tenant: str = "default"
    cache_tenant: str | None = None  # tenant whose request built the cached prefix; default: the same
    allow_cross_tenant: bool = False
    cache_adapter: str = "same"  # same | other: adapter the cached prefix was built under
    force: bool = False  # use a candidate even if its metadata does not match (fault injection only)

    def __post_init__(self):
        if not isinstance(self.prefix_len, int) or self.prefix_len < 1:
            raise ConfigError(f"prefix_len must be a positive integer (got {self.prefix_len!r})")
        if self.cache_adapter not in ("same", "other"):
            raise ConfigError(f"cache_adapter must be 'same' or 'other' (got {self.cache_adapter!r})")


@dataclass(frozen=True)
class FaultConfig:
    name: str
    layer: int | None = None  # skip-kv, cache-write: the layer whose cache write goes wrong (default: the middle);
    # stale-param: the layer whose k_proj weight is one ULP off after loading (default: layer 1)
    sample: int = 0  # skip-kv, cache-write: the sample whose write goes wrong
    token: int = -1  # skip-kv: the token index skipped; cache-write: the slot overwritten (-1: the last)

    def __post_init__(self):
        if self.name not in FAULTS:
            raise ConfigError(f"name must be one of {', '.join(FAULTS)} (got {self.name!r}"
                              f"{did_you_mean(self.name, FAULTS, '; did you mean {}?')})")




@dataclass(frozen=True)
class RunConfig:
    """How to prefill: everything except the model and the prompts, in the words every engine means the same way —
    batching, prefix reuse, chunking, precisions (activations and weights, weight quantisation, the KV cache's
    dtype), determinism, a fault, tensor-parallel ranks.

    ``options``: the engine's own settings (its registry entry's options dataclass, the table ``[run.<table>]``;
    ours, ``[run.native]``, holds the attention kernel, training mode, compilation and the cache's layout); filled
    with the defaults when not given."""
    name: str = "reference"
    engine: str = "native"
    batching: str = "unbatched"
    dtype: str = "float32"  # activations and weights
    weight_quant: str = "none"
    cache_dtype: str | None = None  # the KV cache's storage dtype; None: the activation dtype
    int8_scales: str = "per-token"  # an int8 KV cache's scales
    chunk_size: int = 0  # 0: each prompt in one forward; else chunks of this many tokens against the growing cache
    deterministic: bool = True  # deterministic algorithms where the engine's library has them
    decode: bool = False  # the response written token by token, one decode step each against the cache
    reuse: ReuseConfig | None = None
    fault: FaultConfig | None = None
    tp: int = 1  # tensor-parallel ranks, one process each (engine/parallel.py)
    options: object | None = None

    def __post_init__(self):
        info = registry.engine(self.engine)
        cls = info.options_class
        if self.options is None:
            object.__setattr__(self, "options", info.default_options())
        elif cls is None or not isinstance(self.options, cls):
            raise ConfigError(f"engine {self.engine!r} takes " + (f"[run.{info.table}] options" if info.table else
                                                                 "no options") +
                              f" (got {type(self.options).__name__})")
        if self.batching not in BATCHING:
            raise ConfigError(f"batching must be one of {', '.join(BATCHING)} (got {self.batching!r}"
                              f"{did_you_mean(self.batching, BATCHING, '; did you mean {}?')})")
        one_of("dtype", self.dtype, ACT_DTYPES)
        one_of("weight_quant", self.weight_quant, WEIGHT_QUANTS)
        CacheLayout(dtype=self.cache_dtype, int8_scales=self.int8_scales)  # the cache's own checks
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 0:
            raise ConfigError(f"chunk_size must be a non-negative integer (got {self.chunk_size!r})")
        for key in ("deterministic", "decode"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false (got {getattr(self, key)!r})")

    @property
    def info(self) -> registry.EngineInfo:
        return registry.engine(self.engine)

    def as_dict(self) -> dict:
        """The recorded form (a trace's meta.side.run): the neutral settings, then the engine's options under its
        table's name."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        d = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in d.items()}
        if self.options is not None:
            d[self.info.table] = {k: v for k, v in asdict(self.options).items() if k not in self.info.unrecorded}
        return d


# Precisions: what a calibrated comparison holds apart from the execution path (kernels, batching, reuse,
# chunking, paging). A twin is the reference's own path at the candidate's precisions; a golden is the
# reference's path in float64 with nothing quantised.
def precision_of(run: RunConfig) -> dict:
    """The precisions of a run: activation/weight dtype, weight quantisation, KV-cache dtype (and int8 scales)."""
    cache = run.cache_dtype or run.dtype
    return {"dtype": run.dtype, "weight_quant": run.weight_quant, "cache_dtype": cache,
            "int8_scales": run.int8_scales if cache == "int8" else None}


def at_precision(run: RunConfig, prec: dict, name: str) -> RunConfig:
    """``run``'s execution path with another run's precisions (the twin of a calibrated comparison)."""
    cache_dtype = None if prec["cache_dtype"] == prec["dtype"] else prec["cache_dtype"]
    return replace(run, name=name, dtype=prec["dtype"], weight_quant=prec["weight_quant"], cache_dtype=cache_dtype,
                   int8_scales=prec.get("int8_scales") or run.int8_scales)


def on_engine(run: RunConfig, engine: str) -> RunConfig:
    """``run``'s execution path (batching, reuse, chunks, precisions) on another engine, that engine's own options
    at their defaults (a calibrated verdict's golden and twin, when the reference's engine cannot run them)."""
    return replace(run, engine=engine, options=registry.engine(engine).default_options())


def in_float64(run: RunConfig, name: str) -> RunConfig:
    """``run``'s execution path in float64, nothing quantised (the golden of a calibrated comparison)."""
    return at_precision(run, {"dtype": "float64", "weight_quant": "none", "cache_dtype": "float64"}, name)


_NEUTRAL_RUN = ("engine", "batching", "dtype", "weight_quant", "chunk_size", "deterministic", "decode", "tp")


def run_from_dict(d: dict, where: str) -> RunConfig:
    """A RunConfig from its ``as_dict()`` form (a trace's meta.side.run), validated like a config file. The form
    traces of format 1.2 and before recorded (``numerical``, ``cache.layout``) is read through the same shim as old
    config files (``_moved_keys``)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: the recorded run configuration must be a table (got {type(d).__name__})")
    old = isinstance(d.get("numerical"), dict) or isinstance(d.get("cache"), dict)
    run = {k: d[k] for k in (("engine", "batching", "tp") if old else _NEUTRAL_RUN) if k in d}
    if old:  # format 1.2 and before: our engine's settings and the precisions nested, the layout under cache
        cache = d.get("cache") if isinstance(d.get("cache"), dict) else {}
        run.update(d.get("numerical") or {})
        run.update({k: cache[k] for k in ("chunk_size", "invariants") if k in cache})
        conf_cache = {k: v for k, v in (cache.get("layout") or {}).items() if k != "version"}
    else:
        conf_cache = {k: d[f] for k, f in (("dtype", "cache_dtype"), ("int8_scales", "int8_scales"))
                      if d.get(f) is not None}
    run.update({k: d[k] for e in registry.ENGINES.values() for s, k, _ in e.legacy_keys if s == "run" and k in d})
    info = registry.ENGINES.get(run.get("engine", "native"))
    if info is not None and info.table and isinstance(d.get(info.table), dict):  # its options, under its table
        table = {k: v for k, v in d[info.table].items() if k not in info.unrecorded}
        if table:
            run[info.table] = table
    conf = {"run": run, "cache": conf_cache}
    for k in ("reuse", "fault"):
        if d.get(k) is not None:
            conf[k] = d[k]
    name = d.get("name") if isinstance(d.get("name"), str) else "recorded"
    return parse_run(conf, where, name)


@dataclass(frozen=True)
class Side:
    """One side of a comparison, fully resolved: model, inputs, run."""
    model: ModelSpec
    inputs: Inputs
    run: RunConfig
    origin: str  # preset name or config path


TRACE_SUFFIXES = (".h5", ".hdf5")  # a name ending so is a trace file, never a preset
_SECTIONS = {"preset", "model", "inputs", "run", "cache", "reuse", "fault"}
_CACHE_KEYS = {"dtype", "int8_scales"}  # the KV cache's precision; its layout is an engine's option


def _tables() -> dict:
    """[run.<table>] -> the engine whose options it holds (read from the registry as it is now)."""
    return {e.table: e for e in registry.ENGINES.values() if e.table}


def _run_keys() -> set:
    return set(_NEUTRAL_RUN) | set(_tables())


def _moved() -> dict:
    """An engine option written directly in [run], as configs did before the options had tables of their own."""
    return {k: e for e in _tables().values() for k in registry.option_names(e)}
_MODEL_KEYS = {"source", "seed", "adapter", "first_layers"}


def _merge(base: dict, over: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_types(section: str, got: dict, cls, where: str, skip=(), shown=None) -> None:
    """Each value must have the type its dataclass field declares (TOML gives int, float, bool, str, list, table).
    ``shown``: the name a key was written under, where it differs from the field's."""
    hints = typing.get_type_hints(cls)
    for key, value in got.items():
        if key in skip or key not in hints:
            continue
        allowed = typing.get_args(hints[key]) or (hints[key],)
        ok = False
        for t in allowed:
            t = typing.get_origin(t) or t
            if t is type(None):
                ok = ok or value is None
            elif t is bool:
                ok = ok or isinstance(value, bool)
            elif t is int:
                ok = ok or (isinstance(value, int) and not isinstance(value, bool))
            elif t is float:
                ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool))
            elif t in (tuple, list):
                ok = ok or isinstance(value, (list, tuple))
            elif isinstance(t, type):
                ok = ok or isinstance(value, t)
            else:
                ok = True  # a type this check does not know: the constructor validates it
        if not ok:
            names = " or ".join(getattr(typing.get_origin(t) or t, "__name__", str(t)).replace("NoneType", "none")
                                for t in allowed)
            raise ConfigError(f"{where}: [{section}] {(shown or {}).get(key, key)} must be {names} (got {value!r})")


def _check_keys(section: str, got: dict, known: set, where: str) -> None:
    unknown = sorted(set(got) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(f'[{section}] {k}{did_you_mean(k, known)}' for k in unknown)} "
                          f"(known: {', '.join(sorted(known))})")


def read_toml(path: str) -> dict:
    """A config file: a regular file of at most CONFIG_LIMIT bytes (never a FIFO, a device or /dev/null)."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such config file (and not a preset; see `prefill-diff presets`)")
    try:
        raw = read_small_file(path, "config file")
        return tomllib.loads(raw.decode("utf-8"))
    except PrefillDiffError as e:
        raise ConfigError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def resolve_source(source: str) -> tuple[str, dict]:
    """A preset name or a TOML path -> (origin, nested config dict with the preset applied)."""
    if source in PRESETS:
        return source, {"preset": source, **PRESETS[source][1]}
    if not source.startswith("fault:") and source.endswith(TRACE_SUFFIXES):
        raise ConfigError(f"{source}: a trace file, not a preset or a config file (`prefill-diff compare` reads "
                          "traces)" if os.path.exists(source) else f"no such file: {source}")
    if not source.startswith("fault:") and not os.path.exists(source) and (
            source.endswith(".toml") or "/" in source or os.sep in source):
        raise ConfigError(f"no such file: {source}")
    if source.startswith("fault:") or not os.path.exists(source):
        raise ConfigError(f"{source!r} is neither a preset nor a config file"
                          f"{did_you_mean(source, PRESETS, '; did you mean {}?')} (presets: {', '.join(PRESETS)})")
    raw = read_toml(source)
    _check_keys("top level", raw, _SECTIONS, source)
    for key, value in raw.items():
        if key != "preset" and not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a [{key}] table (got {key} = {value!r})")
    if "preset" in raw and not isinstance(raw["preset"], str):
        raise ConfigError(f"{source}: preset must be a preset name (got {raw['preset']!r})")
    for key in ("reuse", "fault"):
        if isinstance(raw.get(key), dict):
            for k, v in raw[key].items():
                if isinstance(v, dict):
                    raise ConfigError(f"{source}: [{key}] {k} must be a value, not a table")
    preset = raw.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"{source}: preset must be one of {', '.join(PRESETS)} "
                          f"(got {preset!r}{did_you_mean(preset, PRESETS, '; did you mean {}?')})")
    base = PRESETS[preset][1] if preset else {}
    return source, _merge(base, raw)


def parse_run(conf: dict, where: str, name: str) -> RunConfig:
    run, cache = dict(conf.get("run", {})), dict(conf.get("cache", {}))
    engine = run.get("engine", "native")
    if not isinstance(engine, str) or engine not in registry.ENGINES:
        raise ConfigError(f"{where}: [run] engine must be one of {', '.join(registry.ENGINES)} (got {engine!r})"
                          + (did_you_mean(engine, set(registry.ENGINES)) if isinstance(engine, str) else ""))
    info = registry.engine(engine)
    _moved_keys(run, cache, info, where)
    moved, run_keys = _moved(), _run_keys()
    for k in sorted(set(run) & set(moved) - run_keys):
        e = moved[k]
        raise ConfigError(f"{where}: [run] {k} is an option of {e.words}: set it in its own table, "
                          f"[run.{e.table}] {k} = {_toml(run[k])}")
    _check_keys("run", run, run_keys, where)
    _check_keys("cache", cache, _CACHE_KEYS, where)
    options = _engine_options(run, info, where)
    _check_types("run", run, RunConfig, where)
    _check_types("cache", cache, CacheLayout, where)
    _made(CacheLayout, "cache", where, **cache)  # the cache's own checks, said under [cache]
    reuse, fault = conf.get("reuse"), conf.get("fault")
    if reuse is not None:
        _check_keys("reuse", reuse, {f.name for f in fields(ReuseConfig)}, where)
        _check_types("reuse", reuse, ReuseConfig, where)
        reuse = _made(ReuseConfig, "reuse", where, **reuse)
    if fault is not None:
        _check_keys("fault", fault, {f.name for f in fields(FaultConfig)}, where)
        _check_types("fault", fault, FaultConfig, where)
        fault = _made(FaultConfig, "fault", where, **fault)
    return _made(RunConfig, "run", where, name=name, cache_dtype=cache.get("dtype"),
                 int8_scales=cache.get("int8_scales", "per-token"), reuse=reuse, fault=fault, options=options, **run)


def _moved_keys(run: dict, cache: dict, info: registry.EngineInfo, where: str) -> None:
    """The read shim of configs and traces written before each engine had its own options table: an engine's
    option found where they kept it ([run] kernel, [cache] kind; registry ``legacy_keys``) moves into its table
    when the run is on that engine; on another engine it is dropped at its default (it meant nothing there) and
    refused otherwise, naming the engine it belongs to."""
    for e in registry.ENGINES.values():
        for section, old, new in e.legacy_keys:
            src = run if section == "run" else cache
            if old not in src:
                continue
            value = src.pop(old)
            _check_types(section, {new: value}, e.options_class, where, shown={new: old})
            try:
                e.options_class(**{new: value})
            except ConfigError as err:  # said under the name and section it was written in
                said = str(err)
                raise ConfigError(f"{where}: [{section}] {old}{said[len(new):] if said.startswith(new) else ': ' + said}"
                                  ) from None
            if e is not info:
                if value != registry.option_default(e, new):
                    raise ConfigError(f"{where}: [{section}] {old} is an option of {e.words}, [run.{e.table}] {new} "
                                      f"(engine is {info.name!r})")
                continue
            table = run.setdefault(e.table, {})
            if not isinstance(table, dict):
                continue  # refused with the table itself (_engine_options)
            if new in table:
                raise ConfigError(f"{where}: [{section}] {old} and [run.{e.table}] {new} set the same option; keep "
                                  f"[run.{e.table}] {new}")
            table[new] = value


def _made(cls, section: str, where: str, *args, **kw):
    """``cls(*args, **kw)``; a value its checks refuse is said with the file (or preset) and the section."""
    try:
        return cls(*args, **kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: [{section}] {e}") from None
    except TypeError as e:  # wrong value types reach dataclass constructors
        raise ConfigError(f"{where}: {e}") from None


def _toml(v) -> str:
    """A value as TOML writes it (true, 4, "f16")."""
    return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else repr(v)


def _engine_options(run: dict, info: registry.EngineInfo, where: str):
    """The [run.<table>] tables popped from ``run``: the engine's own, checked key by key and by type, becomes its
    options; another engine's table is refused."""
    known = _tables()
    tables = {k: run.pop(k) for k in list(run) if k in known}
    for table, value in tables.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: run.{table} must be a [run.{table}] table (got {value!r})")
        if table != info.table:
            raise ConfigError(f"{where}: [run.{table}] sets options of engine = \"{known[table].name}\" (engine "
                              f"is {info.name!r})")
    given = tables.get(info.table) or {}
    if info.options_class is None:
        return None
    _check_keys(f"run.{info.table}", given, registry.option_names(info), where)
    _check_types(f"run.{info.table}", given, info.options_class, where)
    try:
        return info.options_class(**given)
    except ConfigError as e:
        raise ConfigError(f"{where}: [run.{info.table}] {e}") from None


def parse_model(section: dict, where: str) -> ModelSpec:
    known = _MODEL_KEYS | set(ModelArgs.__dataclass_fields__)
    _check_keys("model", section, known, where)
    source = section.get("source", "synthetic")
    if not isinstance(source, str):
        raise ConfigError(f"{where}: [model] source must be str (got {source!r})")
    seed = section.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{where}: [model] seed must be int (got {seed!r})")
    overrides = {k: v for k, v in section.items() if k not in _MODEL_KEYS}
    _check_types("model", overrides, ModelArgs, where, skip=("rope_scaling",))
    adapter = section.get("adapter") or {}
    if not isinstance(adapter, dict):
        raise ConfigError(f"{where}: [model.adapter] must be a table (got {adapter!r})")
    kinds = {"id": (str,), "rank": (int,), "seed": (int,), "scale": (int, float)}
    _check_keys("model.adapter", adapter, set(kinds), where)
    for k, v in adapter.items():
        if isinstance(v, bool) or not isinstance(v, kinds[k]):
            raise ConfigError(f"{where}: [model.adapter] {k} must be {' or '.join(t.__name__ for t in kinds[k])} "
                              f"(got {v!r})")
    if overrides.get("rope_scaling") is not None:
        if not isinstance(overrides["rope_scaling"], dict):
            raise ConfigError(f"{where}: [model] rope_scaling must be a table, e.g. "
                              f"{{ rope_type = \"llama3\", factor = 8.0 }} (got {overrides['rope_scaling']!r})")
        overrides["rope_scaling"] = tuple(sorted(overrides["rope_scaling"].items()))
    check_model_source(source, f"{where}: [model] source")
    if overrides and source in MODEL_PRESETS:  # the sizes' own rules (n_heads divisible by n_kv_heads, ...)
        _made(MODEL_PRESETS[source].replace, "model", where, **overrides)
    elif overrides:
        raise ConfigError(f"{where}: [model] size overrides apply to synthetic models only (source {source!r}; "
                          f"overridden: {', '.join(sorted(overrides))})")
    first = section.get("first_layers")
    if first is not None and (isinstance(first, bool) or not isinstance(first, int)):
        raise ConfigError(f"{where}: [model] first_layers must be an integer (got {first!r})")
    return ModelSpec(source, seed, tuple(sorted(overrides.items())),
                     tuple(sorted(adapter.items())), first)


def check_model_source(source: str, what: str) -> None:
    """Refuse a model source that names no built-in model and no file kind (``what``: where it was given)."""
    if source in MODEL_PRESETS or source.startswith(("hf:", "gguf:")) or source == "smollm2":
        return
    raise ConfigError(f"{what} must be one of {', '.join(MODEL_PRESETS)}, hf:<dir>, gguf:<file>, smollm2 "
                      f"(got {source!r}{did_you_mean(source, [*MODEL_PRESETS, 'smollm2'], '; did you mean {}?')})")


def parse_inputs(section: dict, where: str) -> Inputs:
    _check_keys("inputs", section, {f.name for f in fields(Inputs)}, where)

    def nested(key, depth):
        val = section.get(key)
        if val is None:
            return None
        def freeze(v, d):
            if d == 0:
                return v
            if not isinstance(v, list):
                raise ConfigError(f"{where}: [inputs] {key} must be a list nested {depth} deep (got {v!r})")
            return tuple(freeze(x, d - 1) for x in v)
        return freeze(val, depth)

    ids = nested("token_ids", 2)
    if ids is not None and not ids:
        raise ConfigError(f"{where}: [inputs] token_ids is empty (give at least one sample, or leave it out)")
    ids = ids or ()
    prompts = section.get("prompts", ())
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"{where}: [inputs] prompts must be a list of strings (got {prompts!r})")
    prompts = tuple(prompts)
    pad_id = section.get("pad_id")
    if pad_id is not None and (not isinstance(pad_id, int) or isinstance(pad_id, bool)):
        raise ConfigError(f"{where}: [inputs] pad_id must be int (got {pad_id!r})")
    if ids and prompts:
        raise ConfigError(f"{where}: [inputs] sets both token_ids and prompts; use one")
    for b, row in enumerate(ids):
        if not row:
            raise ConfigError(f"{where}: [inputs] token_ids sample {b} is empty")
        for t in row:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ConfigError(f"{where}: [inputs] token_ids must be integers (sample {b} has {t!r})")
    positions = nested("positions", 2)
    for key, rows in (("token_ids", ids), ("positions", positions), ("attention_mask", nested("attention_mask", 2))):
        for b, row in enumerate(rows or ()):
            for i, t in enumerate(row):
                if isinstance(t, int):
                    check_int64(t, f"{where}: [inputs] {key} sample {b}, position {i}")
    if pad_id is not None:
        check_int64(pad_id, f"{where}: [inputs] pad_id")
    responses = nested("responses", 2)
    for b, row in enumerate(responses or ()):
        for i, t in enumerate(row):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ConfigError(f"{where}: [inputs] responses must be integers (sample {b} has {t!r})")
            check_int64(t, f"{where}: [inputs] responses sample {b}, token {i}")
    texts = section.get("response_texts", ())
    if not isinstance(texts, (list, tuple)) or not all(isinstance(p, str) for p in texts):
        raise ConfigError(f"{where}: [inputs] response_texts must be a list of strings (got {texts!r})")
    if responses is not None and texts:
        raise ConfigError(f"{where}: [inputs] sets both responses and response_texts; use one")
    return Inputs(ids, prompts, positions, nested("segments", 3), pad_id,
                  nested("attention_mask", 2), responses, tuple(texts))


def load_side(source: str, model: ModelSpec | None = None, inputs: Inputs | None = None) -> Side:
    """Resolve REF or CAND: the config's own [model]/[inputs] win over the shared ones."""
    origin, conf = resolve_source(source)
    where = origin if origin not in PRESETS else f"preset {origin}"
    run = parse_run(conf, where, origin)
    m = parse_model(conf["model"], where) if "model" in conf else (model or ModelSpec())
    if model is not None and model.first_layers is not None and m.first_layers is None:  # --first-layers N cuts a
        m = replace(m, first_layers=model.first_layers)                                    # config's model too
    i = parse_inputs(conf["inputs"], where) if "inputs" in conf else (inputs or Inputs())
    return Side(m, i, run, origin)


def describe(side: Side) -> dict:
    return {"origin": side.origin, "model": side.model.describe(), "inputs": side.inputs.as_dict(),
            "run": side.run.as_dict()}
