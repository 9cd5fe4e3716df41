"""The calibrated verdict: a candidate may carry at most K times the error its precision explains.

torch._dynamo's accuracy check compares a low-precision result with a float64 golden run and allows it a
multiple of the error a same-precision run of the trusted path makes. We do the same per layer, tensor and
row (one sample and position), with three extra traces of the *reference's* execution path:

    golden  the reference's path in float64, nothing quantised;
    twin    the reference's path at the candidate's precisions (weight/activation dtype, weight
            quantisation, KV-cache dtype). Kernels, batching, reuse, chunking and paging are never copied
            into the twin: they are what the user is testing. When the precisions are the same on both
            sides, the twin is the reference itself.

Two checks, both must hold:

    (1) the change adds no error beyond its numerics: for every row,
            e_c <= K · noise + u,   e_c = ||cand - golden|| / ||golden||,
            noise = max(e_t, median of e_t over the tensor's rows),  e_t = ||twin - golden|| / ||golden||,
        u the unit roundoff of the candidate's coarsest precision (a floor for rows the twin gets exact);
    (2) the numerics themselves are acceptable: the twin against the reference within the fixed per-dtype
        envelope (verify/tolerance.py).

The median keeps one lucky twin row (an error far below its neighbours') from making an honest candidate
row look K times worse. Structural checks (shapes, finite masks, cache lengths and positions) always
compare the candidate with the reference directly and exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..engine.shared.precisions import ACT_DTYPES

# unit roundoff (half an ulp at 1) of each precision; int8 counts as 1/254 of the scale's range
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "int8": 2.0 ** -8, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
DEFAULT_FACTOR = 4.0
PRECISION_KEYS = ("dtype", "weight_quant", "cache_dtype", "int8_scales")


def precisions(meta: dict) -> dict:
    """A trace's precisions from its metadata: dtype, weight quantisation, KV-cache dtype, int8 scales."""
    eng = meta.get("engine") if isinstance(meta.get("engine"), dict) else {}
    dtype = str(eng.get("dtype") or "float32")
    side = meta.get("side") if isinstance(meta.get("side"), dict) else {}
    run = side.get("run") if isinstance(side.get("run"), dict) else {}
    # the run's weight quantisation: at the top of the recorded run (format 1.3), under numerical before
    num = run.get("numerical") if isinstance(run.get("numerical"), dict) else run
    rec = meta.get("record") if isinstance(meta.get("record"), dict) else {}
    # a foreign engine names its weights' quantisation in engine.weight_quant (llama.cpp: the GGUF's type, e.g.
    # Q4_1) while its run config says "none": the trace's own word wins
    wq = eng.get("weight_quant") or (num.get("weight_quant") if num.get("weight_quant") not in (None, "none")
                                     else None)
    if not wq:
        wq = "int8" if rec.get("quantized_weights_digest") else "none"
    lay = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
    cache = str(lay.get("dtype") or dtype)
    return {"dtype": dtype, "weight_quant": str(wq), "cache_dtype": cache,
            "int8_scales": lay.get("int8_scales", "per-token") if cache == "int8" else None}


def below_float32(p: dict) -> bool:
    """A side that computes below float32 anywhere: 16-bit weights or activations, quantised weights, or a KV
    cache stored below float32 (its verdict is calibrated by default, even against a side of its own precisions)."""
    return (UNIT_ROUNDOFF.get(p.get("dtype"), 1.0) > UNIT_ROUNDOFF["float32"]
            or p.get("weight_quant") not in (None, "none")
            or UNIT_ROUNDOFF.get(p.get("cache_dtype") or p.get("dtype"), 1.0) > UNIT_ROUNDOFF["float32"])


def same_precisions(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in PRECISION_KEYS)


def precision_label(p: dict) -> str:
    """e.g. 'bfloat16', 'float32 with int8 weights', 'float32 with an int8 KV cache'."""
    extra = []
    if p.get("weight_quant") not in (None, "none"):
        extra.append(f"{p['weight_quant']} weights")
    if p.get("cache_dtype") not in (None, p.get("dtype")):
        extra.append(f"{'an' if str(p['cache_dtype']).startswith(('a', 'e', 'i', 'o', 'u', 'fp')) else 'a'} "
                     f"{p['cache_dtype']} KV cache")
    return p.get("dtype", "?") + (" with " + " and ".join(extra) if extra else "")


