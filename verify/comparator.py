"""Per-layer comparison of two traces by logical (sample, position), and each layer's first break.

Per layer: every state at the best evidence level both traces hold (verify/full.py, sampled.py,
stats.py), then the cache (verify/cache_checks.py); the first break is picked in the one order of
verify/breaks.py. Every tensor is read once, one sample row at a time. A calibrated comparison also
compares the twin with the reference (check 2) through a second Comparator.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..dumps.reader import LayerView, Trace, TraceError
from ..dumps.schema import STATES, VALUE_ORDER
from .align import Alignment, same_layout
from .breaks import Break, Checks, cache_break, finite_break, numerics_break, shape_break, tensor_break, value_break
from .cache_checks import check_cache
from .calibrate import Calibration
from .context import Context
from .final import FinalResult, compare_final
from .full import compare_full_state
from .rank_checks import divergence_break, heads_notes, tiling_break
from .results import CacheResult, TensorResult, num
from .routing import RoutingResult, compare_routing, routing_break, stop_comparing
from .sampled import compare_sampled
from .stats import compare_stats
from .tolerance import Policy
from . import wording



@dataclass(frozen=True, kw_only=True)
class LayerResult:
    layer: int
    tensors: tuple
    cache: CacheResult
    first_break: Break | None
    numerics: "LayerResult | None" = None  # calibrated: the twin against the reference (check 2)
    routing: RoutingResult | None = None  # a MoE layer's routing compared

    def __bool__(self) -> bool:
        return self.first_break is None

    def tensor(self, name: str) -> TensorResult | None:
        return next((t for t in self.tensors if t.tensor == name), None)

    def as_dict(self) -> dict:
        d = {"layer": self.layer, "passed": bool(self),
             "first_break": None if self.first_break is None else self.first_break.as_dict(),
             "cache": {"lengths_ok": self.cache.lengths_ok, "positions_ok": self.cache.positions_ok,
                       "detail": self.cache.detail},
             "tensors": {t.tensor: t.as_dict() for t in self.tensors}}
        if self.routing is not None:
            d["routing"] = self.routing.as_dict()
        if self.numerics is not None:
            d["numerics"] = {"passed": bool(self.numerics), "tensors": {
                t.tensor: {"passed": bool(t), "max_abs": num(t.max_abs), "max_row_rel": num(t.max_row_rel),
                           "n_bad": t.n_bad} for t in self.numerics.tensors}}
        return d


class Comparator:
    """Compares a reference trace with a candidate, layer by layer, under a resolved policy."""

    def __init__(self, ref: Trace, cand: Trace, policy: Policy, calib: Calibration | None = None,
                 allow_subset: bool = False):
        if not isinstance(policy, Policy):
            raise TypeError(f"Comparator needs a resolved Policy (got {type(policy).__name__}): see "
                            "verify.policy_file.default_policy_for")
        if calib is not None:
            policy = replace(policy, calibration=calib.describe())
        self.allow_subset = allow_subset
        align = Alignment(ref, cand)
        self.ctx = Context(ref, cand, policy, align, calib, notes=list(align.notes))
        self.numerics = None  # calibrated, twin apart from the reference: check (2), the twin against it
        self.unreplayed = []  # explained routing flips whose samples are no longer compared
        if calib is not None:
            levels = {t.level for t in (ref, cand, calib.golden, calib.twin) if t is not None}
            if levels != {"full"}:  # check (1) reads whole rows; a lower level would compare nothing and pass
                raise TraceError(f"a calibrated comparison needs full traces on every side (got levels "
                                 f"{sorted(levels)})")
            for t in (calib.golden, calib.twin):
                if t is not None:
                    same_layout(ref, t)
            if calib.twin is not None:
                self.numerics = Comparator(ref, calib.twin, policy)

    # the report reads these
    ref = property(lambda self: self.ctx.ref)
    cand = property(lambda self: self.ctx.cand)
    policy = property(lambda self: self.ctx.policy)
    calib = property(lambda self: self.ctx.calib)
    pairs = property(lambda self: self.ctx.pairs)
    notes = property(lambda self: self.ctx.notes)
    @property
    def skipped(self) -> set:
        """What was not compared, the twin's check (2) included (a twin's own routing flip takes its sample out)."""
        twin = set() if self.numerics is None else {wording.twin_skipped(x) for x in self.numerics.skipped}
        return self.ctx.skipped | twin

    def metadata_break(self) -> Break | None:
        """Traces that cannot be compared (a ``metadata`` break) or reference samples left out (``coverage``)."""
        b, notes = self.ctx.align.structure_break(self.allow_subset)
        self.ctx.notes.extend(notes)
        return b

    def layer(self, r: LayerView, c: LayerView) -> LayerResult:
        i = r.layer
        routing = compare_routing(self.ctx, r, c)  # first: an explained flip takes its sample out of what follows
        self.unreplayed += stop_comparing(self.ctx, routing)
        results = {name: res for name in STATES if (res := self._state(r, c, name)) is not None}
        cache, cache_tensors = check_cache(self.ctx, r, c)
        results.update(cache_tensors)
        tensors = tuple(results[n] for n in VALUE_ORDER if n in results)
        numerics = None
        if self.numerics is not None:
            numerics = self.numerics.layer(r, self.calib.twin.layer(i))
        checks = self._checks(i, tensors, cache, numerics)
        checks.add("routing", routing_break(routing))
        first = checks.first()
        if first is not None and first.heads:
            heads_notes(self.ctx, i, first)
        return LayerResult(layer=i, tensors=tensors, cache=cache, first_break=first, numerics=numerics,
                           routing=routing)

    def final(self) -> FinalResult:
        return compare_final(self.ctx, None if self.numerics is None else self.numerics.final())

    def _state(self, r: LayerView, c: LayerView, name: str) -> TensorResult | None:
        """One residual-stream state at the best level both traces hold (None: attention heads not kept)."""
        tol = self.ctx.value_tol(name, r.layer)
        why = absent_state(self.ctx.ref, name) or absent_state(self.ctx.cand, name)
        if why is not None:  # the model's layers do not have it (a parallel block's mid): listed, not compared
            self.ctx.skipped.add(wording.absent_state(name, why))
            return TensorResult(tensor=name, level="none", tol=tol, note=f"absent: {why}")
        if r.state(name) is not None and c.state(name) is not None:
            return compare_full_state(self.ctx, r, c, name, tol)
        if name == "attn_heads":
            return None
        if r.sampled(name) is not None or c.sampled(name) is not None:
            return compare_sampled(self.ctx, r, c, name, tol)
        return compare_stats(self.ctx, r, c, name, tol)

    def _checks(self, layer: int, tensors: tuple, cache: CacheResult, numerics: LayerResult | None) -> Checks:
        """Everything the layer's checks found, each under its step of breaks.ORDER."""
        ctx, checks = self.ctx, Checks()
        if getattr(ctx.ref, "ranks", None) or getattr(ctx.cand, "ranks", None):  # tensor-parallel rank traces
            checks.add("shape", tiling_break(ctx, layer))
            checks.add("rank_divergence", lambda: divergence_break(ctx, layer))  # costly: only if needed
        for t in tensors:
            checks.add("shape", shape_break("layer", layer, t))
        for t in tensors:
            checks.add("finite_mask", self._finite_or_numerics(layer, t, numerics))
        checks.add(*cache_break(layer, cache))
        nb = None if numerics is None else numerics.first_break
        if nb is not None and nb.kind != "value":  # the twin itself broke structurally: the precision's fault
            checks.add("numerics", numerics_break(nb, ctx.noise_of, ctx.policy.name))
        if layer == 0:
            checks.add("positions", ctx.align.positions_break)
        heads = _heads_of(next((x for x in tensors if x.tensor == "attn_heads"), None))
        ordered = [t for t in tensors if t.tensor != "attn_heads"] + [t for t in tensors if t.tensor == "attn_heads"]
        for t in ordered:
            nt = None if numerics is None else numerics.tensor(t.tensor)
            if nt is not None and not nt:
                checks.add("value", numerics_break(tensor_break("layer", layer, nt), ctx.noise_of, ctx.policy.name))
            h = heads if t.tensor == "attn_update" and heads is not False else _heads_of(t)
            checks.add("value", value_break("layer", layer, t, h, ctx.kv_heads_read(h), ctx.noise_of))
        return checks

    def _finite_or_numerics(self, layer: int, t: TensorResult, numerics: LayerResult | None) -> Break | None:
        """t's finite-mask break; when the twin is non-finite there too, the precision's (check 2)."""
        if t.finite_ok:
            return None
        nt = None if numerics is None else numerics.tensor(t.tensor)
        if nt is not None and not nt.finite_ok:
            return numerics_break(finite_break("layer", layer, nt), self.ctx.noise_of, self.ctx.policy.name)
        return finite_break("layer", layer, t)


def absent_state(trace: Trace, name: str) -> str | None:
    """Why ``trace``'s layers do not have state ``name`` (meta.absent_states), or None."""
    absent = trace.meta.get("absent_states") or {}
    return None if name not in absent else str(absent[name])


def _heads_of(t: TensorResult | None):
    """The query heads out of tolerance in t (calibrated: check 1's); False when t is absent."""
    if t is None:
        return False
    return t.heads if t.calib is None else t.calib.heads
