"""A mixture of experts' routing, compared token by token: each side's chosen experts, and whether a token whose
experts differ (a flip) is explained by noise or blamed on the candidate (docs/tolerances.md, "Routing flips").

A token's experts are compared as sets (the order within the top k only changes weights, which the values
check). At a flip the reference's margin m (its k-th minus its (k+1)-th router logit) is set against the noise
of a router logit: the candidate's errors on the two logits must differ by more than m to reorder them, and each
is at most the noise, so a flip is *explained* when m <= 2·K·noise. Where the verdict is calibrated the noise is
measured: the reference's and the twin's largest router-logit errors against the float64 golden at that layer,
added (K: the calibration factor); else it is the dtype envelope atol + (rtol + ntol)·rms(logits) of the
``router`` tolerance kind (K = 1, the envelope being a bound already). Outside it the flip is a ``routing``
break.

After an explained flip the candidate's values at that token, and at every later token of its sample in later
layers (attention carries them), are no longer comparable with the reference's. The comparison stops comparing
that sample from the flip's layer on and says so; a caller that controls the candidate's router reruns it with
the reference's experts forced at the flipped tokens (``forced_routing``) and judges that run instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dumps.reader import LayerView
from . import wording
from .breaks import Break
from .context import Context

BOTH_ERRORS = 2.0  # a flip needs the two logits' errors to differ by more than the margin: 2·noise at most


@dataclass(frozen=True)
class Flip:
    """A token whose experts differ between the two sides."""
    layer: int
    sample: int  # the reference's sample
    position: int  # token index
    reference: tuple  # the reference's experts, by descending probability
    candidate: tuple
    margin: float  # the reference's k-th minus (k+1)-th router logit there
    bound: float  # the largest margin noise explains there
    cand_sample: int

    @property
    def explained(self) -> bool:
        return bool(self.margin <= self.bound)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "sample": self.sample, "position": self.position,
                "reference": list(self.reference), "candidate": list(self.candidate), "margin": float(self.margin),
                "bound": float(self.bound), "explained": self.explained}


@dataclass(frozen=True)
class NearTie:
    """A token where the reference's own margin is within noise: a replay forces its experts there in advance."""
    layer: int
    sample: int
    cand_sample: int
    position: int
    reference: tuple


@dataclass(frozen=True)
class RoutingResult:
    layer: int
    compared: int  # tokens whose experts were compared
    flips: tuple = ()
    noise: str = ""  # where the bound came from, in words
    not_compared: str | None = None  # why nothing was compared (routing missing on a side)
    near_ties: tuple = ()  # every aligned token (compared samples or not) whose reference margin noise explains
    hidden_ties: tuple = ()  # near ties at tokens the candidate's trace has no cell for (a reused prefix's own pass)

    @property
    def explained(self) -> tuple:
        return tuple(f for f in self.flips if f.explained)

    @property
    def blamed(self) -> tuple:
        return tuple(f for f in self.flips if not f.explained)

    def as_dict(self) -> dict:
        return {"compared": self.compared, "flips": [f.as_dict() for f in self.flips], "noise": self.noise,
                "not_compared": self.not_compared}


