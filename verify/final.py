"""The final stage: the raw logits and the final norm at each sample's last token, then the top-ranked ids.

Top ids are judged on the reference's logits: the candidate's id at rank k must score, in the
reference, at least the reference's rank-k score minus the logits' tolerance, so ties and near-ties
within tolerance are no failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..dumps.schema import FINAL_TENSORS
from . import wording
from .breaks import Break, Checks, finite_break, numerics_break, shape_break, tensor_break, value_break
from .context import Context
from .results import Accumulator, TensorResult


class Top(NamedTuple):
    """One matched sample's top-ranked ids on each side."""
    sample: int  # the reference's sample index
    reference: list
    candidate: list


class SampleError(NamedTuple):
    sample: int
    max_abs: float  # the sample's logits' largest absolute error


class Gathered(NamedTuple):
    """The token each side's final logits were gathered at, and the sample's last valid token."""
    sample: int
    reference: int
    candidate: int
    last_valid: int


class FinalCheck(NamedTuple):
    """One check of the final stage (a tensor, or "top ids") and its own first break."""
    name: str
    first_break: Break | None


class TopIds(NamedTuple):
    ok: bool
    detail: str | None
    top: tuple  # of Top
    gathered: tuple  # of Gathered
    first_break: Break | None


@dataclass(frozen=True, kw_only=True)
class FinalResult:
    tensors: tuple
    top_ids_ok: bool
    top_detail: str | None
    first_break: Break | None
    top: tuple = ()  # Top per matched sample
    sample_max_abs: tuple = ()  # SampleError per matched sample
    gather: tuple = ()  # Gathered per matched sample
    breaks: tuple = ()  # FinalCheck per final tensor, then "top ids"
    numerics: "FinalResult | None" = None  # calibrated: the twin against the reference (check 2)

    def __bool__(self) -> bool:
        return self.first_break is None

    def tensor(self, name: str) -> TensorResult | None:
        return next((t for t in self.tensors if t.tensor == name), None)


def compare_final(ctx: Context, numerics: FinalResult | None = None) -> FinalResult:
    """The final stage of two traces; numerics: the twin's own final stage against the reference (check 2)."""
    rf, cf = ctx.ref.final, ctx.cand.final
    tensors = tuple(_final_tensor(ctx, name) for name in FINAL_TENSORS)
    response = _response_tensor(ctx)
    if response is not None:
        tensors += (response,)
    per_sample = tuple(SampleError(rs, float(np.abs(cf["logits"][cs].astype(np.float64) - rf["logits"][rs]).max()))
                       for rs, cs in ctx.pairs)
    top = _top_ids(ctx)
    checks = Checks()
    for t in tensors:
        checks.add("shape", shape_break("final", None, t))
    for t in tensors:
        twin = None if numerics is None else numerics.tensor(t.tensor)
        checks.add("finite_mask", _finite_or_numerics(ctx, t, twin))
    if numerics is not None:
        checks.add("numerics", numerics_break(numerics.first_break, ctx.noise_of, ctx.policy.name))
    for t in tensors:
        checks.add("value", value_break("final", None, t, noise_of=ctx.noise_of))
    checks.add("top_ids", top.first_break)
    breaks = tuple(FinalCheck(t.tensor, tensor_break("final", None, t, ctx.noise_of)) for t in tensors)
    return FinalResult(tensors=tensors, top_ids_ok=top.ok, top_detail=top.detail, first_break=checks.first(),
                       top=top.top, sample_max_abs=per_sample, gather=top.gathered,
                       breaks=breaks + (FinalCheck("top ids", top.first_break),), numerics=numerics)


def _finite_or_numerics(ctx: Context, t: TensorResult, twin: TensorResult | None) -> Break | None:
    """t's finite-mask break; when the twin is non-finite there too, the precision's (check 2)."""
    if t.finite_ok:
        return None
    if twin is not None and not twin.finite_ok:
        return numerics_break(finite_break("final", None, twin), ctx.noise_of, ctx.policy.name)
    return finite_break("final", None, t)


