"""Summaries of a trace for `prefill-diff inspect`: plain data, rendered by the CLI.

Works at every level from the statistics each trace carries, so it never reads a
full tensor unless asked for one sample's values. Does not import torch.
"""
from __future__ import annotations

import numpy as np

from ..engine.errors import PrefillDiffError
from .reader import Trace
from .schema import STAT_COLUMNS, STATES

STAT_TENSORS = STATES + ("cache_keys", "cache_values")


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


def summarize(t: Trace, layer: int | None = None, tensor: str | None = None, sample: int | None = None) -> dict:
    if layer is not None and not 0 <= layer < t.n_layers:
        raise InspectError(f"{t.name}: --layer must be in [0, {t.n_layers}) (got {layer})")
    if sample is not None and not 0 <= sample < t.n_samples:
        raise InspectError(f"{t.name}: --sample must be in [0, {t.n_samples}) (got {sample})")
    if tensor is not None and tensor not in STAT_TENSORS:
        raise InspectError(f"{t.name}: --tensor must be one of {', '.join(STAT_TENSORS)} (got {tensor!r})")
    m = t.meta
    side = m.get("side", {})
    run = side.get("run", {})
    texts = m.get("texts") or []
    token_text = m.get("token_text") or {}
    samples = range(t.n_samples) if sample is None else [sample]
    out = {
        "file": t.name, "format_version": t.version, "level": t.level,
        "model": {"source": t.model.get("source"), "args": t.args, "weights_digest": t.model.get("weights_digest"),
                  "adapter": t.model.get("adapter"),
                  "quantized_weights_digest": (m.get("record") or {}).get("quantized_weights_digest")},
        "run": {"origin": side.get("origin"), "engine": m.get("engine"), "layout": m.get("layout"),
                "reuse": run.get("reuse"), "fault": run.get("fault")},
        "repro": m.get("repro"), "tolerance": m.get("tolerance"), "parallel": m.get("parallel"),
        "record": m.get("record"),
        "samples": [{"sample": s, "length": int(t.lengths[s]), "token_ids": list(t.samples[s]),
                     "computed": int(t.cells(s)[0].size),  # also checks the sample's layout is consistent
                     "text": texts[s] if s < len(texts) else None} for s in samples],
        "rectangle": [t.n_samples, t.n_cols],
        "layers": [],
        "final": [],
    }
    layers = range(t.n_layers) if layer is None else [layer]
    names = STAT_TENSORS if tensor is None else (tensor,)
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
        out["layers"].append(row)
    fin = t.final
    for s in samples:
        ids = fin["topk_ids"][s].tolist()
        out["final"].append({"sample": s, "gathered_token": int(fin["gather_token"][s]),
                             "gathered_column": int(fin["gather_col"][s]),
                             "top_ids": ids, "top_logits": [float(x) for x in fin["topk_logits"][s]],
                             "top_text": [token_text.get(str(i)) for i in ids] if token_text else None})
    if sample is not None and layer is not None and tensor in STATES and t.level == "full":
        ds = t.layer(layer).state(tensor)
        if ds is not None:
            cols, toks = t.cells(sample)
            row = t.read(ds, (sample,))
            vals = row[cols]
            out["values"] = {"positions": toks.tolist(), "shape": list(vals.shape),
                             "head": vals[:, :8].tolist(), "dtype": t.source_dtype(ds)}
    return out
