"""Tolerance policy: atol/rtol per tensor kind, with defaults that follow the compared dtypes.

An element passes when |cand - ref| <= atol + rtol·|ref| (torch.testing.assert_close's
rule, with the reference on the right). The defaults are torch's per-dtype values
widened for a whole prefill, where error accumulates over layers and reductions:
they were measured on this project's presets (docs/tolerances.md) and are the
smallest round values under which every non-fault preset passes on the built-in
models, while every fault still breaks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine.errors import ConfigError

KINDS = ("residual", "attn_update", "mlp_update", "cache_keys", "cache_values", "logits")

# tensor name -> tolerance kind
KIND_OF = {"layer_input": "residual", "mid": "residual", "layer_output": "residual", "norm_last": "residual",
           "attn_update": "attn_update", "attn_heads": "attn_update", "mlp_update": "mlp_update",
           "cache_keys": "cache_keys", "cache_values": "cache_values", "logits": "logits"}

# Coarsest first: the policy of a comparison is that of its least precise side.
DTYPE_ORDER = ("int8", "float16", "bfloat16", "float32", "float64")

# (atol, rtol) for every kind, per dtype.
DTYPE_DEFAULTS = {
    "float64": (1e-9, 1e-7),
    "float32": (1e-4, 1e-4),
    "bfloat16": (1.5e-1, 6e-2),
    "float16": (2e-2, 1e-2),
    "int8": (1.5e-1, 6e-2),
}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def __post_init__(self):
        for name in ("atol", "rtol"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ConfigError(f"{name} must be a non-negative number (got {name}={v!r})")


@dataclass(frozen=True)
class Policy:
    name: str
    kinds: dict = field(default_factory=dict)  # kind -> Tolerance
    equal_nan: bool = False  # NaN == NaN at the same place counts as agreement
    topk: int = 5
    per_layer: dict = field(default_factory=dict)  # (layer, tensor) -> atol floor, from --calibrate
    calibration: dict | None = None  # how per_layer was measured

    def tol(self, tensor: str, layer: int | None = None) -> Tolerance:
        t = self.kinds[KIND_OF.get(tensor, "residual")]
        floor = self.per_layer.get((layer, tensor))
        return t if floor is None or floor <= t.atol else Tolerance(floor, t.rtol)

    def as_dict(self) -> dict:
        d = {"name": self.name, "equal_nan": self.equal_nan, "topk": self.topk,
             "kinds": {k: {"atol": v.atol, "rtol": v.rtol} for k, v in self.kinds.items()}}
        if self.calibration:
            d["calibration"] = {**self.calibration, "atol": [
                {"layer": layer, "tensor": t, "atol": a} for (layer, t), a in sorted(
                    self.per_layer.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1]))]}
        return d

    def with_overrides(self, atol=None, rtol=None, kinds: dict | None = None, **kw) -> "Policy":
        new = dict(self.kinds)
        for k in new:
            t = new[k]
            new[k] = Tolerance(t.atol if atol is None else atol, t.rtol if rtol is None else rtol)
        for k, v in (kinds or {}).items():
            if k not in KINDS:
                raise ConfigError(f"tolerance kind must be one of {', '.join(KINDS)} (got {k!r})")
            new[k] = Tolerance(v.get("atol", new[k].atol), v.get("rtol", new[k].rtol))
        name = self.name if atol is None and rtol is None and not kinds else self.name + "+overrides"
        return replace(self, kinds=new, name=name, **kw)


def dtype_policy(dtype: str) -> Policy:
    if dtype not in DTYPE_DEFAULTS:
        raise ConfigError(f"policy must be one of {', '.join(DTYPE_DEFAULTS)} (got {dtype!r})")
    atol, rtol = DTYPE_DEFAULTS[dtype]
    return Policy(dtype, {k: Tolerance(atol, rtol) for k in KINDS})


def coarsest(*dtypes: str) -> str:
    known = [d for d in dtypes if d in DTYPE_ORDER]
    return min(known, key=DTYPE_ORDER.index) if known else "float32"


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
    if cache.name != act.name and DTYPE_ORDER.index(cache.name) < DTYPE_ORDER.index(act.name):
        # attention reads the coarser cache, so everything downstream of it inherits its error
        kinds = dict(cache.kinds)
    name = act.name if cache.name == act.name else f"{act.name} (cache {cache.name})"
    return Policy(name, kinds)
