"""Per-layer comparison of two traces by logical (sample, position), and the first break.

Per layer, in the order of seed §2.10: shapes; finite-value masks (valid rows and
padding rows separately); cache logical lengths, then positions, exactly; then values
against the declared tolerance, in the order the layer computes them (layer input,
cache keys and values, attention update, U, MLP update, layer output). Then final
raw logits and top-ranked ids. Every tensor is read once, one sample row at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dumps.reader import LayerView, Trace, TraceError
from ..dumps.schema import STAT_COLUMNS
from .calibrate import CalibAcc, Calibration, CalibResult
from .metrics import Partial, slab
from .policy_file import resolve_policy
from .tolerance import TOL_FIELDS, Policy, Tolerance

VALUE_ORDER = ("layer_input", "cache_keys", "cache_values", "attn_update", "attn_heads", "mid", "mlp_update",
               "layer_output")
SUBLAYER = {"layer_input": "residual", "cache_keys": "attention", "cache_values": "attention",
            "attn_heads": "attention", "attn_update": "attention", "mid": "attention", "mlp_update": "mlp",
            "layer_output": "mlp", "logits": "final", "norm_last": "final", "topk_ids": "final",
            "cache_lengths": "attention", "cache_positions": "attention", "positions": "attention"}
ARCH_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
KIND_ORDER = ("coverage", "shape", "finite_mask", "cache_length", "cache_positions", "positions", "value", "top_ids")
# In a calibrated comparison the values are judged by the candidate's row error against the float64 golden,
# relative to the twin's; this tolerance only gathers the candidate-vs-reference metrics for the report.
METRICS_ONLY = Tolerance(float("inf"), 0.0)


@dataclass(frozen=True)
class Break:
    """Where and how a comparison first fails."""
    stage: str  # metadata | layer | final
    kind: str  # shape | finite_mask | cache_length | cache_positions | value | top_ids | metadata
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

    @property
    def sublayer(self) -> str | None:
        return SUBLAYER.get(self.tensor) if self.tensor else None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["heads"] = list(self.heads) if self.heads is not None else None
        d["kv_heads"] = list(self.kv_heads) if self.kv_heads is not None else None
        d["samples"] = list(self.samples)
        d["sublayer"] = self.sublayer
        return d


@dataclass(frozen=True)
class TensorResult:
    """One tensor of one layer (or of the final stage), compared over aligned cells."""
    tensor: str
    level: str  # full | sampled | stats | none
    tol: Tolerance
    compared: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    cosine: float | None = None
    n_bad: int = 0
    worst: tuple | None = None  # (sample, position, channel)
    min_atol: float = 0.0  # smallest atol that passes with this rtol and ntol
    min_rtol: float = 0.0  # smallest rtol that passes with this atol and ntol
    min_ntol: float = 0.0  # smallest ntol that passes with this atol and rtol
    min_row_rtol: float = 0.0  # smallest row_rtol under which every row with element errors passes whole
    max_row_rel: float = 0.0  # largest ||cand - ref|| / ||ref|| over rows (one sample and position)
    rows_by_row_rule: int = 0  # rows with element errors beyond atol/rtol/ntol accepted by row_rtol
    worst_bound: float | None = None  # the tolerance at the worst element
    bound_floor: float | None = None  # smallest atol + ntol·rms(ref row): every element may differ at least this much
    finite_ref_only: int = 0  # valid cells finite in ref but not in cand
    finite_cand_only: int = 0
    nonfinite_both: int = 0
    pad_nonfinite_ref: int = 0
    pad_nonfinite_cand: int = 0
    shape_detail: str | None = None
    bad_samples: tuple = ()
    bad_positions: dict = field(default_factory=dict)  # sample -> first bad position
    heads: tuple | None = None
    kv_heads: tuple | None = None  # cache tensors (full level): the KV heads with values out of tolerance
    bit_identical: bool | None = None
    note: str | None = None
    equal_nan: bool = False
    calib: CalibResult | None = None  # check (1) of a calibrated comparison

    @property
    def values_ok(self) -> bool:
        return bool(self.calib) if self.calib is not None else self.n_bad == 0

    @property
    def atol(self) -> float:
        return self.tol.atol

    @property
    def rtol(self) -> float:
        return self.tol.rtol

    @property
    def ntol(self) -> float:
        return self.tol.ntol

    @property
    def row_rtol(self) -> float:
        return self.tol.row_rtol

    @property
    def finite_ok(self) -> bool:
        both = 0 if self.equal_nan else self.nonfinite_both
        return not (self.finite_ref_only or self.finite_cand_only or both or
                    self.pad_nonfinite_cand > self.pad_nonfinite_ref or self.pad_nonfinite_ref > self.pad_nonfinite_cand)

    def __bool__(self) -> bool:
        return self.shape_detail is None and self.finite_ok and self.values_ok

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("bad_positions", "tol", "calib")}
        if self.calib is not None:
            d["calibrated"] = self.calib.as_dict()
        d.update(atol=self.atol, rtol=self.rtol, ntol=self.ntol, row_rtol=self.row_rtol)
        d["passed"] = bool(self)
        d["worst"] = list(self.worst) if self.worst else None
        d["heads"] = list(self.heads) if self.heads is not None else None
        d["kv_heads"] = list(self.kv_heads) if self.kv_heads is not None else None
        d["bad_samples"] = list(self.bad_samples)
        for k in ("max_abs", "max_rel", "mean_abs", "min_atol", "min_rtol", "min_ntol", "min_row_rtol", "max_row_rel",
                  "worst_bound", "bound_floor"):
            d[k] = _num(d[k])
        return d


def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


@dataclass(frozen=True)
class CacheResult:
    lengths_ok: bool = True
    positions_ok: bool = True
    detail: str | None = None
    sample: int | None = None
    position: int | None = None
    samples: tuple = ()


@dataclass(frozen=True)
class LayerResult:
    layer: int
    tensors: tuple
    cache: CacheResult
    first_break: Break | None
    numerics: "LayerResult | None" = None  # calibrated: the twin against the reference (check 2)

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
        if self.numerics is not None:
            d["numerics"] = {"passed": bool(self.numerics), "tensors": {
                t.tensor: {"passed": bool(t), "max_abs": _num(t.max_abs), "max_row_rel": _num(t.max_row_rel),
                           "n_bad": t.n_bad} for t in self.numerics.tensors}}
        return d


@dataclass(frozen=True)
class FinalResult:
    tensors: tuple
    top_ids_ok: bool
    top_detail: str | None
    first_break: Break | None
    top: tuple = ()  # per matched sample: (ref sample, ref top ids, cand top ids)
    sample_max_abs: tuple = ()  # per matched sample: (ref sample, logits max abs error)
    gather: tuple = ()  # per matched sample: (ref sample, ref token, cand token, last token)
    breaks: tuple = ()  # (check name, its own first Break or None) per final tensor, then "top ids"
    numerics: "FinalResult | None" = None  # calibrated: the twin against the reference (check 2)

    def __bool__(self) -> bool:
        return self.first_break is None

    def tensor(self, name: str) -> TensorResult | None:
        return next((t for t in self.tensors if t.tensor == name), None)


class _Acc:
    """Streaming error metrics of one tensor: merges the per-slab metrics of verify.metrics."""

    def __init__(self, tol: Tolerance, equal_nan: bool):
        self.tol, self.equal_nan = tol, equal_nan
        self.p = Partial()

    @property
    def bad_samples(self) -> dict:
        return self.p.bad_samples

    def add(self, r: np.ndarray, c: np.ndarray, sample: int, toks: np.ndarray, heads: int | None = None):
        """r, c: (T, W) aligned rows of one sample (one row per position); toks: their token indices."""
        self.p.merge(slab(r, c, self.tol, self.equal_nan, sample, toks, heads))

    def result(self, tensor: str, level: str, **kw) -> TensorResult:
        p = self.p
        cos = float(p.rc / np.sqrt(p.rr * p.cc)) if p.rr > 0 and p.cc > 0 else (1.0 if p.rr == p.cc == 0 and p.n
                                                                                   else None)
        heads = None if p.head_bad is None else tuple(int(h) for h in np.flatnonzero(p.head_bad))
        worst = None if p.worst is None else p.worst[1:4]
        return TensorResult(tensor, level, self.tol, compared=p.n, max_abs=p.max_abs, max_rel=p.max_rel,
                            mean_abs=p.sum_abs / p.n if p.n else 0.0, cosine=cos, n_bad=p.n_bad, worst=worst,
                            min_atol=p.min_atol, min_rtol=p.min_rtol, min_ntol=p.min_ntol,
                            min_row_rtol=p.min_row_rtol, max_row_rel=p.max_row_rel,
                            rows_by_row_rule=p.rows_by_row_rule,
                            worst_bound=None if p.worst is None else p.worst[4],
                            bound_floor=p.bound_floor if np.isfinite(p.bound_floor) else None, finite_ref_only=p.fin[0],
                            finite_cand_only=p.fin[1], nonfinite_both=p.fin[2],
                            bad_samples=tuple(sorted(p.bad_samples)), bad_positions=dict(p.bad_samples),
                            heads=heads, equal_nan=self.equal_nan, **kw)


def _prefetched(read, work, pairs):
    """work(pair, read(pair, slot)) for every pair, in order. (Reading on a second thread while
    computing was measured and did not pay: both are memory-bound and share the bandwidth.)"""
    return [work(p, read(p, 0)) for p in pairs]


def match_samples(ref: Trace, cand: Trace):
    """Pairs (ref sample, cand sample) with equal token ids, in order; and the unmatched of each side."""
    free = {}
    for j, toks in enumerate(cand.samples):
        free.setdefault(toks, []).append(j)
    pairs, ref_only = [], []
    for i, toks in enumerate(ref.samples):
        if free.get(toks):
            pairs.append((i, free[toks].pop(0)))
        else:
            ref_only.append(i)
    cand_only = sorted(j for js in free.values() for j in js)
    return pairs, ref_only, cand_only


def rotate_keys(keys: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """RoPE (rotate-half convention) on keys (H, T, d) stored before rotation."""
    freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    k = keys.astype(np.float64)
    half = k.shape[-1] // 2
    rot = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
    return (k * cos + rot * sin).astype(np.result_type(keys.dtype, np.float32))


class Comparator:
    """Compares a reference trace with a candidate, layer by layer."""

    def __init__(self, ref: Trace, cand: Trace, policy: Policy | None = None, calib: Calibration | None = None,
                 allow_subset: bool = False):
        self.ref, self.cand = ref, cand
        # no policy given: the tolerance the reference declares, else the dtype defaults
        if policy is None:  # the baseline's declared tolerance, else the dtype defaults
            declared = ref.meta.get("tolerance")
            policy = resolve_policy(declared, ref.meta, cand.meta,
                                    {k: "baseline trace" for k in ("base", *TOL_FIELDS)} if declared else None)
        if calib is not None:
            from dataclasses import replace
            policy = replace(policy, calibration=calib.describe())
        self.policy = policy
        self.pairs, self.ref_only, self.cand_only = match_samples(ref, cand)
        self.allow_subset = allow_subset
        self.calib = calib
        self.numerics = None  # calibrated, twin apart from the reference: check (2), the twin against it
        if calib is not None:
            levels = {t.level for t in (ref, cand, calib.golden, calib.twin) if t is not None}
            if levels != {"full"}:  # check (1) reads whole rows; a lower level would compare nothing and pass
                raise TraceError(f"a calibrated comparison needs full traces on every side (got levels "
                                 f"{sorted(levels)})")
            for t in (calib.golden, calib.twin):
                if t is not None:
                    _same_layout(ref, t)
            if calib.twin is not None:
                self.numerics = Comparator(ref, calib.twin, self.policy)
        self.notes: list[str] = []
        self.skipped: set[str] = set()
        self._align = {}
        for rs, cs in self.pairs:
            rcols, rtoks = ref.cells(rs)
            ccols, ctoks = cand.cells(cs)
            common, ri, ci = np.intersect1d(rtoks, ctoks, assume_unique=True, return_indices=True)
            self._align[rs] = (_as_slice(rcols[ri]), _as_slice(ccols[ci]), common,
                               ref.pad_cols(rs), cand.pad_cols(cs))
            only_r, only_c = np.setdiff1d(rtoks, ctoks), np.setdiff1d(ctoks, rtoks)
            if only_r.size:
                self.notes.append(f"sample {rs}: positions {_span(only_r)} have residual states in the reference only"
                                  " (compared as cache entries where the cache holds them)")
            if only_c.size:
                self.notes.append(f"sample {rs}: positions {_span(only_c)} have residual states in the candidate only")

    # -- metadata ---------------------------------------------------------------------------------
    def metadata_break(self) -> Break | None:
        ra, ca = self.ref.args, self.cand.args
        diffs = [f"{k} {ra.get(k)} vs {ca.get(k)}" for k in ARCH_KEYS if ra.get(k) != ca.get(k)]
        if self.ref.n_layers != self.cand.n_layers and not any(d.startswith("n_layers") for d in diffs):
            diffs.append(f"layers stored {self.ref.n_layers} vs {self.cand.n_layers}")
        if diffs:
            return Break("metadata", "metadata", "traces are not comparable: architectures differ ("
                         + "; ".join(diffs) + ")")
        if not self.pairs:
            return Break("metadata", "metadata", "traces are not comparable: no sample has the same token ids "
                         f"(reference {len(self.ref.samples)} samples, candidate {len(self.cand.samples)})"
                         + _near_misses(self.ref, self.cand, self.ref_only, self.cand_only))
        if self.cand_only:
            self.notes.append(f"candidate samples {self.cand_only} have no counterpart in the reference (not compared)")
        if self.ref_only and self.allow_subset:
            self.notes.append(f"{len(self.ref_only)} of {len(self.ref.samples)} reference samples skipped "
                              f"(--allow-subset): samples {self.ref_only} have no counterpart in the candidate")
        elif self.ref_only:
            return self.coverage_break()
        return None

    def coverage_break(self) -> Break:
        """Reference requests the candidate never produced: a failure, never a silent pass."""
        n, total = len(self.ref_only), len(self.ref.samples)
        msg = (f"{n} of {total} reference sample{'s' if total > 1 else ''} "
               f"{'have' if n > 1 else 'has'} no counterpart in the candidate (not compared): samples "
               f"{self.ref_only}" + _near_misses(self.ref, self.cand, self.ref_only, self.cand_only)
               + "; pass --allow-subset to compare against a subset on purpose")
        return Break("metadata", "coverage", msg, sample=self.ref_only[0], samples=tuple(self.ref_only))

    # -- one layer ----------------------------------------------------------------------------------
    def layer(self, r: LayerView, c: LayerView) -> LayerResult:
        i = r.layer
        results = {}
        for name in ("layer_input", "attn_update", "attn_heads", "mid", "mlp_update", "layer_output"):
            res = self._state(r, c, name)
            if res is not None:
                results[name] = res
        cache, cache_tensors = self._cache(r, c)
        results.update(cache_tensors)
        tensors = tuple(results[n] for n in VALUE_ORDER if n in results)
        numerics = None
        if self.numerics is not None:
            numerics = self.numerics.layer(r, self.calib.twin.layer(i))
        first = self._first_break(i, tensors, cache, numerics)
        if i == 0 and (first is None or KIND_ORDER.index(first.kind) > KIND_ORDER.index("positions")):
            first = self.input_positions_break() or first
        if getattr(self.ref, "ranks", None) or getattr(self.cand, "ranks", None):  # tensor-parallel rank traces
            from .ranks import rank_checks
            first = rank_checks(self, i, first)
        return LayerResult(i, tensors, cache, first, numerics)

    def input_positions_break(self) -> Break | None:
        """/inputs/positions of the cells both sides computed (by token index), exactly: the position ids the
        model was given. Reported at layer 0, after the cache checks and before values, like cache positions."""
        rp, cp = self.ref.inputs["positions"], self.cand.inputs["positions"]
        first, bad = None, []
        for rs, cs in self.pairs:
            rsl, csl, toks, _, _ = self._align[rs]
            a, b = rp[rs, rsl], cp[cs, csl]
            diff = np.flatnonzero(a != b)
            if diff.size:
                bad.append(rs)
                if first is None:
                    j = int(diff[0])
                    first = (rs, int(toks[j]), f"sample {rs}: token {int(toks[j])} was given position id "
                             f"{int(b[j])} in the candidate, {int(a[j])} in the reference ({diff.size} of "
                             f"{toks.size} computed tokens differ)")
        if first is None:
            return None
        return Break("layer", "positions", first[2], 0, "positions", first[0], first[1], samples=tuple(bad))

    def _first_break(self, layer, tensors, cache: CacheResult, numerics: LayerResult | None = None) -> Break | None:
        """The check order of a layer: shape, finite mask, cache length, cache positions, values."""
        for t in tensors:
            if t.shape_detail:
                return Break("layer", "shape", t.shape_detail, layer, t.tensor)
        for t in tensors:
            if not t.finite_ok:
                return self._finite_break("layer", layer, t, numerics)
        if not cache.lengths_ok:
            return Break("layer", "cache_length", cache.detail, layer, "cache_lengths", cache.sample, cache.position,
                         samples=cache.samples)
        if not cache.positions_ok:
            return Break("layer", "cache_positions", cache.detail, layer, "cache_positions", cache.sample,
                         cache.position, samples=cache.samples)
        nb = None if numerics is None else numerics.first_break
        if nb is not None and nb.kind != "value":  # the twin itself broke structurally: the precision's fault
            return self._numerics_break(nb)
        ordered = [t for t in tensors if t.tensor != "attn_heads"] + [t for t in tensors if t.tensor == "attn_heads"]
        for t in ordered:
            nt = None if numerics is None else numerics.tensor(t.tensor)
            if nt is not None and not nt:
                return self._numerics_break(self.numerics._tensor_break("layer", layer, nt))
            if t.values_ok:
                continue
            heads = t.heads if t.calib is None else t.calib.heads
            if t.tensor == "attn_update":
                h = next((x for x in tensors if x.tensor == "attn_heads"), None)
                if h is not None:
                    heads = h.heads if h.calib is None else h.calib.heads
            return self._value_break("layer", layer, t, heads)
        return None

    def _kv_heads_read(self, heads) -> tuple | None:
        """The KV heads g(h) = ⌊h·H_kv/H_q⌋ that query heads ``heads`` read, by the reference's model."""
        hq, hkv = self.ref.args.get("n_heads"), self.ref.args.get("n_kv_heads")
        if not heads or not isinstance(hq, int) or not isinstance(hkv, int) or hq < 1:
            return None
        return tuple(sorted({h * hkv // hq for h in heads}))

    def _numerics_break(self, b: Break) -> Break:
        """A break of the twin against the reference: check (2), the candidate's precision itself."""
        from dataclasses import replace
        label = self.calib.label
        return replace(b, check="numerics", message=(
            f"the {label} numerics themselves break here (check 2): the twin, the reference's own path in {label}, "
            f"differs from the reference beyond the fixed {self.policy.name} envelope: {b.message}"))

    def _finite_break(self, stage, layer, t: TensorResult, numerics=None) -> Break:
        nt = None if numerics is None else numerics.tensor(t.tensor)
        if nt is not None and not nt.finite_ok:  # the twin is non-finite there too: the precision overflows
            return self._numerics_break(self._finite_break(stage, layer, nt))
        if t.finite_ref_only or t.finite_cand_only or (t.nonfinite_both and not t.equal_nan):
            where = (f"{t.finite_cand_only} valid values finite only in the candidate, "
                     f"{t.finite_ref_only} finite only in the reference, {t.nonfinite_both} non-finite in both")
            s = t.bad_samples[0] if t.bad_samples else None
            return Break(stage, "finite_mask", f"non-finite values in valid rows of {t.tensor}: {where}", layer,
                         t.tensor, s, t.bad_positions.get(s), samples=t.bad_samples)
        side = "candidate" if t.pad_nonfinite_cand > t.pad_nonfinite_ref else "reference"
        n = max(t.pad_nonfinite_cand, t.pad_nonfinite_ref)
        return Break(stage, "finite_mask", f"{n} non-finite values in padding rows of {t.tensor} in the {side} only "
                     "(a padding row entered a softmax with no finite score?)", layer, t.tensor, padding=True,
                     sample=t.bad_samples[0] if t.bad_samples else None, samples=t.bad_samples)

    def _value_break(self, stage, layer, t: TensorResult, heads=None) -> Break:
        if t.calib is not None:
            return self._calib_break(stage, layer, t, heads)
        s, pos, ch = t.worst if t.worst else (None, None, None)
        if t.level == "stats":  # per-sample min, max, mean and rms: no element, row or relative error exists
            msg = (f"{t.n_bad} of {t.compared} statistics (min, max, mean, rms per sample) of {t.tensor} out of "
                   f"tolerance; largest statistic error {t.max_abs:.3g} (atol={t.atol:g}, rtol={t.rtol:g}, "
                   f"ntol={t.ntol:g} of the sample's rms); would pass with atol>={t.min_atol:.3g} [stats level: "
                   "no element, row or relative error is recorded]")
            return Break(stage, "value", msg, layer, t.tensor, s, pos, ch, t.max_abs, None, t.atol, t.rtol, t.ntol,
                         None, heads=heads, samples=t.bad_samples)
        msg = (f"{t.n_bad} of {t.compared} values of {t.tensor} out of tolerance; max_abs={t.max_abs:.3g}, "
               f"largest row error {t.max_row_rel:.3g} of the row norm (atol={t.atol:g}, rtol={t.rtol:g}, "
               f"ntol={t.ntol:g}, row_rtol={t.row_rtol:g}); would pass with atol>={t.min_atol:.3g}, "
               f"rtol>={t.min_rtol:.3g}, ntol>={t.min_ntol:.3g} or row_rtol>={t.min_row_rtol:.3g}")
        if t.level != "full":
            msg += f" [{t.level} level]"
        kv = t.kv_heads if t.kv_heads is not None else self._kv_heads_read(heads)
        return Break(stage, "value", msg, layer, t.tensor, s, pos, ch, t.max_abs, t.max_rel, t.atol, t.rtol, t.ntol,
                     t.worst_bound, heads=heads, samples=t.bad_samples, kv_heads=kv)

    def _calib_break(self, stage, layer, t: TensorResult, heads=None) -> Break:
        k = t.calib
        s, pos = k.worst
        msg = (f"row error {k.max_ratio:.3g}x the measured {self.calib.label} noise (allowed {k.factor:g}x): "
               f"{k.bad_rows} of {k.rows} rows of {t.tensor} out; at the worst row the candidate is {k.cand_error:.3g} "
               f"of the row norm from the float64 golden, the twin {k.noise:.3g}, allowed {k.allowed:.3g} "
               f"(K x noise + floor {k.floor:.2g}); would pass with --noise-factor {k.min_factor:.3g}")
        kv = k.groups if k.groups is not None else self._kv_heads_read(heads)
        return Break(stage, "value", msg, layer, t.tensor, s, pos, None, t.max_abs, t.max_rel, heads=heads,
                     samples=k.bad_samples, kv_heads=kv, check="change", noise_ratio=k.max_ratio,
                     noise_factor=k.factor, noise_of=self.calib.label)

    def _value_tol(self, name: str, layer: int | None = None) -> Tolerance:
        return METRICS_ONLY if self.calib is not None else self.policy.tol(name, layer)

    def _state(self, r: LayerView, c: LayerView, name: str) -> TensorResult | None:
        tol = self._value_tol(name, r.layer)
        rd, cd = r.state(name), c.state(name)
        if rd is not None and cd is not None:
            if rd.shape[2] != cd.shape[2]:
                return TensorResult(name, "full", tol,
                                    shape_detail=f"{name} width {rd.shape[2]} vs {cd.shape[2]}")
            acc = _Acc(tol, self.policy.equal_nan)
            heads = self.ref.args.get("n_heads") if name == "attn_heads" else None
            cal = self._calib_acc(heads)
            gd, td = self._calib_datasets(r.layer, name)

            def read(pair, slot):  # one sample row of each trace: one HDF5 chunk each, into reused buffers
                rs, cs = pair
                return self.ref.read_row(rd, rs, f"ref{slot}"), self.cand.read_row(cd, cs, f"cand{slot}")

            def one(pair, rows):
                rs, cs = pair
                rsl, csl, toks, rpad, cpad = self._align[rs]
                rrow, crow = rows
                if cal is not None:
                    g = self.calib.golden.read(gd, (rs,))[rsl]
                    t = rrow[rsl] if td is None else self.calib.twin.read(td, (rs,))[rsl]
                    cal.add(crow[csl], t, g, rs, toks)
                part = slab(rrow[rsl], crow[csl], tol, self.policy.equal_nan, rs, toks, heads)
                nr = int((~np.isfinite(rrow[rpad])).sum()) if rpad.size else 0
                nc = int((~np.isfinite(crow[cpad])).sum()) if cpad.size else 0
                if nc != nr:
                    part.bad_samples.setdefault(rs, None)
                return part, nr, nc

            pad_r = pad_c = 0
            for part, nr, nc in _prefetched(read, one, self.pairs):
                acc.p.merge(part)
                pad_r, pad_c = pad_r + nr, pad_c + nc
            return acc.result(name, "full", pad_nonfinite_ref=pad_r, pad_nonfinite_cand=pad_c,
                              calib=None if cal is None else cal.result())
        if name == "attn_heads":
            return None
        if r.sampled(name) is not None or c.sampled(name) is not None:
            return self._sampled(r, c, name, tol)
        return self._stats(r, c, name, tol)

    def _sampled(self, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
        """Values at the sampled level's declared (token, channel) subset; the full side is subset to match."""
        self.skipped.add("values compared on the sampled subset only (sampled level)")
        acc = _Acc(tol, self.policy.equal_nan)
        pick = {}
        for side, view, trace in (("r", r, self.ref), ("c", c, self.cand)):
            pick[side] = (view.sampled(name), view.state(name), trace)
        ds_s = pick["r"][0] if pick["r"][0] is not None else pick["c"][0]
        channels = np.asarray(ds_s.attrs["channels"])
        tok_source = self.ref if pick["r"][0] is not None else self.cand
        tok_index = tok_source.read(tok_source.f["sampled/token_index"])
        is_cache = name.startswith("cache_")
        for rs, cs in self.pairs:
            if is_cache and int(r.cache_lengths[rs]) != int(c.cache_lengths[cs]):
                continue  # the cache-length check reports this sample; its sampled slots do not line up
            s_side = rs if tok_source is self.ref else cs
            toks = tok_index[s_side]
            toks = toks[toks >= 0]
            rows = []
            for side, s in (("r", rs), ("c", cs)):
                samp, full, trace = pick[side]
                if samp is not None:
                    own = trace.read(trace.f["sampled/token_index"], (s,))
                    # residuals exist only for tokens this side computed (a reused prefix was not)
                    done = None if is_cache else set(trace.cells(s)[1].tolist())
                    slot = {int(t): j for j, t in enumerate(own) if t >= 0 and (done is None or int(t) in done)}
                    data = trace.read(samp, (s,))
                    rows.append({int(t): data[slot[int(t)]] for t in toks if int(t) in slot})
                elif full is not None:
                    cols, ctoks = trace.cells(s)
                    where = {int(t): int(cl) for t, cl in zip(ctoks, cols)}
                    data = trace.read(full, (s,))
                    rows.append({int(t): data[where[int(t)], channels] for t in toks if int(t) in where})
                else:
                    return TensorResult(name, "none", tol, note="no values in one trace")
            common = [t for t in toks if int(t) in rows[0] and int(t) in rows[1]]
            if common:
                a = np.stack([rows[0][int(t)] for t in common])
                b = np.stack([rows[1][int(t)] for t in common])
                acc.add(a, b, rs, np.asarray(common))
        return acc.result(name, "sampled", **self._pad_counts(r, c, name))

    def _calib_acc(self, heads=None) -> CalibAcc | None:
        return None if self.calib is None else CalibAcc(self.calib.factor, self.calib.floor, heads)

    def _calib_datasets(self, layer: int, name: str):
        """The golden's and the twin's dataset of one tensor (twin None: the reference is the twin)."""
        if self.calib is None:
            return None, None
        def get(t):
            v = t.layer(layer)
            ds = v.cache(name[len("cache_"):]) if name.startswith("cache_") else v.state(name)
            if ds is None:
                raise TraceError(f"{t.name}: layer {layer} has no full {name} (a calibrated comparison needs full "
                                 "golden and twin traces)")
            return ds
        return get(self.calib.golden), None if self.calib.twin is None else get(self.calib.twin)

    def _pad_counts(self, r: LayerView, c: LayerView, name: str) -> dict:
        """Non-finite counts in padding rows, from the statistics every level records."""
        rs_t, cs_t = r.stats(name), c.stats(name)
        if rs_t is None or cs_t is None:
            return {}
        cnt, fin = STAT_COLUMNS.index("pad_count"), STAT_COLUMNS.index("pad_finite")
        return {"pad_nonfinite_ref": int(sum(rs_t[a][cnt] - rs_t[a][fin] for a, _ in self.pairs)),
                "pad_nonfinite_cand": int(sum(cs_t[b][cnt] - cs_t[b][fin] for _, b in self.pairs))}

    def _stats(self, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
        """Statistics only: finite counts exactly, min/max/mean/rms within tolerance, checksums."""
        rs_t, cs_t = r.stats(name), c.stats(name)
        if rs_t is None or cs_t is None:
            self.skipped.add(f"{name}: not recorded in one trace")
            return TensorResult(name, "none", tol, note="not recorded in one trace")
        col = {k: i for i, k in enumerate(STAT_COLUMNS)}
        rchk, cchk = r.checksum(name), c.checksum(name)
        fin = np.zeros(2, dtype=np.int64)
        worst, max_abs, n_bad, min_atol, bad, identical, n = None, 0.0, 0, 0.0, {}, True, 0
        for rs, cs in self.pairs:
            a, b = rs_t[rs], cs_t[cs]
            if a[col["count"]] != b[col["count"]]:
                self.skipped.add(f"statistics of {name} cover different cells on the two sides; not compared")
                continue
            nf_r, nf_c = a[col["count"]] - a[col["finite"]], b[col["count"]] - b[col["finite"]]
            if nf_r != nf_c:
                fin += [int(max(nf_c - nf_r, 0)), int(max(nf_r - nf_c, 0))]  # statistics are float64
                bad.setdefault(rs, None)
            cnt = max(a[col["count"]], 1)
            ra = np.array([a[col["min"]], a[col["max"]], a[col["mean"]], a[col["l2"]] / np.sqrt(cnt)])
            ca = np.array([b[col["min"]], b[col["max"]], b[col["mean"]], b[col["l2"]] / np.sqrt(cnt)])
            n += 4
            with np.errstate(invalid="ignore"):
                d = np.abs(ca - ra)
            same = (ra == ca) | (np.isnan(ra) & np.isnan(ca))  # equal infinities, or NaN on both sides
            d = np.where(np.isfinite(d), d, np.where(same, 0.0, np.inf))  # a statistic finite on one side only
            scale = tol.ntol * ra[3] if np.isfinite(ra[3]) else 0.0  # ntol in units of the sample's RMS
            over = d > tol.atol + tol.rtol * np.abs(ra) + scale
            if over.any():
                n_bad += int(over.sum())
                bad.setdefault(rs, None)
            if d.max() > max_abs:
                max_abs, worst = float(d.max()), (rs, None, None)
            min_atol = max(min_atol, float((d - tol.rtol * np.abs(ra) - scale).max()))
            if rchk is not None and cchk is not None and rchk[rs] != cchk[cs]:
                identical = False
            pr, pc = a[col["pad_count"]] - a[col["pad_finite"]], b[col["pad_count"]] - b[col["pad_finite"]]
            if pr != pc:
                bad.setdefault(rs, None)
        if "stats" in (self.ref.level, self.cand.level):
            self.skipped.add("values compared as statistics only (stats level): max_abs is the largest statistic "
                             "error")
        else:  # e.g. full vs sampled cache: the sampled subset exists on one side only
            self.skipped.add(f"{name}: compared as statistics only (levels {self.ref.level} and {self.cand.level} "
                             "share no values of it): max_abs is the largest statistic error")
        return TensorResult(name, "stats", tol, compared=n, max_abs=max_abs, n_bad=n_bad,
                            worst=worst, min_atol=max(min_atol, 0.0), finite_ref_only=int(fin[1]),
                            finite_cand_only=int(fin[0]), **self._pad_counts(r, c, name),
                            bad_samples=tuple(sorted(bad)), bad_positions=dict(bad),
                            bit_identical=identical if rchk is not None else None, equal_nan=self.policy.equal_nan)

    # -- cache -----------------------------------------------------------------------------------
    def _cache(self, r: LayerView, c: LayerView):
        rl, cl = r.cache_lengths, c.cache_lengths
        rp, cp = r.cache_positions, c.cache_positions
        lengths_ok = positions_ok = True
        detail = sample = position = None
        bad_len, bad_pos = [], []
        for rs, cs in self.pairs:
            if rl[rs] != cl[cs]:
                bad_len.append(rs)
                if lengths_ok:
                    lengths_ok = False
                    T = int(min(rl[rs], cl[cs]))
                    first = next((t for t in range(T) if rp[rs, t] != cp[cs, t]), T)
                    sample, position = rs, first
                    detail = (f"sample {rs}: candidate holds {int(cl[cs])} tokens, reference {int(rl[rs])} "
                              f"(first differing slot {first})")
        if lengths_ok:
            for rs, cs in self.pairs:
                T = int(rl[rs])
                diff = np.flatnonzero(rp[rs, :T] != cp[cs, :T])
                if diff.size:
                    bad_pos.append(rs)
                    if positions_ok:
                        positions_ok = False
                        t = int(diff[0])
                        sample, position = rs, t
                        detail = (f"sample {rs}: slot {t} holds position {int(cp[cs, t])} in the candidate, "
                                  f"{int(rp[rs, t])} in the reference ({diff.size} of {T} slots differ)")
        res = CacheResult(lengths_ok, positions_ok, detail, sample, position, tuple(bad_len or bad_pos))
        tensors = {}
        for name in ("keys", "values"):
            tname = f"cache_{name}"
            tol = self._value_tol(tname, r.layer)
            rd, cd = r.cache(name), c.cache(name)
            if rd is None or cd is None:
                if r.sampled(tname) is not None or c.sampled(tname) is not None:
                    tensors[tname] = self._sampled_cache(r, c, tname, tol)
                else:
                    tensors[tname] = self._stats(r, c, tname, tol)
                continue
            if rd.shape[1] != cd.shape[1] or rd.shape[3] != cd.shape[3]:
                tensors[tname] = TensorResult(tname, "full", tol, shape_detail=(
                    f"cache {name}: n_kv_heads x head_dim {rd.shape[1]}x{rd.shape[3]} vs {cd.shape[1]}x{cd.shape[3]}"))
                continue
            acc = _Acc(tol, self.policy.equal_nan)
            cal = self._calib_acc()
            gd, td = self._calib_datasets(r.layer, tname)
            kv_bad = set()  # KV heads with values out of tolerance

            def read(pair, slot, rd=rd, cd=cd):
                rs, cs = pair
                return self.ref.read_row(rd, rs, f"ref{slot}"), self.cand.read_row(cd, cs, f"cand{slot}")

            def one(pair, rows, name=name, tol=tol, cal=cal, gd=gd, td=td):
                rs, cs = pair
                T = int(min(rl[rs], cl[cs]))
                a, b = rows[0][:, :T], rows[1][:, :T]
                if name == "keys":
                    a, b = self._post_rotation(a, rp[rs, :T], self.ref), self._post_rotation(b, cp[cs, :T], self.cand)
                H = a.shape[0]
                # one row per (KV head, slot): the d_h-vector attention reads
                rows = lambda x: np.ascontiguousarray(x).reshape(H * T, x.shape[-1])
                toks = np.tile(np.arange(T), H)
                if cal is not None:
                    g = self.calib.golden.read(gd, (rs,))[:, :T]
                    t = a if td is None else self.calib.twin.read(td, (rs,))[:, :T]
                    if name == "keys":  # golden and twin keep the reference's layout
                        g = self._post_rotation(g, rp[rs, :T], self.ref)
                        if td is not None:
                            t = self._post_rotation(t, rp[rs, :T], self.ref)
                    cal.add(rows(b), rows(t), rows(g), rs, toks, groups=np.repeat(np.arange(H), T))
                part = slab(rows(a), rows(b), tol, self.policy.equal_nan, rs, toks)
                if part.n_bad:  # rows are (KV head, slot), head-major: which heads hold the bad values
                    kv_bad.update(h for h in range(H) if slab(a[h], b[h], tol, self.policy.equal_nan, rs,
                                                              np.arange(T)).n_bad)
                return part

            for part in _prefetched(read, one, self.pairs):
                acc.p.merge(part)
            tensors[tname] = acc.result(tname, "full", kv_heads=tuple(sorted(kv_bad)),
                                        calib=None if cal is None else cal.result())
        return res, tensors

    def _sampled_cache(self, r, c, tname, tol):
        return self._sampled(r, c, tname, tol) if (r.sampled(tname) is not None and c.sampled(tname) is not None) \
            else self._stats(r, c, tname, tol)

    def _post_rotation(self, keys, positions, trace: Trace):
        other = self.cand if trace is self.ref else self.ref
        mine = trace.meta.get("layout", {}).get("key_rotation", "post")
        theirs = other.meta.get("layout", {}).get("key_rotation", "post")
        if mine == "pre" and theirs != "pre":
            inv = np.asarray(trace.model.get("rope_inv_freq"), dtype=np.float64)
            return rotate_keys(keys, positions, inv)
        return keys

    # -- final stage -------------------------------------------------------------------------------
    def final(self) -> FinalResult:
        rf, cf = self.ref.final, self.cand.final
        tensors = []
        calib = self.calib
        gf = None if calib is None else calib.golden.final
        tf = None if calib is None else (rf if calib.twin is None else calib.twin.final)
        for name in ("logits", "norm_last"):
            tol = self._value_tol(name)
            if rf[name].shape[1] != cf[name].shape[1]:
                tensors.append(TensorResult(name, "full", tol,
                                            shape_detail=f"{name} width {rf[name].shape[1]} vs {cf[name].shape[1]}"))
                continue
            acc = _Acc(tol, self.policy.equal_nan)
            cal = self._calib_acc()
            for rs, cs in self.pairs:
                last = np.array([int(self.ref.lengths[rs]) - 1])
                acc.add(rf[name][rs:rs + 1], cf[name][cs:cs + 1], rs, last)
                if cal is not None:
                    cal.add(cf[name][cs:cs + 1], tf[name][rs:rs + 1], gf[name][rs:rs + 1], rs, last)
            tensors.append(acc.result(name, "full", calib=None if cal is None else cal.result()))
        per_sample = tuple((rs, float(np.abs(cf["logits"][cs].astype(np.float64) - rf["logits"][rs]).max()))
                           for rs, cs in self.pairs)
        top_ok, top_detail, tops, gathers, top_samples = True, None, [], [], []
        tol = self.policy.tol("logits")
        k = min(self.policy.topk, rf["topk_ids"].shape[1], cf["topk_ids"].shape[1])
        for rs, cs in self.pairs:
            rz, cids = rf["logits"][rs].astype(np.float64), cf["topk_ids"][cs, :k]
            rms = float(np.sqrt(np.mean(rz * rz)))
            order = rf["topk_ids"][rs, :k]
            tops.append((rs, order.tolist(), cids.tolist()))
            last = int(self.ref.lengths[rs]) - 1
            gathers.append((rs, int(rf["gather_token"][rs]), int(cf["gather_token"][cs]), last))
            for rank in range(k):
                want = rz[order[rank]]
                got = rz[cids[rank]]
                if not got >= want - (tol.atol + tol.rtol * abs(want) + tol.ntol * rms):
                    top_samples.append(rs)
                    if top_ok:
                        top_ok = False
                        top_detail = (f"sample {rs}: rank {rank} is id {int(cids[rank])} in the candidate, "
                                      f"id {int(order[rank])} in the reference (reference logits {got:.4g} vs "
                                      f"{want:.4g}, beyond tolerance)")
                    break
        numerics = None if self.numerics is None else self.numerics.final()
        fb = None
        for t in tensors:
            if t.shape_detail:
                fb = Break("final", "shape", t.shape_detail, tensor=t.tensor)
                break
        if fb is None:
            for t in tensors:
                if not t.finite_ok:
                    fb = self._finite_break("final", None, t, numerics)
                    break
        if fb is None and numerics is not None and numerics.first_break is not None:
            fb = self._numerics_break(numerics.first_break)
        if fb is None:
            for t in tensors:
                if not t.values_ok:
                    fb = self._value_break("final", None, t)
                    break
        top_break = None if top_ok else Break("final", "top_ids", top_detail, tensor="topk_ids",
                                              sample=top_samples[0], samples=tuple(top_samples))
        if fb is None:
            fb = top_break
        breaks = tuple((t.tensor, self._tensor_break("final", None, t)) for t in tensors) + (("top ids", top_break),)
        return FinalResult(tuple(tensors), top_ok, top_detail, fb, tuple(tops), per_sample, tuple(gathers), breaks,
                           numerics)

    def _tensor_break(self, stage, layer, t: TensorResult) -> Break | None:
        """This tensor's own first problem (shape, then finite mask, then value), or None."""
        if t.shape_detail:
            return Break(stage, "shape", t.shape_detail, layer, t.tensor)
        if not t.finite_ok:
            return self._finite_break(stage, layer, t)
        return None if t.values_ok else self._value_break(stage, layer, t)


def _as_slice(idx: np.ndarray):
    """A contiguous ascending index array as a slice (a view, no copy); otherwise the array."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size < 2 or (np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _span(toks: np.ndarray) -> str:
    toks = sorted(int(t) for t in toks)
    if toks == list(range(toks[0], toks[-1] + 1)):
        return f"{toks[0]}..{toks[-1]}" if len(toks) > 1 else str(toks[0])
    return str(toks[:8])[:-1] + (", ...]" if len(toks) > 8 else "]")


def _same_layout(ref: Trace, other: Trace) -> None:
    """A golden or twin must be the reference's own path: the same samples, in the same cells."""
    if other.samples != ref.samples:
        raise TraceError(f"{other.name}: not a golden or twin of {ref.name} (its samples' token ids differ)")
    for s in range(ref.n_samples):
        a, b = ref.cells(s), other.cells(s)
        if not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])):
            raise TraceError(f"{other.name}: not a golden or twin of {ref.name} (sample {s} is laid out in other "
                             "cells: another batching, reuse or chunking)")


def _near_misses(ref: Trace, cand: Trace, ref_only, cand_only) -> str:
    """How each unmatched reference sample differs from the closest unmatched candidate sample, if any is close."""
    out = []
    for i in ref_only[:4]:
        r = ref.samples[i]
        best = None
        for j in cand_only:
            c = cand.samples[j]
            p = _common_prefix(r, c)
            q = _common_prefix(r[::-1], c[::-1])
            score = min(p + q, min(len(r), len(c)))
            if best is None or score > best[0]:
                best = (score, j, p, q)
        if best is None or best[0] == 0:
            continue
        _, j, p, q = best
        c = cand.samples[j]
        if len(c) == len(r) + 1 and c[1:] == r:
            out.append(f"candidate sample {j} equals reference sample {i} with one extra leading token {c[0]}")
        elif len(c) == len(r) + 1 and c[:-1] == r:
            out.append(f"candidate sample {j} equals reference sample {i} with one extra trailing token {c[-1]}")
        elif len(r) == len(c) + 1 and r[1:] == c:
            out.append(f"candidate sample {j} equals reference sample {i} without its leading token {r[0]}")
        elif len(r) == len(c) + 1 and r[:-1] == c:
            out.append(f"candidate sample {j} equals reference sample {i} without its trailing token {r[-1]}")
        else:
            out.append(f"reference sample {i} ({len(r)} tokens) and candidate sample {j} ({len(c)} tokens) share "
                       f"a prefix of {p} and a suffix of {q} tokens")
    return ("; " + "; ".join(out)) if out else ""


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
