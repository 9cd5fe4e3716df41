"""Summaries of a trace for `prefill-diff inspect`: plain data, rendered by the CLI.

Works at every level from the statistics each trace carries, so it never reads a
full tensor unless asked for one sample's values. Does not import torch.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..engine.shared.errors import PrefillDiffError
from .reader import Trace
from .schema import ATTR_CHANNELS, FINAL, FINAL_TENSORS, OP_NAMES, SAMPLED_TOKENS, STAT_COLUMNS, STAT_TENSORS

DEFAULT_CHANNELS = 8  # values shown per row unless --channel says which

LEVEL_HOLDS = {
    "full": None,
    "sampled": ("sampled level: values are kept only at up to 8 token positions per sample and up to 32 channels "
                "per tensor (see --layer/--tensor/--sample); every other cell has statistics only"),
    "stats": ("stats level: this trace keeps statistics (count, finite count, min, max, mean, L2 norm) and "
              "checksums per layer, tensor and sample, and no values except the final logits and norm_last; "
              "record with --level full (or sampled) to see values"),
}


class InspectError(PrefillDiffError):
    """A drill-down option names something the trace does not have."""


def _stat_row(table: np.ndarray, samples) -> dict:
    c = {k: i for i, k in enumerate(STAT_COLUMNS)}
    t = table[list(samples)]
    count = float(t[:, c["count"]].sum())
    finite = float(t[:, c["finite"]].sum())
    with np.errstate(invalid="ignore"):
        mean = float((t[:, c["mean"]] * t[:, c["count"]]).sum() / count) if count else float("nan")
    return {"count": int(count), "finite": int(finite), "nonfinite": int(count - finite),
            "min": float(np.min(t[:, c["min"]])) if count else None,
            "max": float(np.max(t[:, c["max"]])) if count else None,
            "mean": mean, "l2": float(np.sqrt((t[:, c["l2"]] ** 2).sum())),
            "pad_nonfinite": int((t[:, c["pad_count"]] - t[:, c["pad_finite"]]).sum())}


def parse_channels(spec: str | None) -> list[int] | None:
    """--channel: 37, 30-40 or 1,5,9 (None: the first DEFAULT_CHANNELS)."""
    if spec is None:
        return None
    out = []
    try:
        for part in str(spec).replace(" ", "").split(","):
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise InspectError(f"--channel takes a channel, a range or a list, e.g. 37, 30-40 or 1,5,9 "
                           f"(got {spec!r})") from None
    if not out or min(out) < 0:
        raise InspectError(f"--channel takes non-negative channel indices (got {spec!r})")
    return out


def _check_options(t: Trace, layer, tensor, sample, position) -> None:
    """Refuse a drill-down that names something the trace does not have (InspectError)."""
    if tensor in FINAL_TENSORS and layer is not None:
        raise InspectError(f"{t.name}: --tensor {tensor} is a final-stage tensor; drop --layer")
    if layer is not None and not 0 <= layer < t.n_layers:
        raise InspectError(f"{t.name}: --layer must be in [0, {t.n_layers}) (got {layer})")
    if sample is not None and not 0 <= sample < t.n_samples:
        raise InspectError(f"{t.name}: --sample must be in [0, {t.n_samples}) (got {sample})")
    if tensor is not None and tensor not in STAT_TENSORS + FINAL_TENSORS + OP_NAMES:
        raise InspectError(f"{t.name}: --tensor must be one of {', '.join(STAT_TENSORS + FINAL_TENSORS)} or, in "
                           f"a trace recorded at --level ops, {', '.join(OP_NAMES)} (got {tensor!r})")
    if position is not None and sample is None:
        raise InspectError(f"{t.name}: --position needs --sample (positions are counted within a sample)")
    if position is not None and not 0 <= position < int(t.lengths[sample]):
        raise InspectError(f"{t.name}: --position must be in [0, {int(t.lengths[sample])}) for sample {sample} "
                           f"(got {position})")


def _header(t: Trace, samples) -> dict:
    """What the trace says about its model, run and samples."""
    m = t.meta
    side = m.get("side", {})
    run = side.get("run") or {}
    texts = m.get("texts") or []
    return {
        "file": t.name, "format_version": t.version, "level": t.level,
        "model": {"source": t.model.get("source"), "args": t.args, "weights_digest": t.model.get("weights_digest"),
                  "adapter": t.model.get("adapter"),
                  "quantized_weights_digest": (m.get("record") or {}).get("quantized_weights_digest")},
        "run": {"origin": side.get("origin"), "engine": m.get("engine"), "layout": m.get("layout"),
                "reuse": run.get("reuse"), "fault": run.get("fault")},
        "repro": m.get("repro"), "tolerance": m.get("tolerance"), "parallel": m.get("parallel"),
        "record": m.get("record"), "provenance": m.get("provenance"),
        "samples": [{"sample": s, "length": int(t.lengths[s]), "token_ids": list(t.samples[s]),
                     "computed": int(t.cells(s)[0].size),  # also checks the sample's layout is consistent
                     "text": texts[s] if s < len(texts) else None} for s in samples],
        "rectangle": [t.n_samples, t.n_cols],
    }


def _layer_rows(t: Trace, layers, names, samples, sample) -> list[dict]:
    """Per layer: the statistics of each named tensor over ``samples`` (and its checksum for one sample)."""
    rows = []
    for i in layers:
        v = t.layer(i)
        row = {"layer": i, "tensors": {}, "cache_lengths": [int(v.cache_lengths[s]) for s in samples]}
        for name in names:
            st = v.stats(name)
            if st is not None:
                row["tensors"][name] = _stat_row(st, samples)
                if sample is not None:
                    chk = v.checksum(name)
                    row["tensors"][name]["checksum"] = None if chk is None else int(chk[sample])
        rows.append(row)
    return rows


def _routing_rows(t: Trace, layers, samples) -> list[dict]:
    """Per MoE layer: how many of the samples' tokens each expert took, and the smallest router margin (the
    token nearest a flip)."""
    rows = []
    E = t.args.get("n_experts")
    for i in layers:
        v = t.layer(i)
        if v.routing("ids") is None or not E:
            continue
        ids, margin = t.read(v.routing("ids")), t.read(v.routing("margin"))
        load = np.zeros(int(E), dtype=np.int64)
        low = None
        for s in samples:
            cols, toks = t.cells(s)
            taken = ids[s, cols]
            load += np.bincount(taken[taken >= 0].ravel(), minlength=int(E))[:int(E)]
            if cols.size:
                j = int(np.argmin(margin[s, cols]))
                m = float(margin[s, cols][j])
                if low is None or m < low["margin"]:
                    low = {"sample": int(s), "position": int(toks[j]), "margin": m,
                           "experts": [int(x) for x in ids[s, cols[j]]]}
        rows.append({"layer": i, "tokens_per_expert": load.tolist(), "nearest_flip": low})
    return rows


def _final_rows(t: Trace, samples) -> list[dict]:
    fin = t.final
    token_text = t.meta.get("token_text") or {}
    all_ids = t.samples
    out = []
    for s in samples:
        ids = fin["topk_ids"][s].tolist()
        pos = int(fin["gather_token"][s])  # the sample's token position whose logits were kept
        sample_ids = all_ids[s] if s < len(all_ids) else ()
        out.append({"sample": s, "gathered_position": pos, "gathered_token": pos,  # the old name, kept for readers
                    "gathered_id": int(sample_ids[pos]) if 0 <= pos < len(sample_ids) else None,
                    "gathered_column": int(fin["gather_col"][s]),
                    "top_ids": ids, "top_logits": [float(x) for x in fin["topk_logits"][s]],
                    "top_text": [token_text.get(str(i)) for i in ids] if token_text else None})
    return out


def summarize(t: Trace, layer: int | None = None, tensor: str | None = None, sample: int | None = None,
              position: int | None = None, channel: str | None = None) -> dict:
    """The summary `inspect` renders: header, per-layer statistics, final outputs, and one tensor's values
    when --layer/--tensor/--sample name one."""
    channels = parse_channels(channel)
    _check_options(t, layer, tensor, sample, position)
    samples = range(t.n_samples) if sample is None else [sample]
    layers = range(t.n_layers) if layer is None else [layer]
    names = STAT_TENSORS if tensor is None else (tensor,) if tensor in STAT_TENSORS else ()
    out = {**_header(t, samples), "layers": _layer_rows(t, layers, names, samples, sample),
           "final": _final_rows(t, samples), "routing": _routing_rows(t, layers, samples),
           "levels_note": [LEVEL_HOLDS[t.level]] if LEVEL_HOLDS.get(t.level) else []}
    if t.ops:  # format 1.4, --level ops: which ops each layer holds, and why the others are absent
        by_why: dict = {}
        for name, why in (t.ops.get("absent") or {}).items():
            by_why.setdefault(why, []).append(name)
        out["levels_note"].append(f"op-level states recorded: {', '.join(t.ops.get('recorded') or ()) or 'none'}"
                                  + "".join(f"; absent: {', '.join(names)} ({why})" for why, names in by_why.items())
                                  + " (--layer L --tensor OP --sample S shows one)")
    want_values = sample is not None and tensor is not None and (layer is not None or tensor in FINAL_TENSORS)
    if want_values:
        values, why = _values(t, layer, tensor, sample, position, channels)
        if values is not None:
            out["values"] = values
        else:
            out["levels_note"].append(why)
    elif tensor is not None or position is not None or channel is not None:
        need = "--sample" if tensor in FINAL_TENSORS else "--layer, --tensor and --sample"
        out["levels_note"].append(f"values are shown for one tensor of one sample: give {need}")
    return out


def _pick(n: int, channels: list[int] | None, what: str) -> list[int]:
    if channels is None:
        return list(range(min(n, DEFAULT_CHANNELS)))
    bad = [c for c in channels if c >= n]
    if bad:
        raise InspectError(f"--channel must be below {n}, the channels of {what} (got {bad[0]})")
    return channels


class Values(NamedTuple):
    """One tensor's values for `inspect`, or why there are none (exactly one is None)."""
    values: dict | None
    why: str | None