def precision_key(p: dict) -> str:
    """A file-name-safe key, e.g. 'bfloat16', 'float32-wint8', 'float32-kvint8'."""
    key = p["dtype"]
    if p.get("weight_quant") not in (None, "none"):
        key += f"-w{p['weight_quant']}"
    if p.get("cache_dtype") not in (None, p["dtype"]):
        key += f"-kv{p['cache_dtype']}"
        if p.get("int8_scales") == "per-head":
            key += "-perhead"
    return key


def parse_precision_key(key: str) -> dict | None:
    """The precisions a ``precision_key`` names ('bfloat16', 'float32-wint8', 'float32-kvint8-perhead'), or None
    when ``key`` is not one."""
    dtype, *rest = key.split("-")
    if dtype not in ACT_DTYPES:
        return None
    prec = {"dtype": dtype, "weight_quant": "none", "cache_dtype": dtype, "int8_scales": None}
    for part in rest:
        if part.startswith("w") and part[1:] == "int8":
            prec["weight_quant"] = "int8"
        elif part.startswith("kv") and part[2:] in UNIT_ROUNDOFF:
            prec["cache_dtype"] = part[2:]
            prec["int8_scales"] = "per-token" if part[2:] == "int8" else None
        elif part == "perhead" and prec["cache_dtype"] == "int8":
            prec["int8_scales"] = "per-head"
        else:
            return None
    return prec


def unit_roundoff(p: dict) -> float:
    """The coarsest unit roundoff among the precisions (the floor of check (1))."""
    names = [p.get("dtype"), p.get("cache_dtype"), "int8" if p.get("weight_quant") not in (None, "none") else None]
    return max(UNIT_ROUNDOFF.get(n, UNIT_ROUNDOFF["int8"]) for n in names if n)


def sibling_paths(baseline: str) -> tuple[str, str]:
    """Where `record --twin-of` keeps a baseline's golden and twins: BASE.golden.h5, BASE.twin-KEY.h5."""
    stem = baseline[:-3] if baseline.endswith(".h5") else baseline
    return stem + ".golden.h5", stem + ".twin-{key}.h5"


@dataclass(frozen=True)
class Calibration:
    """The extra traces of a calibrated comparison and its rule. ``twin`` None: the reference is the twin."""
    golden: object  # dumps.reader.Trace
    twin: object | None
    factor: float = DEFAULT_FACTOR
    floor: float = UNIT_ROUNDOFF["float32"]
    label: str = "float32"  # the twin's precisions, in words
    maker: str | None = None  # the engine that ran the golden and twin when it is not the reference's own
    maker_words: str = ""  # that engine as the reports name it ("our engine", "the vllm engine")

    def describe(self) -> dict:
        return {"factor": self.factor, "floor": self.floor, "golden": "float64", "maker": self.maker,
                "twin": "the reference itself" if self.twin is None else f"reference path in {self.label}",
                "precision": self.label,
                "golden_file": getattr(self.golden, "name", None),
                "twin_file": None if self.twin is None else getattr(self.twin, "name", None)}


@dataclass(frozen=True)
class CalibResult:
    """Check (1) for one tensor at one layer: the candidate's row errors against K x the twin's noise."""
    factor: float
    floor: float
    rows: int = 0
    bad_rows: int = 0
    max_ratio: float = 0.0  # e_c / noise at the worst row
    cand_error: float = 0.0  # e_c at the worst row
    noise: float = 0.0  # the twin's noise at the worst row (max of its own and the tensor's median)
    allowed: float = 0.0  # K·noise + floor at the worst row
    median_noise: float = 0.0
    max_cand_error: float = 0.0
    min_factor: float = 0.0  # the smallest K under which every row passes
    worst: tuple | None = None  # (sample, position)
    bad_samples: tuple = ()
    bad_positions: dict = field(default_factory=dict)
    heads: tuple | None = None  # attn_heads: query heads whose rows break
    groups: tuple | None = None  # cache: KV heads whose rows break

    def __bool__(self) -> bool:
        return self.bad_rows == 0

    def as_dict(self) -> dict:
        num = lambda x: float(x) if np.isfinite(x) else ("inf" if x > 0 else "nan")
        return {"passed": bool(self), "factor": self.factor, "floor": self.floor, "rows": self.rows,
                "bad_rows": self.bad_rows, "max_ratio": num(self.max_ratio), "cand_error": num(self.cand_error),
                "noise": num(self.noise), "allowed": num(self.allowed), "median_noise": num(self.median_noise),
                "max_cand_error": num(self.max_cand_error), "min_factor": num(self.min_factor),
                "worst": list(self.worst) if self.worst else None,
                "heads": list(self.heads) if self.heads is not None else None}


