"""Where and how a comparison first fails: the ``Break`` type, the one order of checks, the first break.

Every check of a layer (or of the final stage) files what it found under its step of ``ORDER``;
``Checks.first`` returns the first break in that order, and within one step the first filed. The
order follows the layer's computation (contract §2.10): a tensor of the wrong shape or a
tensor-parallel rank set that does not tile makes every later check meaningless; then ranks that
disagree on a replicated tensor; non-finite values; the cache's lengths, then its positions; in a
calibrated comparison, the twin's own structural break (the precision's fault, check 2); the
position ids the model was given (layer 0); values, in the order the layer computes them; the
final top-ranked ids last. A check that is costly may file a function, called only when no earlier
step broke.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from ..dumps.schema import FINAL_TENSORS, LAYER_TENSORS
from . import wording
from .results import CacheResult, TensorResult

ORDER = ("shape", "rank_divergence", "finite_mask", "cache_length", "cache_positions", "numerics", "positions",
         "routing", "value", "top_ids")

SUBLAYER = {**{t.name: t.sublayer for t in LAYER_TENSORS}, **{n: "final" for n in FINAL_TENSORS},
            "topk_ids": "final", "cache_lengths": "attention", "cache_positions": "attention",
            "positions": "attention", "routing": "mlp"}


@dataclass(frozen=True, kw_only=True)
class Break:
    """Where and how a comparison first fails."""
    stage: str  # metadata | layer | final
    kind: str  # coverage | metadata | shape | rank_divergence | finite_mask | cache_length | cache_positions |
    # positions | routing | value | top_ids
    message: str
    layer: int | None = None
    tensor: str | None = None
    sample: int | None = None  # reference trace's sample index
    position: int | None = None  # token index within the sample
    channel: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    atol: float | None = None
    rtol: float | None = None
    ntol: float | None = None
    bound: float | None = None  # the tolerance at the worst element: atol + rtol·|ref| + ntol·rms(row)
    padding: bool = False  # a finite-mask break in padding rows
    heads: tuple | None = None  # attention: query heads that differ
    samples: tuple = ()  # every reference sample that breaks here
    kv_heads: tuple | None = None  # cache: KV heads that differ; attention: the KV heads the query heads read
    check: str | None = None  # calibrated comparisons: "change" (check 1) or "numerics" (check 2)
    noise_ratio: float | None = None  # check 1: the candidate's row error / the twin's measured noise
    noise_factor: float | None = None  # check 1: the allowed ratio K
    noise_of: str | None = None  # check 1: the twin's precisions, in words
    reference_value: float | None = None  # value breaks (full and sampled levels): both values at the worst element
    candidate_value: float | None = None

    @property
    def sublayer(self) -> str | None:
        return SUBLAYER.get(self.tensor) if self.tensor else None

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["heads"] = list(self.heads) if self.heads is not None else None
        d["kv_heads"] = list(self.kv_heads) if self.kv_heads is not None else None
        d["samples"] = list(self.samples)
        d["sublayer"] = self.sublayer
        return d


Found = Break | Callable[[], "Break | None"] | None


class Checks:
    """What the checks of one layer (or of the final stage) found, each under its step of ORDER."""

    def __init__(self):
        self._found: list[tuple[int, int, Found]] = []

    def add(self, step: str, found: Found) -> None:
        """File a break (or a function that looks for one, called only if no earlier step broke) under step."""
        if step not in ORDER:
            raise ValueError(f"check step must be one of {', '.join(ORDER)} (got {step!r})")
        if found is not None:
            self._found.append((ORDER.index(step), len(self._found), found))

    def first(self) -> Break | None:
        """The first break in ORDER; within one step, the first filed."""
        for _, _, found in sorted(self._found, key=lambda x: x[:2]):
            b = found() if callable(found) else found
            if b is not None:
                return b
        return None


def first_break(found: dict) -> Break | None:
    """The first break of {step: break or None}, in ORDER."""
    checks = Checks()
    for step, b in found.items():
        checks.add(step, b)
    return checks.first()


# -- breaks from results -----------------------------------------------------------------------------

def shape_break(stage: str, layer: int | None, t: TensorResult) -> Break | None:
    if t.shape_detail is None:
        return None
    return Break(stage=stage, kind="shape", message=t.shape_detail, layer=layer, tensor=t.tensor)


def finite_break(stage: str, layer: int | None, t: TensorResult) -> Break | None:
    f = t.finite
    if f.ok:
        return None
    s = t.bad_samples[0] if t.bad_samples else None
    if not f.valid_ok:  # the samples whose finite masks differ (bad_samples also holds those out of tolerance)
        s, pos = f.at[0] if f.at else (s, t.bad_positions.get(s))
        return Break(stage=stage, kind="finite_mask", message=wording.nonfinite_valid(t), layer=layer,
                     tensor=t.tensor, sample=s, position=pos, samples=tuple(x for x, _ in f.at) or t.bad_samples)
    samples = tuple(x[0] for x in f.pad_by_sample) or t.bad_samples
    return Break(stage=stage, kind="finite_mask", message=wording.nonfinite_padding(t), layer=layer,
                 tensor=t.tensor, padding=True, sample=samples[0] if samples else s, samples=samples)


def value_break(stage: str, layer: int | None, t: TensorResult, heads=None, kv_read=None,
                noise_of: str | None = None) -> Break | None:
    """The value break of t, or None; kv_read: the KV heads the query heads ``heads`` read (attention)."""
    if t.values_ok:
        return None
    if t.calib is not None:
        k = t.calib
        s, pos = k.worst
        return Break(stage=stage, kind="value", message=wording.calibrated_values(t, noise_of), layer=layer,
                     tensor=t.tensor, sample=s, position=pos, max_abs_error=t.max_abs, max_rel_error=t.max_rel,
                     heads=heads, samples=k.bad_samples, kv_heads=k.groups if k.groups is not None else kv_read,
                     check="change", noise_ratio=k.max_ratio, noise_factor=k.factor, noise_of=noise_of)
    s, pos, ch = t.worst if t.worst else (None, None, None)
    common = dict(stage=stage, kind="value", layer=layer, tensor=t.tensor, sample=s, position=pos, channel=ch,
                  max_abs_error=t.max_abs, atol=t.atol, rtol=t.rtol, ntol=t.ntol, heads=heads, samples=t.bad_samples)
    if t.level == "stats":  # per-sample min, max, mean and rms: no element, row or relative error exists
        return Break(message=wording.stats_values(t), **common)
    ref, cand = t.worst_values if t.worst_values else (None, None)
    return Break(message=wording.values(t), max_rel_error=t.max_rel, bound=t.worst_bound, reference_value=ref,
                 candidate_value=cand, kv_heads=t.kv_heads if t.kv_heads is not None else kv_read, **common)


def tensor_break(stage: str, layer: int | None, t: TensorResult, noise_of: str | None = None) -> Break | None:
    """This tensor's own first problem (shape, then finite mask, then value), or None."""
    return first_break({"shape": shape_break(stage, layer, t), "finite_mask": finite_break(stage, layer, t),
                        "value": value_break(stage, layer, t, noise_of=noise_of)})


def cache_break(layer: int, cache: CacheResult) -> tuple[str, Break | None]:
    """(step, break) of a layer's cache lengths and positions."""
    if not cache.lengths_ok:
        return "cache_length", Break(stage="layer", kind="cache_length", message=cache.detail, layer=layer,
                                     tensor="cache_lengths", sample=cache.sample, position=cache.position,
                                     samples=cache.samples)
    if not cache.positions_ok:
        return "cache_positions", Break(stage="layer", kind="cache_positions", message=cache.detail, layer=layer,
                                        tensor="cache_positions", sample=cache.sample, position=cache.position,
                                        samples=cache.samples)
    return "cache_positions", None


def numerics_break(b: Break | None, label: str, policy_name: str) -> Break | None:
    """A break of the twin against the reference: check (2), the candidate's precision itself."""
    if b is None:
        return None
    return replace(b, check="numerics", message=wording.numerics(label, policy_name, b.message))
