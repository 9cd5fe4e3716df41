"""Tolerance policy: atol/rtol/ntol/row_rtol per tensor kind, with defaults that follow the compared dtypes.

A row is the vector at one (sample, position): d values of a residual state, H_kv·d_h of a
cache entry, the |V| logits of a sample. An element passes when

    |cand - ref| <= atol + rtol·|ref| + ntol·rms(ref row)

torch.testing.assert_close's rule (reference on the right) plus a term scaled by the RMS of
its row: rounding error in a matmul or a norm is proportional to the size of the vectors
involved, not to one output element, so on real models with massive activations (a channel
at 1e4 beside channels at 1) small elements carry errors set by their row. Low-precision
policies also accept a whole row whose relative L2 error ||cand - ref|| / ||ref|| is at most
row_rtol (0 disables this): bf16 drift on a 30-layer model reaches ~16% of a row's norm while
the §2.11 faults move rows by 66% to several times their norm. The defaults were measured on
this project's presets and on SmolLM2-135M (docs/tolerances.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..dumps.schema import TOL_FIELDS, TOL_KIND, TOL_KINDS
from ..engine.shared.errors import ConfigError
from ..engine.shared.precisions import DTYPE_ALIASES, PRECISION_ORDER

# (atol, rtol, ntol, row_rtol) for every kind, per dtype.
DTYPE_DEFAULTS = {
    "float64": (1e-12, 1e-9, 1e-9, 0.0),
    "float32": (1e-6, 1e-5, 5e-4, 0.0),
    "float16": (1e-3, 1e-2, 5e-2, 0.1),
    "bfloat16": (1e-2, 2e-2, 2e-1, 0.35),
    "int8": (1e-2, 2e-2, 2e-1, 0.35),
    # an fp8 KV cache (vLLM's, or ours as its twin): rows measured up to 27% (e4m3) and 51% (e5m2) of their norm
    # on SmolLM2 (docs/tolerances.md)
    "fp8_e4m3": (1e-2, 2e-2, 2e-1, 0.4),
    "fp8_e5m2": (1e-2, 2e-2, 2e-1, 0.6),
}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    ntol: float = 0.0  # times the RMS of the reference row (the vector at one sample and position)
    row_rtol: float = 0.0  # a row with ||cand - ref|| <= row_rtol·||ref|| passes whole; 0: off

    def __post_init__(self):
        for name in TOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ConfigError(f"{name} must be a non-negative number (got {name}={v!r})")


@dataclass(frozen=True)
class Policy:
    name: str
    kinds: dict = field(default_factory=dict)  # kind -> Tolerance
    equal_nan: bool = False  # NaN == NaN at the same place counts as agreement
    topk: int = 5
    calibration: dict | None = None  # a calibrated comparison's rule (verify/calibrate.py), None: fixed rule
    sources: dict = field(default_factory=dict)  # term (atol, rtol, ntol, row_rtol) -> where its value came from

    def tol(self, tensor: str, layer: int | None = None) -> Tolerance:
        return self.kinds[TOL_KIND.get(tensor, "residual")]

    def as_dict(self) -> dict:
        d = {"name": self.name, "equal_nan": self.equal_nan, "topk": self.topk,
             "kinds": {k: asdict(v) for k, v in self.kinds.items()}, "sources": dict(self.sources),
             "calibration": self.calibration}
        return d

    def rule(self) -> str:
        """The effective element rule in words, each term with where it came from (the report's header)."""
        t = self.kinds["residual"]
        one = {self.sources.get(k) for k in TOL_FIELDS}
        shared = one.pop() if len(one) == 1 else None
        src = lambda k: f" ({self.sources[k]})" if self.sources.get(k) and shared is None else ""
        parts = [f"atol {t.atol:g}{src('atol')}", f"rtol {t.rtol:g}{src('rtol')}"]
        parts.append(f"ntol {t.ntol:g}{src('ntol')}" if t.ntol else f"ntol off{src('ntol')}")
        parts.append(f"row_rtol {t.row_rtol:g}{src('row_rtol')}" if t.row_rtol else f"row_rtol off{src('row_rtol')}")
        same = all(v == t for v in self.kinds.values())
        return (", ".join(parts) + (f", all {shared}" if shared else "")
                + ("" if same else "; residual shown, other kinds differ (JSON report)"))

    def with_overrides(self, kinds: dict | None = None, **kw) -> "Policy":
        """Override fields (atol=, rtol=, ntol=, row_rtol=) for every kind, then per kind; other kw: Policy fields."""
        every = {k: kw.pop(k) for k in TOL_FIELDS if kw.get(k) is not None}
        for k in TOL_FIELDS:
            kw.pop(k, None)
        new = {k: replace(t, **every) for k, t in self.kinds.items()}
        for k, v in (kinds or {}).items():
            if k not in TOL_KINDS:
                raise ConfigError(f"tolerance kind must be one of {', '.join(TOL_KINDS)} (got {k!r})")
            new[k] = replace(new[k], **v)
        changed = bool(every or kinds) and not self.name.endswith("+overrides")
        return replace(self, kinds=new, name=self.name + "+overrides" if changed else self.name, **kw)


# Other names a policy may be given by: a dtype's short name of letters and bits (`--policy bf16`, as the preset is
# named; not C's words, half or double) and the int8 presets' names.
POLICY_ALIASES = {**{a: d for a, d in DTYPE_ALIASES.items() if a[-2:].isdigit()}, "w8": "int8", "kv-int8": "int8"}


def dtype_policy(dtype: str) -> Policy:
    dtype = POLICY_ALIASES.get(dtype, dtype)
    if dtype not in DTYPE_DEFAULTS:
        raise ConfigError(f"policy must be one of {', '.join(DTYPE_DEFAULTS)} or an alias "
                          f"{', '.join(POLICY_ALIASES)} (got {dtype!r})")
    return Policy(dtype, {k: Tolerance(*DTYPE_DEFAULTS[dtype]) for k in TOL_KINDS})


def coarsest(*dtypes: str) -> str:
    """The least precise of the known dtypes (a comparison's policy is its least precise side's); else float32."""
    known = [d for d in dtypes if d in PRECISION_ORDER]
    return min(known, key=PRECISION_ORDER.index) if known else "float32"


def default_policy(ref_meta: dict, cand_meta: dict) -> Policy:
    """The policy of the least precise side: activations for states, the cache dtype for K/V."""
    def dtypes(meta):
        eng = meta.get("engine", {})
        return eng.get("dtype", "float32"), meta.get("layout", {}).get("dtype") or eng.get("dtype", "float32")
    (ra, rc), (ca, cc) = dtypes(ref_meta), dtypes(cand_meta)
    act = dtype_policy(coarsest(ra, ca))
    cache = dtype_policy(coarsest(rc, cc, ra, ca))
    quant = any(m.get("record", {}).get("quantized_weights_digest") for m in (ref_meta, cand_meta))
    if quant:  # weight-only int8 is as coarse as int8 everywhere
        act = dtype_policy("int8")
        cache = act
    kinds = dict(act.kinds)
    kinds["cache_keys"], kinds["cache_values"] = cache.kinds["cache_keys"], cache.kinds["cache_values"]
    if cache.name != act.name and PRECISION_ORDER.index(cache.name) < PRECISION_ORDER.index(act.name):
        # attention reads the coarser cache, so everything downstream of it inherits its error
        kinds = dict(cache.kinds)
    name = act.name if cache.name == act.name else f"{act.name} (cache {cache.name})"
    return Policy(name, kinds, sources={k: f"{name} default" for k in TOL_FIELDS})