def row_norms(a: np.ndarray) -> np.ndarray:
    """||a_i|| per row, in float64."""
    a64 = a.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.sqrt(np.einsum("ij,ij->i", a64, a64))


def rel_row_errors(x: np.ndarray, g: np.ndarray, g_norms: np.ndarray | None = None) -> np.ndarray:
    """||x - g|| / ||g|| per row, in float64; a row whose golden is all zero gets the absolute norm.
    ``g_norms``: row_norms(g), when the caller has it already."""
    d = row_norms(x.astype(np.float64, copy=False) - g.astype(np.float64, copy=False))
    n = row_norms(g) if g_norms is None else g_norms
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.where(n > 0, d / np.where(n > 0, n, 1.0), d)
    return np.where(np.isnan(out), np.inf, out)  # a non-finite candidate row is never within any noise


class CalibAcc:
    """Collects per-row errors of one tensor at one layer over every aligned sample, then judges them."""

    def __init__(self, factor: float, floor: float, n_heads: int | None = None):
        self.factor, self.floor, self.n_heads = factor, floor, n_heads
        self.e_c, self.e_t, self.sample, self.tok = [], [], [], []
        self.h_c, self.h_t = [], []
        self.groups = []

    def add(self, c: np.ndarray, t: np.ndarray, g: np.ndarray, sample: int, toks: np.ndarray,
            groups: np.ndarray | None = None) -> None:
        """c, t, g: aligned rows (T, W) of candidate, twin and golden; toks: their positions; groups: the KV
        head of each row (cache tensors)."""
        if c.shape[0] == 0:
            return
        if groups is not None:
            self.groups.append(np.asarray(groups))
        gn = row_norms(g)
        self.e_c.append(rel_row_errors(c, g, gn))
        et = rel_row_errors(t, g, gn)
        self.e_t.append(np.where(np.isinf(et), np.inf, et))
        self.sample.append(np.full(c.shape[0], sample))
        self.tok.append(np.asarray(toks))
        if self.n_heads:
            H = self.n_heads
            split = lambda x: x.reshape(x.shape[0] * H, -1)  # (T·H, d_h): one row per (position, head)
            hn = row_norms(split(g))
            self.h_c.append(rel_row_errors(split(c), split(g), hn).reshape(-1, H))
            self.h_t.append(rel_row_errors(split(t), split(g), hn).reshape(-1, H))

    def result(self) -> CalibResult:
        K, u = self.factor, self.floor
        if not self.e_c:
            return CalibResult(K, u)
        e_c, e_t = np.concatenate(self.e_c), np.concatenate(self.e_t)
        samples, toks = np.concatenate(self.sample), np.concatenate(self.tok)
        finite_t = e_t[np.isfinite(e_t)]
        median = float(np.median(finite_t)) if finite_t.size else 0.0
        noise = np.maximum(e_t, median)
        allowed = K * noise + u
        bad = ~(e_c <= allowed)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(e_c > 0, e_c / noise, 0.0)  # noise 0 and e_c > 0: inf
            over = e_c / allowed
            need = np.where(e_c > u, (e_c - u) / noise, 0.0)
        need = np.where(np.isnan(need), np.inf, need)
        w = int(np.nanargmax(np.where(np.isnan(over), np.inf, over)))
        bad_pos = {}
        for s, t in zip(samples[bad], toks[bad]):
            bad_pos.setdefault(int(s), int(t))
        heads = None
        if self.n_heads and self.h_c:
            hc, ht = np.concatenate(self.h_c), np.concatenate(self.h_t)
            fin = ht[np.isfinite(ht)]
            hmed = float(np.median(fin)) if fin.size else 0.0
            hbad = ~(hc <= K * np.maximum(ht, hmed) + u)
            heads = tuple(int(h) for h in np.flatnonzero(hbad.any(axis=0)))
        groups = None
        if self.groups and len(self.groups) == len(self.e_c):
            groups = tuple(int(x) for x in np.unique(np.concatenate(self.groups)[bad]))
        return CalibResult(K, u, rows=int(e_c.size), groups=groups, bad_rows=int(bad.sum()), max_ratio=float(ratio[w]),
                           cand_error=float(e_c[w]), noise=float(noise[w]), allowed=float(allowed[w]),
                           median_noise=median, max_cand_error=float(np.max(e_c)),
                           min_factor=float(np.max(need)), worst=(int(samples[w]), int(toks[w])),
                           bad_samples=tuple(sorted(bad_pos)), bad_positions=bad_pos, heads=heads)
