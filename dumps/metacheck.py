"""The schema of a trace's ``meta`` JSON, checked when a trace is opened (docs/trace-format.md), and when it
is written: the keys an engine must give the recorder, and the same checks on what it will store.

A trace from a stranger is well-formed HDF5 whose metadata may still be wrong: a number where text is
expected, a list where an object is, an index out of range, two fields that disagree. Every field the
tools read is checked here for type, range and shape, and against the fields it must agree with, so bad
content is refused as a damaged trace naming the field, instead of failing deep inside a command.

The fields are declared once, in dumps/meta_fields.py (``FIELDS``): ``META`` is built from that table. Fields a
third-party engine does not write may be missing (every field is optional unless a rule says otherwise); unknown
keys are allowed, as a newer 1.x writer may add some. Does not import torch.
"""
from __future__ import annotations

import json

import numpy as np

from ..engine.shared.precisions import ACT_DTYPES
from .meta_fields import FIELDS, REQUIRED_ARGS, MetaError, build, is_int, section_fields, value
from .schema import ABSENTABLE

META = build(FIELDS)


def check_meta(meta) -> None:
    """Types and ranges of every field, then the rules between fields. Raises MetaError."""
    META(meta, "meta")
    model = meta.get("model") or {}
    args = model.get("args") or {}
    if is_int(args.get("n_heads")) and is_int(args.get("n_kv_heads")) and args["n_heads"] % args["n_kv_heads"]:
        raise MetaError("meta.model.args.n_heads", f"must be a multiple of n_kv_heads={args['n_kv_heads']}",
                        args["n_heads"])
    if is_int(args.get("head_dim")) and args["head_dim"] % 2:
        raise MetaError("meta.model.args.head_dim", "must be even (RoPE rotates pairs)", args["head_dim"])
    absent = sorted(set(meta.get("absent_states") or {}) - set(ABSENTABLE))
    if absent:
        raise MetaError("meta.absent_states", f"may name only {', '.join(ABSENTABLE)} (got {absent[:4]})",
                        show_value=False)
    inv = model.get("rope_inv_freq")
    long = model.get("rope_long") or {}
    for where, freqs in (("rope_inv_freq", inv), ("rope_local_inv_freq", model.get("rope_local_inv_freq")),
                         ("rope_long.inv_freq", long.get("inv_freq"))):
        if freqs is not None and is_int(args.get("head_dim")) and len(freqs) != args["head_dim"] // 2:
            raise MetaError(f"meta.model.{where}", f"must hold head_dim/2 = {args['head_dim'] // 2} frequencies "
                            f"(it holds {len(freqs)})", show_value=False)
    if value(meta, "meta.layout.key_rotation") == "pre":
        if inv is None:
            raise MetaError("meta.model.rope_inv_freq", "is required when meta.layout.key_rotation is 'pre' "
                            "(keys are stored before rotation and compared after it)", show_value=False)
        if not is_int(args.get("head_dim")):
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
    for i, o in enumerate((rec.get("response") or {}).get("samples") or ()):
        where = f"meta.record.response.samples[{i}]"
        if o["sample"] >= n_samples:
            raise MetaError(f"{where}.sample", f"must name one of the {n_samples} samples", o["sample"])
        if lengths is not None and o["prompt"] + o["response"] != int(lengths[o["sample"]]):
            raise MetaError(where, f"must have prompt + response = sample {o['sample']}'s length "
                            f"({int(lengths[o['sample']])})", show_value=False)


# -- the write side: what the recorder is given ------------------------------------------------------------

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
    args = value(meta, "meta.model.args")
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
    dtype = value(meta, "meta.engine.dtype")
    if dtype is None:
        raise MissingMeta("meta.engine.dtype is required: the engine's activation dtype, one of "
                            f"{', '.join(ACT_DTYPES)} (it picks the tolerance policy)")
    if dtype not in ACT_DTYPES:
        raise MissingMeta(f"meta.engine.dtype must be one of {', '.join(ACT_DTYPES)} (got {dtype!r})")
    if value(meta, "meta.layout.key_rotation", "post") not in ("post", "pre"):
        raise MissingMeta(f"meta.layout.key_rotation must be 'post' or 'pre' "
                            f"(got {meta['layout']['key_rotation']!r})")
    if value(meta, "meta.layout.key_rotation") == "pre":
        inv = value(meta, "meta.model.rope_inv_freq")
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


def section_check(key: str, declared, writer: str):
    """The write side's check of an engine's own record, ``meta.record.<key>``, from its declaration (the rows of
    dumps/meta_fields.py ``section_fields``): strict, every declared object refuses an undeclared key."""
    return build(section_fields(key, declared, writer), f"meta.record.{key}", closed=True)


def check_section(meta: dict, key: str, check) -> None:
    """Refuse (MetaError, naming the field) an engine's own record that breaks its declaration."""
    record = value(meta, "meta.record")
    if isinstance(record, dict) and key in record:
        check(record[key], f"meta.record.{key}")
