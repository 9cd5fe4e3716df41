"""A layer's KV cache: its logical lengths and positions exactly, then its keys and values within tolerance.

Lengths first (a skipped or duplicated write), then, when every length agrees, the position each slot
holds (contract §2.2's cache invariants). Values are compared per (KV head, slot) row, the d_h-vector
attention reads. A side that stores keys before RoPE (``layout.key_rotation = "pre"``) has them rotated
here when the other side stores them rotated, so both are compared as attention sees them.

A sliding-window layer (window W) is compared on what the next token can read: each sample's last W - 1
slots (fewer when it holds fewer). One engine may keep the whole prompt there (ours), another only those
slots (transformers); both hold the same next-token state.
"""
from __future__ import annotations

import numpy as np

from ..dumps.reader import LayerView, Trace
from ..dumps.schema import CACHE_PREFIX, CACHE_TENSORS
from . import wording
from .context import Context
from .metrics import slab
from .results import Accumulator, CacheResult, TensorResult
from .sampled import compare_sampled_or_stats


def layer_window(trace: Trace, layer: int) -> int | None:
    """The sliding window W of ``layer`` by the trace's model arguments, or None (a full-attention layer)."""
    args = trace.args
    window, kinds = args.get("sliding_window"), args.get("layer_types") or []
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    if kinds and (layer >= len(kinds) or kinds[layer] != "sliding"):
        return None
    return window


class Slots:
    """The slots of one side's cache that are compared: per sample, the first one and how many."""

    def __init__(self, view: LayerView, window: int | None):
        self.lengths = np.asarray(view.cache_lengths)
        self.window = window
        self.n = self.lengths if window is None else np.minimum(self.lengths, window - 1)
        self.start = self.lengths - self.n

    def of(self, positions: np.ndarray, s: int, T: int) -> np.ndarray:
        """Sample ``s``'s first T compared slots of the (samples, slots) ``positions``."""
        return positions[s, self.start[s]:self.start[s] + T]

    def row(self, row: np.ndarray, s: int, T: int) -> np.ndarray:
        """The first T compared slots of sample ``s``'s cache row (KV heads, slots, d_h)."""
        return row[:, self.start[s]:self.start[s] + T]

    def holds_more(self, s: int) -> bool:
        """Sample ``s`` keeps more slots than the window compares (an engine that keeps the whole prompt)."""
        return self.window is not None and bool(self.lengths[s] > self.n[s])

    def note(self) -> str:
        return "" if self.window is None else (f" (a sliding-window layer, W={self.window}: each sample's last "
                                               f"{wording.count(self.window - 1, 'slot')} compared)")


def check_cache(ctx: Context, r: LayerView, c: LayerView) -> tuple[CacheResult, dict]:
    """(lengths and positions, {"cache_keys": TensorResult, "cache_values": TensorResult})."""
    tensors = {}
    window = layer_window(ctx.ref, r.layer)
    rsl, csl = Slots(r, window), Slots(c, window)
    for name in CACHE_TENSORS:
        tname = CACHE_PREFIX + name
        tol = ctx.value_tol(tname, r.layer)
        rd, cd = r.cache(name), c.cache(name)
        if (rd is None or cd is None) and window is not None and any(
                rsl.lengths[rs] != csl.lengths[cs] for rs, cs in ctx.pairs):
            ctx.skipped.add(wording.WINDOW_CACHE_NOT_FULL)  # sampled slots and statistics cover different slots
            tensors[tname] = TensorResult(tensor=tname, level="none", tol=tol, note=wording.WINDOW_CACHE_NOT_FULL)
        elif rd is None or cd is None:
            tensors[tname] = compare_sampled_or_stats(ctx, r, c, tname, tol)
        elif rd.shape[1] != cd.shape[1] or rd.shape[3] != cd.shape[3]:
            tensors[tname] = TensorResult(tensor=tname, level="full", tol=tol,
                                          shape_detail=wording.cache_shape_differs(name, rd.shape, cd.shape))
        else:
            tensors[tname] = _full_values(ctx, r, c, name, rsl, csl)
    return _lengths_and_positions(ctx, r, c, rsl, csl), tensors


def _lengths_and_positions(ctx: Context, r: LayerView, c: LayerView, rsl: Slots, csl: Slots) -> CacheResult:
    rl, cl = rsl.n, csl.n
    rp, cp = r.cache_positions, c.cache_positions
    bad_len = [rs for rs, cs in ctx.pairs if rl[rs] != cl[cs]]
    kept = [rs for rs, cs in ctx.pairs if rsl.holds_more(rs) and csl.holds_more(cs)
            and rsl.lengths[rs] != csl.lengths[cs]]
    if kept and not bad_len:  # both sides keep more than the window (the whole prompt): their lengths must agree
        rs, cs = next(p for p in ctx.pairs if p[0] == kept[0])
        T = int(min(rsl.lengths[rs], csl.lengths[cs]))
        first = next((t for t in range(T) if rp[rs, t] != cp[cs, t]), T)
        return CacheResult(lengths_ok=False, sample=rs, position=first, samples=tuple(kept),
                           detail=wording.cache_length_differs(rs, int(csl.lengths[cs]), int(rsl.lengths[rs]), first)
                           + f" (a sliding-window layer, W={rsl.window}: both sides keep more than its last "
                             f"{wording.count(rsl.window - 1, 'slot')}, so they keep the whole prompt)")
    if bad_len:
        rs, cs = next(p for p in ctx.pairs if p[0] == bad_len[0])
        T = int(min(rl[rs], cl[cs]))
        a, b = rsl.of(rp, rs, T), csl.of(cp, cs, T)
        first = next((t for t in range(T) if a[t] != b[t]), T)
        return CacheResult(lengths_ok=False, sample=rs, position=int(rsl.start[rs]) + first, samples=tuple(bad_len),
                           detail=wording.cache_length_differs(rs, int(cl[cs]), int(rl[rs]),
                                                               int(rsl.start[rs]) + first) + rsl.note())
    bad_pos, found = [], None
    for rs, cs in ctx.pairs:
        T = int(rl[rs])
        a, b = rsl.of(rp, rs, T), csl.of(cp, cs, T)
        diff = np.flatnonzero(a != b)
        if diff.size:
            bad_pos.append(rs)
            if found is None:
                t = int(diff[0])
                slot = int(rsl.start[rs]) + t
                found = CacheResult(positions_ok=False, sample=rs, position=slot,
                                    detail=wording.cache_positions_differ(rs, slot, int(b[t]), int(a[t]), diff.size,
                                                                          T) + rsl.note())
    if found is None:
        return CacheResult()
    return CacheResult(positions_ok=False, sample=found.sample, position=found.position, detail=found.detail,
                       samples=tuple(bad_pos))


