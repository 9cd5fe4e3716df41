"""Checks only a multi-rank (tensor-parallel) trace needs, run per layer by the Comparator.

The functions take the comparison's ``verify.context.Context`` (ref, cand, pairs, policy, notes).

1. The rank shards of every sharded tensor tile it (no gap, no overlap): otherwise a ``shape`` break.
2. The replicated tensors agree across ranks: rank r's residual-stream states against rank 0's,
   over every valid cell, with the tolerance the comparison uses for that tensor (full level), or
   their checksums exactly (stats level; gloo's all-reduce hands every rank the same bits). A
   disagreement is a ``rank_divergence`` break naming the ranks: the logical trace takes replicated
   tensors from rank 0 only, so without this check a rank that drifted would go unseen.
3. A break with query heads on a rank set gets a note naming the ranks that hold those heads.

Order within a layer (verify/breaks.py's ORDER): a tiling problem first (as a shape break), then rank
divergence, then the Comparator's own checks (finite masks, cache, values).
"""
from __future__ import annotations

import numpy as np

from ..dumps.schema import REQUIRED_STATES
from . import wording
from .breaks import Break
from .metrics import slab


def _rank_sides(ctx):
    for trace, side in ((ctx.ref, "reference"), (ctx.cand, "candidate")):
        if getattr(trace, "ranks", None):
            yield trace, side


def _ref_sample(ctx, side: str, s: int) -> int:
    """The reference's index of a sample of ``side`` (breaks name reference samples)."""
    if side == "reference":
        return s
    return next((rs for rs, cs in ctx.pairs if cs == s), s)


def tiling_break(ctx, layer: int) -> Break | None:
    for trace, side in _rank_sides(ctx):
        for (i, tensor), why in sorted(trace.shard_problems.items()):
            if i == layer:
                return Break(stage="layer", kind="shape", message=f"{side} {why}", layer=layer, tensor=tensor)
    return None


def _nonfinite_disagreement(x, y):
    """Cells where two replicas disagree beyond numbers: finite on one rank only, or non-finite on both but not
    the same (inf and -inf, inf and NaN); the same NaN or infinity on both is agreement."""
    fx, fy = np.isfinite(x), np.isfinite(y)
    with np.errstate(invalid="ignore"):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
    return (fx != fy) | (~fx & ~fy & ~same)


def divergence_break(ctx, layer: int) -> Break | None:
    for trace, side in _rank_sides(ctx):
        ranks = trace.ranks
        samples = [rs if side == "reference" else cs for rs, cs in ctx.pairs]
        for name in REQUIRED_STATES:
            tol = ctx.policy.tol(name, layer)
            base = ranks[0].layer(layer)
            for r in range(1, len(ranks)):
                other = ranks[r].layer(layer)
                a, b = base.state(name), other.state(name)
                if a is not None and b is not None:
                    worst = None
                    n_bad, bad = 0, []
                    for s in samples:
                        cols, toks = trace.cells(s)
                        x, y = ranks[0].read(a, (s,))[cols], ranks[r].read(b, (s,))[cols]
                        part = slab(x, y, tol, ctx.policy.equal_nan, s, toks)
                        odd = _nonfinite_disagreement(x, y)  # finite on one rank only, or two that differ
                        if part.n_bad or odd.any():
                            n_bad += part.n_bad + int(odd.sum())
                            bad.append(s)
                            if worst is None or part.max_abs > worst[0]:
                                pos = part.worst[2] if part.worst is not None else \
                                    int(toks[int(np.argmax(odd.any(axis=1)))])
                                worst = (part.max_abs, s, pos)
                    if n_bad:
                        mx, s, pos = worst
                        rs = _ref_sample(ctx, side, s)
                        return Break(stage="layer", kind="rank_divergence", message=(
                            f"ranks 0 and {r} of the {side} disagree on replicated {name}: "
                            f"{wording.count(n_bad, 'value')} {wording.agree(n_bad, 'differs', 'differ')} beyond "
                            f"tolerance, max_abs={mx:.3g} (sample {rs}, position {pos})"),
                            layer=layer, tensor=name, sample=rs, position=pos, max_abs_error=mx,
                            samples=tuple(sorted(_ref_sample(ctx, side, x) for x in bad)))
                    continue
                ca, cb = base.checksum(name), other.checksum(name)
                if ca is not None and cb is not None:
                    diff = [s for s in samples if ca[s] != cb[s]]
                    if diff:
                        rs = _ref_sample(ctx, side, diff[0])
                        return Break(stage="layer", kind="rank_divergence", message=(
                            f"ranks 0 and {r} of the {side} disagree on replicated {name}: checksums differ for "
                            f"{wording.some('sample', [_ref_sample(ctx, side, x) for x in diff])} (stats level)"),
                            layer=layer, tensor=name, sample=rs,
                            samples=tuple(_ref_sample(ctx, side, x) for x in diff))
    return None


def heads_note(trace, heads) -> str | None:
    """'query heads 2,3 are rank 1's (it holds query heads 2..3 and KV head 1)', 'query head 2 is ...', for a rank
    set."""
    ranks = (trace.meta.get("parallel") or {}).get("ranks") or []
    owners = {}
    for r in ranks:
        q0, q1 = r.get("query_heads") or (0, 0)
        for h in heads:
            if q0 <= h < q1:
                owners.setdefault(r.get("rank"), []).append(h)
    if not owners:
        return None
    parts = []
    for rank, hs in sorted(owners.items()):
        info = next(r for r in ranks if r.get("rank") == rank)
        q0, q1 = info["query_heads"]
        kv = info.get("kv_heads")
        if kv is None:  # a rank set from another writer need not say which KV heads a rank holds
            held = f"query head {q0}" if q1 - q0 == 1 else f"query heads {q0}..{q1 - 1}"
        else:
            k0, k1 = kv
            kv_held = f"KV head {k0}" if k1 - k0 == 1 else f"KV heads {k0}..{k1 - 1}"
            held = (f"query head {q0}" if q1 - q0 == 1 else f"query heads {q0}..{q1 - 1}") + f" and {kv_held}"
        which = f"query head {hs[0]} is" if len(hs) == 1 else f"query heads {','.join(map(str, hs))} are"
        parts.append(f"{which} rank {rank}'s (it holds {held})")
    return "; ".join(parts)


def heads_notes(ctx, layer: int, first: Break) -> None:
    """Notes naming the ranks that hold the query heads of a layer's first break (rank sets only)."""
    for trace, side in _rank_sides(ctx):
        note = heads_note(trace, first.heads)
        if note:
            text = f"layer {layer}: {side} {note}"
            if text not in ctx.notes:
                ctx.notes.append(text)