def compare_routing(ctx: Context, r: LayerView, c: LayerView) -> RoutingResult | None:
    """The layer's routing compared over every aligned token (None: a dense layer on both sides)."""
    rid, cid = r.routing("ids"), c.routing("ids")
    if rid is None and cid is None:
        return None
    if rid is None or cid is None:
        side = "reference" if rid is None else "candidate"
        why = f"the {side} trace records no routing at layer {r.layer}"
        ctx.skipped.add(wording.routing_not_compared(r.layer, why))
        return RoutingResult(layer=r.layer, compared=0, not_compared=why)
    ref_ids, cand_ids = ctx.ref.read(rid), ctx.cand.read(cid)
    if ref_ids.shape[2] != cand_ids.shape[2]:  # a different top-k: every token flips; the margin is moot
        return RoutingResult(layer=r.layer, compared=0, flips=(_topk_flip(ctx, r.layer, ref_ids, cand_ids),),
                             noise="a different number of experts per token")
    margin, scale = ctx.ref.read(r.routing("margin")), ctx.ref.read(r.routing("scale"))
    bound_of, noise = _bounds(ctx, r.layer, scale)
    flips, compared = [], 0
    for rs, cs in ctx.pairs:
        cells = ctx.align.cells[rs]
        a = np.sort(ref_ids[rs, cells.ref_cols], axis=1)
        b = np.sort(cand_ids[cs, cells.cand_cols], axis=1)
        compared += len(a)
        for i in np.flatnonzero((a != b).any(axis=1)):
            rc = np.arange(ref_ids.shape[1])[cells.ref_cols][i]
            cc = np.arange(cand_ids.shape[1])[cells.cand_cols][i]
            flips.append(Flip(layer=r.layer, sample=int(rs), position=int(cells.tokens[i]),
                              reference=tuple(int(x) for x in ref_ids[rs, rc]),
                              candidate=tuple(int(x) for x in cand_ids[cs, cc]), margin=float(margin[rs, rc]),
                              bound=float(bound_of(rs, rc)), cand_sample=int(cs)))
    ties, hidden = [], []
    for rs, cs in list(ctx.pairs) + ctx.align.dropped:
        cells = ctx.align.cells[rs]
        rcols = np.arange(ref_ids.shape[1])[cells.ref_cols]
        near = np.flatnonzero(margin[rs, rcols] <= bound_of(rs, rcols))
        ties += [NearTie(layer=r.layer, sample=int(rs), cand_sample=int(cs), position=int(cells.tokens[i]),
                         reference=tuple(int(x) for x in ref_ids[rs, rcols[i]])) for i in near]
        # tokens the candidate computed outside its trace (a reused prefix's own prefill) or not at all: a flip
        # there is unseen, and shows only through the cache it wrote
        cols, toks = ctx.ref.cells(rs)
        unseen = np.flatnonzero(~np.isin(toks, cells.tokens) & (margin[rs, cols] <= bound_of(rs, cols)))
        hidden += [NearTie(layer=r.layer, sample=int(rs), cand_sample=int(cs), position=int(toks[i]),
                           reference=tuple(int(x) for x in ref_ids[rs, cols[i]])) for i in unseen]
    return RoutingResult(layer=r.layer, compared=compared, flips=tuple(flips), noise=noise, near_ties=tuple(ties),
                         hidden_ties=tuple(hidden))


def _bounds(ctx: Context, layer: int, scale: np.ndarray):
    """(sample, column) -> the largest margin noise explains there, and where the noise came from, in words."""
    calib = ctx.calib
    if calib is not None:
        g = calib.golden.layer(layer).routing("logits")
        twin = calib.twin if calib.twin is not None else ctx.ref  # the reference is its own twin
        sides = [(t, t.layer(layer).routing("logits")) for t in (ctx.ref, twin)]
        if g is not None and all(ds is not None for _, ds in sides):
            noise = _measured_noise(ctx, g, sides)
            bound = {k: BOTH_ERRORS * calib.factor * v for k, v in noise.items()}
            return (lambda s, c: bound[s][c]), (f"the reference's and the twin's router-logit errors against the "
                                                f"float64 golden there, times {calib.factor:g}")
    tol = ctx.policy.tol("router_logits", layer)
    return (lambda s, c: BOTH_ERRORS * (tol.atol + (tol.rtol + tol.ntol) * scale[s, c])), (
        f"the {ctx.policy.name} envelope on a router logit (atol {tol.atol:g}, rtol {tol.rtol:g}, "
        f"ntol {tol.ntol:g})")


def _measured_noise(ctx: Context, golden_ds, sides) -> dict:
    """{reference sample: (C,) noise}: at each cell, the reference's plus the twin's largest router-logit error
    against the golden, each at least its median over the layer's cells (as check 1 floors a row's noise), so one
    cell that happens to be exact does not make a flip there look impossible. Golden and twin share the
    reference's layout: one sample and its columns index all three."""
    per_side = []
    for t, ds in sides:
        errs = {}
        for rs in _all_samples(ctx):
            cols = ctx.align.cells[rs].ref_cols
            e = np.full(ctx.ref.n_cols, np.nan)
            e[cols] = np.abs(t.read(ds, (rs,))[cols].astype(np.float64)
                             - ctx.calib.golden.read(golden_ds, (rs,))[cols].astype(np.float64)).max(axis=-1)
            errs[rs] = e
        finite = np.concatenate([e[np.isfinite(e)] for e in errs.values()]) if errs else np.zeros(0)
        median = float(np.median(finite)) if finite.size else 0.0
        per_side.append({rs: np.fmax(e, median) for rs, e in errs.items()})
    return {rs: per_side[0][rs] + per_side[1][rs] for rs in per_side[0]}


