"""The schema of a trace's ``meta`` JSON, checked when a trace is opened (docs/trace-format.md), and when it
is written: the keys an engine must give the recorder, and the same checks on what it will store.

A trace from a stranger is well-formed HDF5 whose metadata may still be wrong: a number where text is
expected, a list where an object is, an index out of range, two fields that disagree. Every field the
tools read is checked here for type, range and shape, and against the fields it must agree with, so bad
content is refused as a damaged trace naming the field, instead of failing deep inside a command.

Fields a third-party engine does not write may be missing (every field is optional unless a rule says
otherwise); unknown keys are allowed, as a newer 1.x writer may add some. Does not import torch.
"""
from __future__ import annotations

import json
import math

import numpy as np

from ..engine.shared.precisions import ACT_DTYPES, PRECISION_ORDER
from .schema import ABSENTABLE, TOL_FIELDS, TOL_KINDS

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

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo=INT64[0], hi=INT64[1], none=False):
    def check(v, path):
        if v is None and none:
            return
        if not _is_int(v) or not lo <= v <= hi:
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


# -- the schema ----------------------------------------------------------------------------------------------

# engine.models.args.ModelArgs, field by field (a test checks that the names agree). Upper bounds are far beyond any
# real model; memory is checked separately, before anything is allocated.
MODEL_ARGS = {
    "dim": integer(1, 1 << 20), "n_layers": integer(1, 10_000), "n_heads": integer(1, 1 << 12),
    "n_kv_heads": integer(1, 1 << 12), "head_dim": integer(1, 1 << 14), "hidden_dim": integer(1, 1 << 22),
    "vocab_size": integer(1, 1 << 26), "norm_eps": number(0, 1, lo_open=True), "rope_theta": number(0, lo_open=True),
    "rope_scaling": either(obj(values=either(number(none=True), text(), boolean(), array(number(), limit=1 << 16),
                                             rule="a number, text, boolean or list of numbers")),
                           array(array(anything, limit=2), limit=64),
                           rule="must be a JSON object of rope scaling parameters"),
    "tie_embeddings": boolean(), "qkv_bias": boolean(), "o_bias": boolean(), "mlp_bias": boolean(),
    "qk_norm": text(), "norm_placement": text(), "norm_scale": text(), "lm_head_bias": boolean(),
    "dropout": number(0, 1, hi_open=True), "max_position": integer(1, 1 << 40),
    "tokenizer_vocab_size": integer(1, 1 << 26, none=True), "attention_rule": text(), "arch": text(),
    "hidden_act": text(), "sliding_window": integer(1, 1 << 40, none=True),
    "layer_types": array(text(choices=("full", "sliding")), limit=10_000),
    "attention_multiplier": number(0, lo_open=True, none=True), "embedding_multiplier": number(0, lo_open=True),
    "residual_multiplier": number(0, lo_open=True), "logits_scaling": number(0, lo_open=True),
    "embed_scale": text(), "attn_softcap": number(0, lo_open=True, none=True),
    "final_softcap": number(0, lo_open=True, none=True), "rope_local_theta": number(0, lo_open=True, none=True),
    "n_experts": integer(0, 1 << 20), "n_active_experts": integer(0, 1 << 20), "moe_hidden_dim": integer(0, 1 << 22),
    "norm_topk_prob": boolean(), "moe_weight_dtype": text(choices=("activation", "float32")),
    "shared_expert_dim": integer(0, 1 << 22), "dense_layers": array(integer(0, 10_000), limit=10_000),
}

ADAPTER_SPEC = obj({"id": text(), "rank": integer(1, 1 << 16), "seed": integer(), "scale": number()}, closed=True,
                   none=True)
MODEL_SPEC = obj({"source": text(), "seed": integer(), "adapter": ADAPTER_SPEC,
                  "overrides": obj(MODEL_ARGS, closed=True)})

TOLERANCE = obj({"base": text(choices=PRECISION_ORDER), "equal_nan": boolean(), "topk": integer(1, 1 << 20),
                 "name": text(limit=200),
                 **{k: number(0) for k in TOL_FIELDS},
                 **{k: obj({f: number(0) for f in TOL_FIELDS}, closed=True) for k in TOL_KINDS}},
                closed=True, none=True)

REUSE_OUTCOME = obj({"sample": integer(0), "prefix_len": integer(0), "hit": boolean(), "forced": boolean(),
                     "reason": text(none=True), "expected": boolean(none=True)})