def _values(t: Trace, layer, tensor, sample, position, channels) -> Values:
    """Rows are token positions (cache: slots); from the full tensor, else its sampled subset."""
    where = f"{tensor} of layer {layer}" if layer is not None else tensor
    if tensor in FINAL_TENSORS:
        return _final_values(t, tensor, sample, position, channels)
    v = t.layer(layer)
    if tensor in OP_NAMES:
        full = v.op(tensor)
        return _full_values(t, v, full, tensor, sample, position, channels, where) if full is not None else \
            Values(None, f"{where} is not recorded in this trace (op-level states: record with --level ops)")
    full = v.cache(tensor.split("_", 1)[1]) if tensor.startswith("cache_") else v.state(tensor)
    if full is not None:
        return _full_values(t, v, full, tensor, sample, position, channels, where)
    samp = v.sampled(tensor)
    if samp is not None:
        return _sampled_values(t, samp, tensor, layer, sample, position, channels, where)
    if t.level == "stats":
        return Values(None, f"stats level: no values of {where} in this trace, only its statistics (above)")
    return Values(None, f"{where} is not recorded in this trace (its statistics, if any, are above)")


def _final_values(t: Trace, tensor, sample, position, channels) -> Values:
    ds = t.f[FINAL[tensor].path]
    row = t.read(ds, (sample,))
    tok = int(t.final["gather_token"][sample])
    if position is not None and position != tok:
        return Values(None, f"{tensor} is kept only at sample {sample}'s gathered position {tok}, "
                            f"not at position {position}")
    ch = _pick(row.shape[-1], channels, tensor)
    return Values({"tensor": tensor, "layer": None, "sample": sample, "kind": "final stage, gathered position",
                   "row_name": "pos", "rows": [tok], "shape": [1, int(row.shape[-1])], "channels": ch,
                   "head": [row[ch].tolist()], "dtype": t.source_dtype(ds)}, None)