def _all_samples(ctx: Context) -> list:
    """Every matched reference sample, the ones an explained flip took out of the comparison included."""
    return sorted({rs for rs, _ in list(ctx.pairs) + ctx.align.dropped})


def _topk_flip(ctx: Context, layer: int, ref_ids: np.ndarray, cand_ids: np.ndarray) -> Flip:
    """The two sides take different numbers of experts per token: a flip at every token, shown at the first."""
    pairs = list(ctx.pairs) or list(ctx.align.dropped)
    if not pairs or not np.size(np.arange(ref_ids.shape[1])[ctx.align.cells[pairs[0][0]].ref_cols]):
        return Flip(layer=layer, sample=0, position=0, reference=(), candidate=(), margin=float("inf"), bound=0.0,
                    cand_sample=0)
    rs, cs = pairs[0]
    cells = ctx.align.cells[rs]
    rc = np.arange(ref_ids.shape[1])[cells.ref_cols][0]
    cc = np.arange(cand_ids.shape[1])[cells.cand_cols][0]
    return Flip(layer=layer, sample=int(rs), position=int(cells.tokens[0]),
                reference=tuple(int(x) for x in ref_ids[rs, rc]), candidate=tuple(int(x) for x in cand_ids[cs, cc]),
                margin=float("inf"), bound=0.0, cand_sample=int(cs))


def routing_break(res: RoutingResult | None) -> Break | None:
    """The layer's first flip that noise does not explain."""
    if res is None or not res.blamed:
        return None
    f = res.blamed[0]
    return Break(stage="layer", kind="routing", message=wording.routing_flip(f, res.noise, len(res.blamed)),
                 layer=f.layer, tensor="routing", sample=f.sample, position=f.position,
                 samples=tuple(sorted({x.sample for x in res.blamed})), max_abs_error=f.margin, bound=f.bound)


def stop_comparing(ctx: Context, res: RoutingResult | None) -> list:
    """After explained flips: the samples they reach are not compared from this layer on (their values no longer
    correspond); returns the flips that caused it. A calibrated or fixed-rule comparison alike."""
    if res is None or not res.explained:
        return []
    gone = {}
    for f in res.explained:
        gone.setdefault(f.sample, f)
    ctx.align.dropped.extend(p for p in ctx.align.pairs if p[0] in gone)
    ctx.align.pairs[:] = [p for p in ctx.align.pairs if p[0] not in gone]
    for s, f in sorted(gone.items()):
        ctx.skipped.add(wording.routing_not_replayed(f))
    return list(res.explained)


def forced_routing(cells, into: dict | None = None, side: str = "candidate") -> dict:
    """{layer: {(sample, token index): the reference's experts}} for a replay, in the candidate's samples (the
    candidate's run) or the reference's (its golden and twin, which share its layout); ``cells``: flips or near
    ties."""
    out = {} if into is None else into
    for f in cells:
        s = f.cand_sample if side == "candidate" else f.sample
        out.setdefault(f.layer, {})[(s, f.position)] = tuple(f.reference)
    return out


def replay_cells(report) -> list:
    """What a replay forces: every near tie of the reference the report's layers found (a flip can only happen
    there, so one rerun settles every later layer too), those the candidate computed outside its trace included,
    and every explained flip."""
    return [t for lr in report.layers if lr.routing is not None for t in lr.routing.near_ties + lr.routing.hidden_ties] \
        + list(report.unreplayed)


def wants_replay(report, forced: dict) -> bool:
    """Whether a routing replay can change the verdict: an explained flip took samples out of the comparison, or
    the report fails where the reference has near ties at tokens the candidate computed outside its trace (a
    reused prefix's own prefill: a flip there is unseen, and shows only as a different cache) that are not
    forced yet."""
    if report.unreplayed:
        return True
    if report.verdict != "fail":
        return False
    hidden = [t for lr in report.layers if lr.routing is not None for t in lr.routing.hidden_ties]
    return any(forced.get(t.layer, {}).get((t.cand_sample, t.position)) != tuple(t.reference) for t in hidden)