def _final_tensor(ctx: Context, name: str) -> TensorResult:
    rf, cf = ctx.ref.final, ctx.cand.final
    tol = ctx.value_tol(name)
    if rf[name].shape[1] != cf[name].shape[1]:
        return TensorResult(tensor=name, level="full", tol=tol,
                            shape_detail=wording.width_differs(name, rf[name].shape[1], cf[name].shape[1]))
    calib = ctx.calib
    gf = None if calib is None else calib.golden.final
    tf = None if calib is None else (rf if calib.twin is None else calib.twin.final)
    acc = Accumulator(tol, ctx.equal_nan)
    cal = ctx.calib_acc()
    for rs, cs in ctx.pairs:
        last = np.array([int(ctx.ref.lengths[rs]) - 1])
        acc.add(rf[name][rs:rs + 1], cf[name][cs:cs + 1], rs, last)
        if cal is not None:
            cal.add(cf[name][cs:cs + 1], tf[name][rs:rs + 1], gf[name][rs:rs + 1], rs, last)
    return acc.result(name, "full", calib=None if cal is None else cal.result())


def _response_tensor(ctx: Context) -> TensorResult | None:
    """The logits at each response token both traces hold (None when neither has a response), as the final
    logits are compared: row by row, at the token index the logits were taken at. A response one side has and the
    other lacks is a shape break."""
    name, rr, cr = "response_logits", ctx.ref.response, ctx.cand.response
    if rr is None and cr is None:
        return None
    tol = ctx.value_tol(name)
    if rr is None or cr is None:
        which = "reference" if rr is None else "candidate"
        return TensorResult(tensor=name, level="full", tol=tol,
                            shape_detail=f"the {which} trace holds no response logits, the other does")
    calib = ctx.calib
    gr = None if calib is None else calib.golden.response
    tr = None if calib is None else (rr if calib.twin is None else calib.twin.response)
    acc, cal = Accumulator(tol, ctx.equal_nan), ctx.calib_acc()
    for rs, cs in ctx.pairs:
        rt, ct = rr["token_index"][rs], cr["token_index"][cs]
        both = np.intersect1d(rt[rt >= 0], ct[ct >= 0])
        if both.size == 0:
            continue
        ri, ci = np.searchsorted(rt[rt >= 0], both), np.searchsorted(ct[ct >= 0], both)
        acc.add(rr["logits"][rs][rt >= 0][ri], cr["logits"][cs][ct >= 0][ci], rs, both)
        if cal is not None and gr is not None and tr is not None:
            gi = np.searchsorted(gr["token_index"][rs][gr["token_index"][rs] >= 0], both)
            ti = np.searchsorted(tr["token_index"][rs][tr["token_index"][rs] >= 0], both)
            cal.add(cr["logits"][cs][ct >= 0][ci], tr["logits"][rs][tr["token_index"][rs] >= 0][ti],
                    gr["logits"][rs][gr["token_index"][rs] >= 0][gi], rs, both)
    return acc.result(name, "full", calib=None if cal is None else cal.result())


def _top_ids(ctx: Context) -> TopIds:
    rf, cf = ctx.ref.final, ctx.cand.final
    tol = ctx.policy.tol("logits")
    k = min(ctx.policy.topk, rf["topk_ids"].shape[1], cf["topk_ids"].shape[1])
    detail, tops, gathers, bad = None, [], [], []
    for rs, cs in ctx.pairs:
        rz, cids = rf["logits"][rs].astype(np.float64), cf["topk_ids"][cs, :k]
        rms = float(np.sqrt(np.mean(rz * rz)))
        order = rf["topk_ids"][rs, :k]
        tops.append(Top(rs, order.tolist(), cids.tolist()))
        gathers.append(Gathered(rs, int(rf["gather_token"][rs]), int(cf["gather_token"][cs]),
                                int(ctx.ref.lengths[rs]) - 1))
        for rank in range(k):
            want, got = rz[order[rank]], rz[cids[rank]]
            if not got >= want - (tol.atol + tol.rtol * abs(want) + tol.ntol * rms):
                if not bad:
                    detail = wording.top_ids_differ(rs, rank, int(cids[rank]), int(order[rank]), got, want)
                bad.append(rs)
                break
    fb = None if not bad else Break(stage="final", kind="top_ids", message=detail, tensor="topk_ids",
                                    sample=bad[0], samples=tuple(bad))
    return TopIds(not bad, detail, tuple(tops), tuple(gathers), fb)