PREFILL = obj({"token_budget": integer(1, none=True), "budget_per": text(choices=("sample", "step"), none=True),
               "samples": array(obj({"sample": integer(0), "tokens": integer(0), "from_cache": integer(0),
                                     "computed": integer(0), "steps": integer(0)},
                                    required=("sample", "tokens", "from_cache", "computed", "steps")))},
              none=True, required=("samples",))

META = obj({
    "model": obj({
        "source": text(), "spec": MODEL_SPEC, "args": obj(MODEL_ARGS), "weights_digest": text(none=True),
        "adapter": obj({"id": text(), "digest": text(), "rank": integer(1, 1 << 16)}, none=True, required=("id",)),
        "rope_inv_freq": array(number(), none=True, limit=1 << 13),
        "rope_local_inv_freq": array(number(), none=True, limit=1 << 13),
        "rope_long": obj({"inv_freq": array(number(), limit=1 << 13), "switch": integer(1, 1 << 40),
                          "attention_factor": number(0, lo_open=True)}, closed=True, none=True),
    }, none=True),
    "side": obj({"origin": text(none=True), "model": obj(none=True), "inputs": obj(none=True),
                 "run": obj({"reuse": obj(none=True), "fault": obj(none=True)}, none=True)}, none=True),
    "engine": obj({"name": text(none=True), "kernel": text(none=True), "dtype": text(none=True),
                   "batching": text(none=True), "chunk_size": integer(0, none=True)}, none=True),
    "layout": obj({"dtype": text(none=True), "key_rotation": text(choices=("post", "pre")),
                   "kind": text(none=True), "page_size": integer(1, none=True), "int8_scales": text(none=True),
                   "version": integer(none=True)}, none=True),
    "texts": array(text(none=True), none=True),
    "token_text": obj(values=text(none=True), none=True),
    "repro": obj(none=True),
    "provenance": obj({"version": text(limit=200), "argv": text(), "time": text(limit=64)}, none=True),
    "run": obj(none=True),
    "tolerance": TOLERANCE,
    "absent_states": obj(values=text(), none=True),
    "record": obj({
        "fault": obj({"name": text(), "cannot_show": text(none=True)}, none=True),
        "reuse": array(REUSE_OUTCOME, none=True),
        "invariant_violations": array(text(), none=True),
        "quantized_weights_digest": text(none=True),
        "timing": obj({"compile_s": number(0, none=True), "prefill_s": number(0, none=True)}, none=True),
        "prefill": PREFILL,
    }, none=True),
})


def check_meta(meta) -> None:
    """Types and ranges of every field, then the rules between fields. Raises MetaError."""
    META(meta, "meta")
    model = meta.get("model") or {}
    args = model.get("args") or {}
    if _is_int(args.get("n_heads")) and _is_int(args.get("n_kv_heads")) and args["n_heads"] % args["n_kv_heads"]:
        raise MetaError("meta.model.args.n_heads", f"must be a multiple of n_kv_heads={args['n_kv_heads']}",
                        args["n_heads"])
    if _is_int(args.get("head_dim")) and args["head_dim"] % 2:
        raise MetaError("meta.model.args.head_dim", "must be even (RoPE rotates pairs)", args["head_dim"])
    absent = sorted(set(meta.get("absent_states") or {}) - set(ABSENTABLE))
    if absent:
        raise MetaError("meta.absent_states", f"may name only {', '.join(ABSENTABLE)} (got {absent[:4]})",
                        show_value=False)
    inv = model.get("rope_inv_freq")
    long = model.get("rope_long") or {}
    for where, freqs in (("rope_inv_freq", inv), ("rope_local_inv_freq", model.get("rope_local_inv_freq")),
                         ("rope_long.inv_freq", long.get("inv_freq"))):
        if freqs is not None and _is_int(args.get("head_dim")) and len(freqs) != args["head_dim"] // 2:
            raise MetaError(f"meta.model.{where}", f"must hold head_dim/2 = {args['head_dim'] // 2} frequencies "
                            f"(it holds {len(freqs)})", show_value=False)
    if (meta.get("layout") or {}).get("key_rotation") == "pre":
        if inv is None:
            raise MetaError("meta.model.rope_inv_freq", "is required when meta.layout.key_rotation is 'pre' "
                            "(keys are stored before rotation and compared after it)", show_value=False)
        if not _is_int(args.get("head_dim")):
            raise MetaError("meta.model.args.head_dim", "is required when meta.layout.key_rotation is 'pre'",
                            show_value=False)


