"""The trace's ``meta`` JSON declared once, as dumps/schema.py declares its datasets: one ``Field`` per key.

A row names a key by its dotted path from ``meta`` (``[]`` stands for a list's items: ``meta.record.reuse[].sample``),
its check (the vocabulary below: each check takes (value, path) and raises MetaError), the format version that
added it, the engines that write it and what it means. A row whose check is ``Obj`` or ``List`` is an object or a
list of objects whose keys are the rows beneath it. dumps/metacheck.py builds the reader's checker from ``FIELDS``
(``build``) and the recorder checks what it writes with the same checker; docs/trace-format.md's table of ``meta``
keys is held to ``FIELDS`` and to the engines' own sections (tests/unit/dumps/test_meta_fields.py).

An engine's own record (``meta.record.vllm``, ``meta.record.llama_cpp``) is declared beside that engine, as plain
data (``section_fields`` reads it), and registered in engine/registry.py (``record_section``): the recorder checks
it strictly when the job hands it over (this package imports no engine); a reader accepts it loosely, except the
fields the tools read, declared here too (``meta.record.vllm.bf16_rounding``).

``MODEL_ARGS`` derives from engine/models/args.py's ``ModelArgs``: the names and kinds from its fields, the ranges
from ``ARG_BOUNDS`` (tests/unit/dumps/test_meta_fields.py holds the two to each other). Does not import torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

from ..engine.models.args import ModelArgs
from ..engine.shared.precisions import ACT_DTYPES, PRECISION_ORDER
from .schema import OP_NAMES, TOL_FIELDS, TOL_KINDS

INT64 = (-(1 << 63), (1 << 63) - 1)
TEXT_LIMIT = 1 << 16  # characters of one metadata string
LIST_LIMIT = 1 << 20  # items of one metadata list


class MetaError(ValueError):
    """One field of the metadata breaks the schema: ``path`` names it."""

    def __init__(self, path: str, rule: str, value=None, show_value: bool = True):
        self.path, self.rule = path, rule
        got = f" (got {_brief(value)})" if show_value else ""
        super().__init__(f"{path} {rule}{got}")


def _brief(v) -> str:
    s = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__ + " " + repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# -- value checks: each takes (value, path) and raises MetaError --------------------------------------------

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo=INT64[0], hi=INT64[1], none=False):
    def check(v, path):
        if v is None and none:
            return
        if not is_int(v) or not lo <= v <= hi:
            raise MetaError(path, f"must be an integer in [{lo}, {hi}]" + (" or null" if none else ""), v)
    return check


def number(lo=-math.inf, hi=math.inf, none=False, lo_open=False, hi_open=False):
    def check(v, path):
        if v is None and none:
            return
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
        if not ok:
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise MetaError(path, f"must be a finite number in {rng}" + (" or null" if none else ""), v)
    return check


def text(none=False, choices=None, limit=TEXT_LIMIT):
    def check(v, path):
        if v is None and none:
            return
        if not isinstance(v, str) or len(v) > limit:
            raise MetaError(path, "must be text" + (f" of at most {limit} characters" if isinstance(v, str) else "")
                            + (" or null" if none else ""), v)
        if choices is not None and v not in choices:
            raise MetaError(path, f"must be one of {', '.join(choices)}", v)
    return check


def boolean(none=False):
    def check(v, path):
        if not (isinstance(v, bool) or (v is None and none)):
            raise MetaError(path, "must be true or false" + (" or null" if none else ""), v)
    return check


def one_of(values, none=False):
    """One of the given JSON values (compared with their type: true is not 1)."""
    def check(v, path):
        if v is None and none:
            return
        if not any(type(v) is type(x) and v == x for x in values):
            raise MetaError(path, f"must be one of {', '.join(map(repr, values))}" + (" or null" if none else ""), v)
    return check


def anything(v, path):
    """Any JSON value (printed only as plain text)."""


def array(item, none=False, limit=LIST_LIMIT):
    def check(v, path):
        if v is None and none:
            return
        if not isinstance(v, list) or len(v) > limit:
            raise MetaError(path, "must be a list" + (" or null" if none else ""), v)
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")
    return check


def obj(fields: dict | None = None, none=False, values=None, closed=False, required=()):
    """A JSON object; ``fields`` checks known keys, ``values`` every value (a map), ``closed`` refuses others."""
    def check(v, path):
        if v is None and none:
            return
        if not isinstance(v, dict):
            raise MetaError(path, "must be a JSON object" + (" or null" if none else ""), v)
        for k in required:
            if k not in v:
                raise MetaError(f"{path}.{k}", "is required", show_value=False)
        for k, x in v.items():
            if fields and k in fields:
                fields[k](x, f"{path}.{k}")
            elif closed:
                known = ", ".join(sorted(fields or ()))
                raise MetaError(f"{path}.{_brief(k)[1:-1]}", f"is not a known key (known: {known})",
                                show_value=False)
            elif values is not None:
                values(x, f"{path}.{k}")
    return check


def either(*checks, rule: str):
    def check(v, path):
        for c in checks:
            try:
                c(v, path)
                return
            except MetaError:
                pass
        raise MetaError(path, rule, v)
    return check


# the vocabulary by name: an engine declares its own record as plain data, (kind, options): VOCABULARY[kind](**options)
VOCABULARY = {"integer": integer, "number": number, "text": text, "boolean": boolean, "one_of": one_of,
              "obj": obj, "array": array}


# -- the declaration ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Obj:
    """A JSON object whose keys are the rows beneath it (unknown keys allowed unless ``closed``). ``checked``
    False: this reader checks none of it (another module does, where it reads it); its rows declare it."""
    none: bool = False
    closed: bool = False
    required: tuple = ()
    checked: bool = True


@dataclass(frozen=True)
class List:
    """A list of JSON objects whose keys are the rows beneath ``NAME[]``."""
    none: bool = False
    limit: int = LIST_LIMIT


@dataclass(frozen=True)
class Field:
    """One metadata key: ``name`` from ``meta``, its ``check`` (a value check, ``Obj`` or ``List``), the format
    version that added it (``since``), the engines that write it (``("all",)``: every engine, through
    engine/engines.py's trace_meta or the job; a name: that engine's module) and its ``meaning``; ``required``:
    whether a writer MUST write it ("" when it MAY)."""
    name: str
    check: Callable | Obj | List
    meaning: str
    since: str = "1.0"
    writers: tuple = ("all",)
    required: str = ""


def parent(name: str) -> str:
    return name.rsplit(".", 1)[0]


def leaves(rows) -> list:
    """The rows no other row lies beneath (what docs/trace-format.md lists)."""
    inner = {p for r in rows for p in (parent(r.name), parent(r.name).removesuffix("[]"))}
    return [r for r in rows if r.name not in inner]


def build(rows, root: str = "meta", closed: bool = False) -> Callable:
    """The check of ``root`` made from the rows beneath it; ``closed``: every declared object refuses unknown
    keys (the write side's check of an engine's own record)."""
    by_name = {r.name: r for r in rows}
    kids: dict = {}
    for r in rows:
        if "." in r.name and not r.name.endswith("[]"):
            kids.setdefault(parent(r.name), []).append(r.name)

    def node(name: str):
        spec = by_name[name].check if name in by_name else Obj(closed=closed)
        if isinstance(spec, Obj) and not spec.checked:
            return anything
        if isinstance(spec, Obj):
            return obj({k.rsplit(".", 1)[1]: node(k) for k in kids.get(name, ())}, none=spec.none,
                       closed=spec.closed or closed, required=spec.required)
        if isinstance(spec, List):
            return array(node(name + "[]"), none=spec.none, limit=spec.limit)
        assert name not in kids, f"{name} has rows beneath it: its check must be Obj or List"
        return spec
    return node(root)


def section_fields(key: str, declared, writer: str) -> list:
    """An engine's own record, ``meta.record.<key>``, as Fields: ``declared`` is that engine's plain-data table of
    (field, kind, options, since, meaning) rows, ``kind`` a name of ``VOCABULARY`` (``obj`` or ``array`` with rows
    beneath it: ``Obj`` or ``List``)."""
    where = f"meta.record.{key}"
    names = {f"{where}.{n}" for n, *_ in declared}
    since = min((row[3] for row in declared), key=lambda v: tuple(map(int, v.split("."))))
    out = [Field(where, Obj(none=True), f"the {writer} engine's own record", since, (writer,))]
    for name, kind, options, since, meaning in declared:
        full = f"{where}.{name}"
        nested = any(p.startswith(full + ".") or p.startswith(full + "[].") for p in names)
        check = (Obj(**options) if kind == "obj" else List(**options)) if nested else VOCABULARY[kind](**options)
        out.append(Field(full, check, meaning, since, (writer,)))
    return out


# -- model.args: ModelArgs' fields, each with its range in a trace --------------------------------------------

# Upper bounds are far beyond any real model; memory is checked separately, before anything is allocated. A
# field's kind is its type in ModelArgs (int, float, str, bool; "| None": or null); a tuple field, stored as a
# JSON object or list, declares its check itself.
ARG_BOUNDS = {
    "dim": dict(lo=1, hi=1 << 20), "n_layers": dict(lo=1, hi=10_000), "n_heads": dict(lo=1, hi=1 << 12),
    "n_kv_heads": dict(lo=1, hi=1 << 12), "head_dim": dict(lo=1, hi=1 << 14), "hidden_dim": dict(lo=1, hi=1 << 22),
    "vocab_size": dict(lo=1, hi=1 << 26), "norm_eps": dict(lo=0, hi=1, lo_open=True), "hidden_act": {},
    "rope_theta": dict(lo=0, lo_open=True),
    "rope_scaling": either(obj(values=either(number(none=True), text(), boolean(), array(number(), limit=1 << 16),
                                             rule="a number, text, boolean or list of numbers")),
                           array(array(anything, limit=2), limit=64),
                           rule="must be a JSON object of rope scaling parameters"),
    "tie_embeddings": {}, "qkv_bias": {}, "o_bias": {}, "mlp_bias": {}, "qk_norm": {}, "norm_placement": {},
    "norm_scale": {}, "embed_scale": {}, "attn_softcap": dict(lo=0, lo_open=True),
    "final_softcap": dict(lo=0, lo_open=True), "rope_local_theta": dict(lo=0, lo_open=True),
    "sliding_window": dict(lo=1, hi=1 << 40), "layer_types": array(text(choices=("full", "sliding")), limit=10_000),
    "attention_multiplier": dict(lo=0, lo_open=True), "embedding_multiplier": dict(lo=0, lo_open=True),
    "residual_multiplier": dict(lo=0, lo_open=True), "logits_scaling": dict(lo=0, lo_open=True),
    "n_experts": dict(lo=0, hi=1 << 20), "n_active_experts": dict(lo=0, hi=1 << 20),
    "moe_hidden_dim": dict(lo=0, hi=1 << 22), "norm_topk_prob": {},
    "moe_weight_dtype": dict(choices=("activation", "float32")), "shared_expert_dim": dict(lo=0, hi=1 << 22),
    "dense_layers": array(integer(0, 10_000), limit=10_000), "lm_head_bias": {},
    "dropout": dict(lo=0, hi=1, hi_open=True),
    "max_position": dict(lo=1, hi=1 << 40), "tokenizer_vocab_size": dict(lo=1, hi=1 << 26), "attention_rule": {},
    "arch": {},
}
ARG_KINDS = {"int": integer, "float": number, "str": text, "bool": boolean}
REQUIRED_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")  # they fix every shape
# the format version that added each field (the version writers were at when ModelArgs gained it)
ARGS_SINCE = {**dict.fromkeys(("hidden_act", "o_bias", "mlp_bias", "qk_norm", "norm_placement", "norm_scale",
                               "embed_scale", "attn_softcap", "final_softcap", "rope_local_theta", "sliding_window",
                               "layer_types", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                               "logits_scaling"), "1.1"),
              **dict.fromkeys(("n_experts", "n_active_experts", "moe_hidden_dim", "norm_topk_prob",
                               "moe_weight_dtype", "shared_expert_dim", "dense_layers"), "1.2")}


def arg_check(f) -> Callable:
    """The check of ModelArgs field ``f`` in a trace: ARG_BOUNDS' check, or its range on the field's kind."""
    bounds = ARG_BOUNDS[f.name]
    if callable(bounds):
        return bounds
    kind, _, rest = str(f.type).partition(" | ")
    return ARG_KINDS[kind](**bounds, **({"none": True} if rest == "None" else {}))


MODEL_ARGS = {f.name: arg_check(f) for f in fields(ModelArgs)}


def _args_rows() -> list:
    shapes = "fixes every shape in the file and whether two traces are comparable (a difference: a metadata break)"
    return [Field(f"meta.model.args.{name}", check,
                  shapes if name in REQUIRED_ARGS else "the model's identity (a difference: an identity break)",
                  ARGS_SINCE.get(name, "1.0"), required="MUST" if name in REQUIRED_ARGS else "")
            for name, check in MODEL_ARGS.items()]


# -- every key ------------------------------------------------------------------------------------------------

OURS = ("native", "transformers")  # the engines that run in prefill-diff's process on torch
DIGESTED = OURS + ("fsdp2",)  # the engines that digest their parameters (meta.parameters)
DATA_PARALLEL = OURS + ("fsdp2",)  # meta.parallel's keys a data-parallel run writes too (fsdp2: one merged trace)
ADAPTER_SPEC = obj({"id": text(), "rank": integer(1, 1 << 16), "seed": integer(), "scale": number()}, closed=True,
                   none=True)
BF16_ROUNDINGS = ("nearest", "truncate", "other", "unknown")  # as engine/foreign/vllm_record.py declares them
PARALLEL = "checked when a rank set is opened (dumps/rank_merge.py)"

FIELDS = (
    Field("meta", Obj(), "the run's description: a JSON object"),
    Field("meta.model", Obj(none=True), "the model"),
    Field("meta.model.source", text(), "where the weights came from: synthetic, seed-2.8, hf:DIR, gguf:FILE, smollm2"),
    Field("meta.model.spec", Obj(), "how the model was made (what compare BASELINE PRESET rebuilds)"),
    Field("meta.model.spec.source", text(), "the model source"),
    Field("meta.model.spec.seed", integer(), "the synthetic weights' seed"),
    Field("meta.model.spec.adapter", ADAPTER_SPEC, "a LoRA adapter: id, rank, seed, scale (null: none)"),
    Field("meta.model.spec.overrides", obj(MODEL_ARGS, closed=True), "model.args fields set over the source's"),
    Field("meta.model.args", Obj(), "the model's sizes and identity: ModelArgs' fields", required="MUST"),
    *_args_rows(),
    Field("meta.model.weights_digest", text(none=True), "sha256: digest of the source weights; a difference: a note"),
    Field("meta.model.adapter", Obj(none=True, required=("id",)), "a LoRA adapter (null: none)"),
    Field("meta.model.adapter.id", text(), "its id: a difference is an identity difference"),
    Field("meta.model.adapter.digest", text(), "its digest: a difference is an identity difference"),
    Field("meta.model.adapter.rank", integer(1, 1 << 16), "its rank"),
    Field("meta.model.truncated", Obj(none=True, closed=True), "the model cut to its first layers (--first-layers N)",
          "1.4"),
    Field("meta.model.truncated.layers", integer(1, 10_000), "the layers run (model.args.n_layers)", "1.4"),
    Field("meta.model.truncated.of", integer(1, 10_000), "the whole model's layers", "1.4"),
    Field("meta.model.rope_inv_freq", array(number(), none=True, limit=1 << 13),
          "RoPE inverse frequencies (head_dim/2): pre-rotation keys are rotated with them (null: transformers' model)",
          required="MUST when layout.key_rotation is pre"),
    Field("meta.model.rope_local_inv_freq", array(number(), none=True, limit=1 << 13),
          "a sliding-window layer's own frequencies (Gemma 3)", "1.1"),
    Field("meta.model.rope_long", Obj(none=True, closed=True), "LongRoPE (Phi-3)", "1.1"),
    Field("meta.model.rope_long.inv_freq", array(number(), limit=1 << 13), "the long factors' frequencies", "1.1"),
    Field("meta.model.rope_long.switch", integer(1, 1 << 40),
          "the original length: a sample whose positions pass it was rotated with inv_freq", "1.1"),
    Field("meta.model.rope_long.attention_factor", number(0, lo_open=True), "cos and sin's factor", "1.1"),
    Field("meta.side", Obj(none=True), "the full run configuration, as the job read it"),
    Field("meta.side.origin", text(none=True), "the preset or config path: the side's name in reports"),
    Field("meta.side.model", obj(none=True), "the [model] table"),
    Field("meta.side.inputs", obj(none=True), "the [inputs] table"),
    Field("meta.side.run", Obj(none=True), "the [run] table (its other keys: engine/config.py)"),
    Field("meta.side.run.dtype", text(choices=ACT_DTYPES), "the activation and weight dtype asked for", "1.3"),
    Field("meta.side.run.weight_quant", text(), "the weight quantisation asked for", "1.3"),
    Field("meta.side.run.cache_dtype", text(none=True), "the KV cache dtype asked for (null: the activation dtype)",
          "1.3"),
    Field("meta.side.run.int8_scales", text(), "an int8 KV cache's scales", "1.3"),
    Field("meta.side.run.chunk_size", integer(0), "the chunk size asked for (0: none)", "1.3"),
    Field("meta.side.run.deterministic", boolean(), "whether deterministic algorithms were asked for", "1.3"),
    Field("meta.side.run.reuse", obj(none=True), "the [reuse] table"),
    Field("meta.side.run.fault", obj(none=True), "the [fault] table"),
    Field("meta.engine", Obj(none=True), "the engine that ran"),
    Field("meta.engine.name", text(none=True), "native or transformers for our engines, anything for others"),
    Field("meta.engine.kernel", text(none=True), "the attention kernel (vLLM: its attention backend)"),
    Field("meta.engine.dtype", text(none=True), "the activation dtype: picks the default tolerance policy",
          required="MUST"),
    Field("meta.engine.batching", text(none=True), "unbatched, left, right or packed"),
    Field("meta.engine.chunk_size", integer(0, none=True), "our engine's chunk (0: unchunked); null for vLLM"),
    Field("meta.engine.activations", anything, "llama.cpp's activation dtype (float32)", "1.1", ("llama.cpp",)),
    Field("meta.engine.weight_quant", anything, "the GGUF's main quantized type, or null", "1.1", ("llama.cpp",)),
    Field("meta.engine.flash_attn", anything, "whether flash attention ran, as resolved", "1.1", ("llama.cpp",)),
    Field("meta.layout", Obj(none=True), "the KV cache's layout"),
    Field("meta.layout.kind", text(none=True), "contiguous or paged"),
    Field("meta.layout.dtype", text(none=True), "the KV cache's dtype: picks the cache tensors' tolerance"),
    Field("meta.layout.key_rotation", text(choices=("post", "pre")),
          "post (default): keys after RoPE; pre: before RoPE, rotated on read"),
    Field("meta.layout.page_size", integer(1, none=True), "a paged cache's page"),
    Field("meta.layout.int8_scales", text(none=True), "an int8 cache's scales"),
    Field("meta.layout.version", integer(none=True), "the layout's version"),
    Field("meta.layout.llama_cpp_types", anything, "llama.cpp's K and V cache types (ggml names)", "1.1",
          ("llama.cpp",)),
    Field("meta.texts", array(text(none=True), none=True), "the text prompts, one per sample"),
    Field("meta.token_text", obj(values=text(none=True), none=True), "id -> text for the ids in the trace"),
    Field("meta.repro", Obj(none=True), "what makes the run reproducible besides model and inputs (shown only)"),
    *(Field(f"meta.repro.{k}", anything, what) for k, what in (
        ("torch", "torch's version"), ("numpy", "numpy's"), ("h5py", "h5py's"), ("hdf5", "the HDF5 library's"),
        ("python", "Python's"), ("platform", "the platform"), ("device", "the device"),
        ("threads", "torch's threads"), ("deterministic_algorithms", "torch's deterministic algorithms setting"),
        ("nondeterministic_reductions_allowed", "whether the run allowed nondeterministic reductions"))),
    Field("meta.provenance", Obj(none=True), "who wrote the trace, how and when (differs between recordings)", "1.1"),
    Field("meta.provenance.version", text(limit=200), "prefill-diff's version", "1.1"),
    Field("meta.provenance.argv", text(), "the command line as one shell-quoted text", "1.1"),
    Field("meta.provenance.time", text(limit=64), "UTC, ISO 8601 to the second", "1.1"),
    Field("meta.run", obj(none=True), "a run configuration some writers keep beside meta.side (not read)"),
    Field("meta.tolerance", Obj(none=True, closed=True), "the declared tolerance policy (null: none)"),
    Field("meta.tolerance.base", text(choices=PRECISION_ORDER), "the policy it starts from"),
    Field("meta.tolerance.equal_nan", boolean(), "NaN equals NaN"),
    Field("meta.tolerance.topk", integer(1, 1 << 20), "the top ids compared"),
    Field("meta.tolerance.name", text(limit=200), "the policy's name"),
    *(Field(f"meta.tolerance.{k}", number(0), "every kind's bound") for k in TOL_FIELDS),
    *(Field(f"meta.tolerance.{k}", obj({f: number(0) for f in TOL_FIELDS}, closed=True),
            f"the {k} tensors' bounds", "1.2" if k == "router" else "1.0") for k in TOL_KINDS),
    Field("meta.absent_states", obj(values=text(), none=True),
          "{state: why} for states the model's layers do not have (schema.ABSENTABLE only)", "1.1"),
    Field("meta.parameters", Obj(none=True), "the model as the engine holds it after loading, tensor by tensor",
          "1.4", DIGESTED),
    Field("meta.parameters.naming", text(none=True, limit=64), "whose names: hf (Hugging Face module paths)", "1.4",
          DIGESTED),
    Field("meta.parameters.tensors", List(none=True), "every parameter (tied ones once), then every buffer",
          "1.4", DIGESTED),
    Field("meta.parameters.tensors[].name", text(limit=1024), "its name", "1.4", DIGESTED),
    Field("meta.parameters.tensors[].kind", text(choices=("parameter", "buffer")), "parameter or buffer", "1.4",
          DIGESTED),
    Field("meta.parameters.tensors[].dtype", text(limit=64), "its dtype as the engine holds it", "1.4", DIGESTED),
    Field("meta.parameters.tensors[].shape", array(integer(0), limit=64), "its shape", "1.4", DIGESTED),
    Field("meta.parameters.tensors[].sha256", text(limit=64), "sha256 of its bytes, the first 16 hex digits", "1.4",
          DIGESTED),
    Field("meta.parameters.not_reported", text(none=True), "why this run reports no digests", "1.4", DIGESTED),
    Field("meta.record", Obj(none=True), "what the engine reported about its run"),
    Field("meta.record.fault", Obj(none=True), "the fault injected (null: none)"),
    Field("meta.record.fault.name", text(), "its name"),
    Field("meta.record.fault.cannot_show", text(none=True), "why it cannot show in this run: INCONCLUSIVE"),
    Field("meta.record.reuse", List(none=True), "per sample, the prefix reuse decision"),
    Field("meta.record.reuse[].sample", integer(0), "the sample"),
    Field("meta.record.reuse[].prefix_len", integer(0), "the tokens reused"),
    Field("meta.record.reuse[].hit", boolean(), "whether the cache served them"),
    Field("meta.record.reuse[].forced", boolean(), "whether the reuse was forced"),
    Field("meta.record.reuse[].reason", text(none=True), "why there was no hit"),
    Field("meta.record.reuse[].expected", boolean(none=True), "a hit was the point of the run", "1.1"),
    Field("meta.record.invariant_violations", array(text(), none=True), "the KV cache invariants broken"),
    Field("meta.record.quantized_weights_digest", text(none=True), "digest of the weights as quantized"),
    Field("meta.record.timing", Obj(none=True), "a compiled run's timings", "1.1"),
    Field("meta.record.timing.compile_s", number(0, none=True), "torch.compile's warm-up of every call shape", "1.1"),
    Field("meta.record.timing.prefill_s", number(0, none=True), "the recorded run", "1.1"),
    Field("meta.record.prefill", Obj(none=True, required=("samples",)), "how the prefill ran", "1.2"),
    Field("meta.record.prefill.token_budget", integer(1, none=True), "the tokens a step may compute", "1.2"),
    Field("meta.record.prefill.budget_per", text(choices=("sample", "step"), none=True),
          "whether the budget is a sample's or a step's", "1.2"),
    Field("meta.record.prefill.samples", List(), "per sample", "1.2"),
    Field("meta.record.prefill.samples[]", Obj(required=("sample", "tokens", "from_cache", "computed", "steps")),
          "one sample's prefill", "1.2"),
    *(Field(f"meta.record.prefill.samples[].{k}", integer(0), what, "1.2") for k, what in (
        ("sample", "the sample"), ("tokens", "its length"), ("from_cache", "tokens served from a cache"),
        ("computed", "tokens computed"), ("steps", "forward steps"))),
    Field("meta.record.response", Obj(none=True, required=("samples",)), "the response each sample carries", "1.3"),
    Field("meta.record.response.chosen_by", text(choices=("given", "candidate", "self")),
          "who chose the response's tokens: given in the inputs, the candidate's or the recorded side's own "
          "greedy choice", "1.3"),
    Field("meta.record.response.samples", List(), "per sample with a response", "1.3"),
    Field("meta.record.response.samples[]", Obj(required=("sample", "prompt", "response")), "one sample's", "1.3"),
    *(Field(f"meta.record.response.samples[].{k}", integer(lo), what, "1.3") for k, lo, what in (
        ("sample", 0, "the sample"), ("prompt", 1, "its prompt's tokens"), ("response", 1, "its response's tokens"))),
    Field("meta.record.ops", Obj(none=True),
          "the op-level states recorded inside each layer (--level ops)", "1.4"),
    Field("meta.record.ops.recorded", array(text(choices=OP_NAMES)), "the ops recorded, in the order computed",
          "1.4"),
    Field("meta.record.ops.absent", obj(values=text()), "each op the engine cannot produce, and why", "1.4"),
    Field("meta.record.ops.how", obj(values=text(), none=True),
          "how the engine computes an op, where its code makes the rounding known (the hints read it)", "1.4"),
    Field("meta.record.ops.layers", array(integer(0), none=True),
          "the layers whose ops are recorded (null: every layer)", "1.4"),
    Field("meta.record.routing_forced", anything, "the (layer, sample, token) cells whose experts a replay forced",
          "1.2", OURS),
    Field("meta.record.vllm", Obj(none=True), "vLLM's own record (declared in engine/foreign/vllm_record.py)",
          "1.1", ("vllm",)),
    Field("meta.record.vllm.bf16_rounding", text(choices=BF16_ROUNDINGS, none=True),
          "how its kernels round float32 to bfloat16 (read by the report)", "1.1", ("vllm",)),
    Field("meta.parallel", Obj(none=True, checked=False), "a tensor-parallel rank trace (" + PARALLEL + "), or "
          "the one trace of a data-parallel run", "1.1", DATA_PARALLEL),
    *(Field(f"meta.parallel.{k}", anything, what, "1.1", DATA_PARALLEL) for k, what in (
        ("kind", "tensor, or data"), ("mesh", "[N]"), ("mesh_dims", "[\"tp\"], or [\"dp\"]"), ("world_size", "N"),
        ("backend", "the process group's backend"), ("layout", "the whole model's cache layout, or how the ranks' "
                                                               "samples make the one trace"))),
    *(Field(f"meta.parallel.{k}", anything, what, "1.4", ("fsdp2",)) for k, what in (
        ("strategy", "how the data-parallel ranks hold the model: fsdp2"),
        ("policy", "fsdp2's mixed-precision policy: param_dtype, reduce_dtype, reshard_after_forward"))),
    *(Field(f"meta.parallel.{k}", anything, what, "1.1", OURS) for k, what in (
        ("rank", "this rank"), ("query_heads", "[start, stop)"),
        ("kv_heads", "[start, stop)"), ("mlp_rows", "[start, stop)"), ("model_args", "the whole model's args"),
        ("run_id", "common to the set"),
        ("startup_s", "spawn to process group ready"), ("init_process_group_s", "its share of that"),
        ("prepare_s", "loading and sharding the model"), ("prefill_record_s", "the recorded run"),
        ("done_after_s", "spawn to done"), ("ranks", "a merged set's per-rank items"),
        ("files", "a merged set's rank files"))),
)
DECLARED = frozenset(r.name for r in FIELDS)


def value(meta: dict, name: str, default=None):
    """The value of the declared key ``name`` ("meta.layout.key_rotation") in ``meta``: ``default`` where the key,
    or an object above it, is missing (an object above it that is null reads as missing; the key itself null reads
    as null). A name the table does not declare is a KeyError: reads go through declared names."""
    if name not in DECLARED:
        raise KeyError(f"{name} is not a declared metadata key (dumps/meta_fields.py FIELDS)")
    *above, key = name.split(".")[1:]
    for part in above:
        meta = meta.get(part) if isinstance(meta, dict) else None
        if meta is None:
            return default
    return meta.get(key, default) if isinstance(meta, dict) else default