def _full_values(ctx: Context, r: LayerView, c: LayerView, name: str, rsl: Slots, csl: Slots) -> TensorResult:
    """Keys or values of one layer, both sides at the full level, one row per (KV head, compared slot)."""
    tname = f"cache_{name}"
    tol = ctx.value_tol(tname, r.layer)
    rd, cd = r.cache(name), c.cache(name)
    rl, cl = rsl.n, csl.n
    rp, cp = r.cache_positions, c.cache_positions
    acc = Accumulator(tol, ctx.equal_nan)
    cal = ctx.calib_acc()
    gd, td = ctx.calib_datasets(r.layer, tname)
    kv_bad = set()  # KV heads with values out of tolerance
    for rs, cs, rrow, crow, grow, trow in ctx.rows(rd, cd, gd, td):
        T = int(min(rl[rs], cl[cs]))
        a, b = rsl.row(rrow, rs, T), csl.row(crow, cs, T)
        pa, pb = rsl.of(rp, rs, T), csl.of(cp, cs, T)
        if name == "keys":
            a, b = post_rotation(a, pa, ctx.ref, ctx.cand, r.layer), post_rotation(b, pb, ctx.cand, ctx.ref, r.layer)
        H = a.shape[0]
        toks = np.tile(np.arange(int(rsl.start[rs]), int(rsl.start[rs]) + T), H)
        if cal is not None:
            g, t = _calibration_rows(ctx, rsl.row(grow, rs, T), None if trow is None else rsl.row(trow, rs, T),
                                     a, pa, r.layer, keys=name == "keys")  # golden and twin: the reference's slots
            cal.add(_rows(b), _rows(t), _rows(g), rs, toks, groups=np.repeat(np.arange(H), T))
        part = slab(_rows(a), _rows(b), tol, ctx.equal_nan, rs, toks)
        if part.n_bad:  # rows are (KV head, slot), head-major: which heads hold the bad values
            kv_bad.update(h for h in range(H) if slab(a[h], b[h], tol, ctx.equal_nan, rs, np.arange(T)).n_bad)
        acc.p.merge(part)
    return acc.result(tname, "full", kv_heads=tuple(sorted(kv_bad)), calib=None if cal is None else cal.result())


def _rows(x: np.ndarray) -> np.ndarray:
    """(H, T, d_h) -> (H·T, d_h): one row per (KV head, slot), head-major."""
    return np.ascontiguousarray(x).reshape(x.shape[0] * x.shape[1], x.shape[-1])


def _calibration_rows(ctx: Context, g, t, ref_rows, positions, layer: int, keys: bool):
    """The golden's and the twin's cache rows of one reference sample (twin None: the reference's own rows),
    keys rotated as the comparison sees them."""
    if keys:  # golden and twin keep the reference's layout
        g = post_rotation(g, positions, ctx.ref, ctx.cand, layer)
        if t is not None:
            t = post_rotation(t, positions, ctx.ref, ctx.cand, layer)
    return g, ref_rows if t is None else t


def post_rotation(keys: np.ndarray, positions: np.ndarray, trace: Trace, other: Trace, layer: int) -> np.ndarray:
    """Keys of ``trace``'s layer ``layer`` as ``other`` stores them: rotated here if trace stores them before
    RoPE and other not (a sliding-window layer with its own RoPE base by rope_local_inv_freq; LongRoPE's long
    factors for a sample whose positions pass its original length, as an unbatched call chooses them)."""
    mine = trace.meta.get("layout", {}).get("key_rotation", "post")
    theirs = other.meta.get("layout", {}).get("key_rotation", "post")
    if mine == "pre" and theirs != "pre":
        local, long = trace.model.get("rope_local_inv_freq"), trace.model.get("rope_long")
        scale = 1.0
        if local is not None and layer_window(trace, layer) is not None:
            inv = local
        elif long is not None and positions.size and int(positions.max()) + 1 > long["switch"]:
            inv, scale = long["inv_freq"], long["attention_factor"]  # LongRoPE past its original length
        else:
            inv, scale = trace.model.get("rope_inv_freq"), 1.0 if long is None else long["attention_factor"]
        return rotate_keys(keys, positions, np.asarray(inv, dtype=np.float64), scale)
    return keys


def rotate_keys(keys: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """RoPE (rotate-half convention) on keys (H, T, d) stored before rotation; cos and sin times ``scale``."""
    freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * scale, np.sin(emb) * scale
    k = keys.astype(np.float64)
    half = k.shape[-1] // 2
    rot = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
    return (k * cos + rot * sin).astype(np.result_type(keys.dtype, np.float32))
