"""The sampled level: values at a declared subset of (token, channel), the full side subset to match.

A sampled trace keeps, per tensor, the values of some tokens (``sampled/token_index``) at some
channels (the dataset's ``channels`` attribute). When the other side is full, its values are read at
the same tokens and channels; only tokens both sides hold are compared.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..dumps.reader import LayerView, Trace
from . import wording
from .context import Context
from .results import Accumulator, TensorResult
from .stats import compare_stats, pad_counts
from .tolerance import Tolerance


def _rows_by_token(trace: Trace, sampled, full, s: int, toks, channels, is_cache: bool) -> dict | None:
    """{token index: its row} of sample s at tokens ``toks``, from the sampled dataset or the full one (None:
    this side kept neither)."""
    if sampled is not None:
        own = trace.read(trace.f["sampled/token_index"], (s,))
        # residuals exist only for tokens this side computed (a reused prefix was not)
        done = None if is_cache else set(trace.cells(s)[1].tolist())
        slot = {int(t): j for j, t in enumerate(own) if t >= 0 and (done is None or int(t) in done)}
        data = trace.read(sampled, (s,))
        return {int(t): data[slot[int(t)]] for t in toks if int(t) in slot}
    if full is not None:
        cols, ctoks = trace.cells(s)
        where = {int(t): int(cl) for t, cl in zip(ctoks, cols)}
        data = trace.read(full, (s,))
        return {int(t): data[where[int(t)], channels] for t in toks if int(t) in where}
    return None


def compare_sampled(ctx: Context, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
    """Values at the sampled level's declared (token, channel) subset; the full side is subset to match."""
    ctx.skipped.add(wording.SAMPLED_ONLY)
    acc = Accumulator(tol, ctx.equal_nan)
    sides = ((r.sampled(name), r.state(name), ctx.ref), (c.sampled(name), c.state(name), ctx.cand))
    ds_s = sides[0][0] if sides[0][0] is not None else sides[1][0]
    channels = np.asarray(ds_s.attrs["channels"])
    tok_source = ctx.ref if sides[0][0] is not None else ctx.cand
    tok_index = tok_source.read(tok_source.f["sampled/token_index"])
    is_cache = name.startswith("cache_")
    for rs, cs in ctx.pairs:
        if is_cache and int(r.cache_lengths[rs]) != int(c.cache_lengths[cs]):
            continue  # the cache-length check reports this sample; its sampled slots do not line up
        toks = tok_index[rs if tok_source is ctx.ref else cs]
        toks = toks[toks >= 0]
        rows = []
        for (samp, full, trace), s in zip(sides, (rs, cs)):
            got = _rows_by_token(trace, samp, full, s, toks, channels, is_cache)
            if got is None:
                return TensorResult(tensor=name, level="none", tol=tol, note="no values in one trace")
            rows.append(got)
        common = [t for t in toks if int(t) in rows[0] and int(t) in rows[1]]
        if common:
            a = np.stack([rows[0][int(t)] for t in common])
            b = np.stack([rows[1][int(t)] for t in common])
            acc.add(a, b, rs, np.asarray(common))
    res = acc.result(name, "sampled", **pad_counts(ctx, r, c, name))
    if res.worst is not None:  # the worst element's channel: the tensor's, not its place among the sampled ones
        s, pos, k = res.worst
        res = replace(res, worst=(s, pos, int(channels[k])))
    return res


def compare_sampled_or_stats(ctx: Context, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
    """Sampled values when both sides kept them (a cache tensor: full on one side is not enough), else statistics."""
    if r.sampled(name) is not None and c.sampled(name) is not None:
        return compare_sampled(ctx, r, c, name, tol)
    return compare_stats(ctx, r, c, name, tol)