def check_meta_against_file(meta, n_samples: int, lengths) -> None:
    """The rules between metadata and the datasets: one text per sample, reuse outcomes and prefill facts of real
    samples, each sample's prefill adding up to its length."""
    texts = meta.get("texts")
    if texts is not None and len(texts) not in (0, n_samples):
        raise MetaError("meta.texts", f"must hold one text per sample ({n_samples}; it holds {len(texts)})",
                        show_value=False)
    rec = meta.get("record") or {}
    for i, o in enumerate(rec.get("reuse") or ()):
        s = o.get("sample")
        if s is not None and s >= n_samples:
            raise MetaError(f"meta.record.reuse[{i}].sample", f"must name one of the {n_samples} samples", s)
    for i, o in enumerate((rec.get("prefill") or {}).get("samples") or ()):
        where = f"meta.record.prefill.samples[{i}]"
        if o["sample"] >= n_samples:
            raise MetaError(f"{where}.sample", f"must name one of the {n_samples} samples", o["sample"])
        if lengths is not None and o["tokens"] != int(lengths[o["sample"]]):
            raise MetaError(f"{where}.tokens", f"must be sample {o['sample']}'s length ({int(lengths[o['sample']])})",
                            o["tokens"])
        if o["from_cache"] + o["computed"] != o["tokens"]:
            raise MetaError(where, "must have from_cache + computed = tokens", show_value=False)


# -- the write side: what the recorder is given ------------------------------------------------------------

REQUIRED_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
OBJECT_KEYS = ("model", "side", "engine", "layout", "tolerance", "record", "repro", "run", "token_text",
               "provenance")


class MissingMeta(ValueError):
    """The metadata an engine passed to the recorder lacks a required key, or holds one of the wrong kind."""


def required_args(meta) -> dict:
    """The trace metadata an engine passes to ``Recorder.begin``; returns model.args. Raises MissingMeta naming
    the first missing or invalid required key."""
    if not isinstance(meta, dict):
        raise MissingMeta(f"meta must be a dict (a JSON object), got {type(meta).__name__}")
    for key in OBJECT_KEYS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise MissingMeta(f"meta.{key} must be a dict (a JSON object), got {type(meta[key]).__name__}")
    args = (meta.get("model") or {}).get("args")
    if not isinstance(args, dict):
        raise MissingMeta("meta.model.args is required: a dict with " + ", ".join(REQUIRED_ARGS) +
                            " (the model's sizes; see the Recorder docstring)")
    for key in REQUIRED_ARGS:
        v = args.get(key)
        if v is None:
            raise MissingMeta(f"meta.model.args.{key} is required (a positive integer; required: "
                                f"{', '.join(REQUIRED_ARGS)})")
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise MissingMeta(f"meta.model.args.{key} must be a positive integer (got {v!r})")
    if args["n_heads"] % args["n_kv_heads"]:
        raise MissingMeta(f"meta.model.args.n_heads must be a multiple of n_kv_heads (got n_heads="
                            f"{args['n_heads']}, n_kv_heads={args['n_kv_heads']})")
    dtype = (meta.get("engine") or {}).get("dtype")
    if dtype is None:
        raise MissingMeta("meta.engine.dtype is required: the engine's activation dtype, one of "
                            f"{', '.join(ACT_DTYPES)} (it picks the tolerance policy)")
    if dtype not in ACT_DTYPES:
        raise MissingMeta(f"meta.engine.dtype must be one of {', '.join(ACT_DTYPES)} (got {dtype!r})")
    if (meta.get("layout") or {}).get("key_rotation", "post") not in ("post", "pre"):
        raise MissingMeta(f"meta.layout.key_rotation must be 'post' or 'pre' "
                            f"(got {meta['layout']['key_rotation']!r})")
    if (meta.get("layout") or {}).get("key_rotation") == "pre":
        inv = (meta.get("model") or {}).get("rope_inv_freq")
        if not isinstance(inv, (list, tuple)) or len(inv) != args["head_dim"] // 2:
            raise MissingMeta(f"meta.model.rope_inv_freq is required with layout.key_rotation 'pre': "
                                f"{args['head_dim'] // 2} numbers (head_dim/2), got {str(inv)[:40]}")
    return args


def check_as_read(meta: dict, n_samples: int | None = None, lengths=None) -> None:
    """Refuse metadata the trace's own reader would refuse, checked on the JSON it is stored as (MetaError):
    the write side and the read side check one schema, so a recorded trace always opens."""
    stored = json.loads(json.dumps(meta, sort_keys=True, default=str))
    check_meta(stored)
    if n_samples is not None:
        check_meta_against_file(stored, n_samples, lengths)
