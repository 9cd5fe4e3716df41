"""A layer's KV cache: its logical lengths and positions exactly, then its keys and values within tolerance.

Lengths first (a skipped or duplicated write), then, when every length agrees, the position each slot
holds (contract §2.2's cache invariants). Values are compared per (KV head, slot) row, the d_h-vector
attention reads. A side that stores keys before RoPE (``layout.key_rotation = "pre"``) has them rotated
here when the other side stores them rotated, so both are compared as attention sees them.
"""
from __future__ import annotations

import numpy as np

from ..dumps.reader import LayerView, Trace
from . import wording
from .context import Context
from .metrics import slab
from .results import Accumulator, CacheResult, TensorResult
from .sampled import compare_sampled_or_stats


def check_cache(ctx: Context, r: LayerView, c: LayerView) -> tuple[CacheResult, dict]:
    """(lengths and positions, {"cache_keys": TensorResult, "cache_values": TensorResult})."""
    tensors = {}
    for name in ("keys", "values"):
        tname = f"cache_{name}"
        tol = ctx.value_tol(tname, r.layer)
        rd, cd = r.cache(name), c.cache(name)
        if rd is None or cd is None:
            tensors[tname] = compare_sampled_or_stats(ctx, r, c, tname, tol)
        elif rd.shape[1] != cd.shape[1] or rd.shape[3] != cd.shape[3]:
            tensors[tname] = TensorResult(tensor=tname, level="full", tol=tol,
                                          shape_detail=wording.cache_shape_differs(name, rd.shape, cd.shape))
        else:
            tensors[tname] = _full_values(ctx, r, c, name)
    return _lengths_and_positions(ctx, r, c), tensors


def _lengths_and_positions(ctx: Context, r: LayerView, c: LayerView) -> CacheResult:
    rl, cl = r.cache_lengths, c.cache_lengths
    rp, cp = r.cache_positions, c.cache_positions
    bad_len = [rs for rs, cs in ctx.pairs if rl[rs] != cl[cs]]
    if bad_len:
        rs, cs = next(p for p in ctx.pairs if p[0] == bad_len[0])
        T = int(min(rl[rs], cl[cs]))
        first = next((t for t in range(T) if rp[rs, t] != cp[cs, t]), T)
        return CacheResult(lengths_ok=False, sample=rs, position=first, samples=tuple(bad_len),
                           detail=wording.cache_length_differs(rs, int(cl[cs]), int(rl[rs]), first))
    bad_pos, found = [], None
    for rs, cs in ctx.pairs:
        T = int(rl[rs])
        diff = np.flatnonzero(rp[rs, :T] != cp[cs, :T])
        if diff.size:
            bad_pos.append(rs)
            if found is None:
                t = int(diff[0])
                found = CacheResult(positions_ok=False, sample=rs, position=t, detail=wording.cache_positions_differ(
                    rs, t, int(cp[cs, t]), int(rp[rs, t]), diff.size, T))
    if found is None:
        return CacheResult()
    return CacheResult(positions_ok=False, sample=found.sample, position=found.position, detail=found.detail,
                       samples=tuple(bad_pos))


def _full_values(ctx: Context, r: LayerView, c: LayerView, name: str) -> TensorResult:
    """Keys or values of one layer, both sides at the full level, one row per (KV head, slot)."""
    tname = f"cache_{name}"
    tol = ctx.value_tol(tname, r.layer)
    rd, cd = r.cache(name), c.cache(name)
    rl, cl = r.cache_lengths, c.cache_lengths
    rp, cp = r.cache_positions, c.cache_positions
    acc = Accumulator(tol, ctx.equal_nan)
    cal = ctx.calib_acc()
    gd, td = ctx.calib_datasets(r.layer, tname)
    kv_bad = set()  # KV heads with values out of tolerance
    for rs, cs, rrow, crow, grow, trow in ctx.rows(rd, cd, gd, td):
        T = int(min(rl[rs], cl[cs]))
        a, b = rrow[:, :T], crow[:, :T]
        if name == "keys":
            a, b = post_rotation(a, rp[rs, :T], ctx.ref, ctx.cand), post_rotation(b, cp[cs, :T], ctx.cand, ctx.ref)
        H = a.shape[0]
        toks = np.tile(np.arange(T), H)
        if cal is not None:
            g, t = _calibration_rows(ctx, grow[:, :T], None if trow is None else trow[:, :T], a, rp[rs, :T],
                                     keys=name == "keys")
            cal.add(_rows(b), _rows(t), _rows(g), rs, toks, groups=np.repeat(np.arange(H), T))
        part = slab(_rows(a), _rows(b), tol, ctx.equal_nan, rs, toks)
        if part.n_bad:  # rows are (KV head, slot), head-major: which heads hold the bad values
            kv_bad.update(h for h in range(H) if slab(a[h], b[h], tol, ctx.equal_nan, rs, np.arange(T)).n_bad)
        acc.p.merge(part)
    return acc.result(tname, "full", kv_heads=tuple(sorted(kv_bad)), calib=None if cal is None else cal.result())


def _rows(x: np.ndarray) -> np.ndarray:
    """(H, T, d_h) -> (H·T, d_h): one row per (KV head, slot), head-major."""
    return np.ascontiguousarray(x).reshape(x.shape[0] * x.shape[1], x.shape[-1])


def _calibration_rows(ctx: Context, g, t, ref_rows, positions, keys: bool):
    """The golden's and the twin's cache rows of one reference sample (twin None: the reference's own rows),
    keys rotated as the comparison sees them."""
    if keys:  # golden and twin keep the reference's layout
        g = post_rotation(g, positions, ctx.ref, ctx.cand)
        if t is not None:
            t = post_rotation(t, positions, ctx.ref, ctx.cand)
    return g, ref_rows if t is None else t


def post_rotation(keys: np.ndarray, positions: np.ndarray, trace: Trace, other: Trace) -> np.ndarray:
    """Keys of ``trace`` as ``other`` stores them: rotated here if trace stores them before RoPE and other not."""
    mine = trace.meta.get("layout", {}).get("key_rotation", "post")
    theirs = other.meta.get("layout", {}).get("key_rotation", "post")
    if mine == "pre" and theirs != "pre":
        return rotate_keys(keys, positions, np.asarray(trace.model.get("rope_inv_freq"), dtype=np.float64))
    return keys


def rotate_keys(keys: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """RoPE (rotate-half convention) on keys (H, T, d) stored before rotation."""
    freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    k = keys.astype(np.float64)
    half = k.shape[-1] // 2
    rot = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
    return (k * cos + rot * sin).astype(np.result_type(keys.dtype, np.float32))