def _full_values(t: Trace, v, full, tensor, sample, position, channels, where) -> Values:
    data = t.read(full, (sample,))
    if tensor.startswith("cache_"):  # [H, T, D] -> slots x (H·D), slots up to the sample's cache length
        T = int(v.cache_lengths[sample])
        flat = np.transpose(data, (1, 0, 2)).reshape(data.shape[1], -1)[:T]
        rows = [int(p) for p in v.cache_positions[sample, :T]]
        kind, row_name = "cache slots in logical order, channels = head·head_dim + d", "position"
    else:
        cols, toks = t.cells(sample)
        flat, rows, kind, row_name = data[cols], [int(x) for x in toks], "valid positions", "pos"
    if position is not None:
        if position not in rows:
            return Values(None, f"{where} holds no row for position {position} of sample {sample}")
        keep = [rows.index(position)]
        flat, rows = flat[keep], [position]
    ch = _pick(flat.shape[-1], channels, where)
    return Values({"tensor": tensor, "layer": v.layer, "sample": sample, "kind": kind, "row_name": row_name,
                   "rows": rows, "shape": list(flat.shape), "channels": ch, "head": flat[:, ch].tolist(),
                   "dtype": t.source_dtype(full)}, None)


def _sampled_values(t: Trace, samp, tensor, layer, sample, position, channels, where) -> Values:
    have = [int(c) for c in samp.attrs[ATTR_CHANNELS]]
    toks = t.read(t.f[SAMPLED_TOKENS.path], (sample,))
    data = t.read(samp, (sample,))
    keep = [j for j, tk in enumerate(toks) if tk >= 0 and (position is None or tk == position)]
    if not keep:
        return Values(None, f"sampled level: position {position} of sample {sample} is not among the sampled "
                            f"positions {[int(x) for x in toks if x >= 0]}")
    if channels is None:
        idx = list(range(min(len(have), DEFAULT_CHANNELS)))
    else:
        missing = [c for c in channels if c not in have]
        if missing:
            return Values(None, f"sampled level: channel {missing[0]} of {where} is not sampled; the sampled "
                                f"channels are {have}")
        idx = [have.index(c) for c in channels]
    return Values({"tensor": tensor, "layer": layer, "sample": sample,
                   "kind": "sampled level: declared subset of positions and channels", "row_name": "pos",
                   "rows": [int(toks[j]) for j in keep], "shape": [len(keep), len(have)],
                   "channels": [have[i] for i in idx], "head": data[keep][:, idx].tolist(),
                   "dtype": t.source_dtype(samp)}, None)
