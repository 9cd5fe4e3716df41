"""Bitwise agreement of two tensors: the share of elements whose bits are equal, and the largest distance in units
in the last place (ULP) of the dtype compared.

Values are read as the traces store them (bfloat16 widened to float32, exactly) and compared in the dtype both
sides computed in (``source_dtype``): equal bits there are equal bits here. The ULP distance between a and b is
the number of representable values of that dtype from one to the other (0 between +0 and -0, which are not
bitwise equal); a NaN against anything but the same NaN, or an infinity against a finite value, is an unbounded
distance (``math.inf``). When the two sides computed in different dtypes, no element can be called bitwise equal
by its bits alone: values that are exactly equal count as equal, and the distance is counted between the two
rounded to the coarser dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# bits of mantissa by dtype name: the spacing of values near x is 2**(exponent(x) - MANTISSA)
MANTISSA = {"float64": 52, "float32": 23, "bfloat16": 7, "float16": 10}
SLAB = 1 << 20  # elements per pass: slabs of a few MiB (a whole-array pass on 1 GiB is ten times slower)


@dataclass
class Bits:
    """How two tensors agree bit for bit (``add`` accumulates slabs)."""
    dtype: str = ""  # the dtype compared ("float32 vs bfloat16" when the sides differ)
    n: int = 0  # elements compared
    equal: int = 0  # of those, bitwise equal
    max_ulp: float = 0.0  # the largest distance, in ULPs of the compared dtype (inf: NaN or inf against a number)
    max_abs: float = 0.0
    first: int | None = None  # the flat index (within what was added) of the first element that differs

    @property
    def share(self) -> float:
        """The share of elements bitwise equal (1.0 when nothing was compared)."""
        return self.equal / self.n if self.n else 1.0

    @property
    def exact(self) -> bool:
        return self.equal == self.n

    def add(self, ref: np.ndarray, cand: np.ndarray, ref_dtype: str, cand_dtype: str) -> None:
        """Fold in the elements of two equally shaped arrays (as stored) computed in ``ref_dtype``/``cand_dtype``."""
        self.dtype = ref_dtype if ref_dtype == cand_dtype else f"{ref_dtype} vs {cand_dtype}"
        r, c = ref.reshape(-1), cand.reshape(-1)
        for a in range(0, r.size, SLAB):  # the distances only of the elements that differ
            rs, cs = r[a:a + SLAB], c[a:a + SLAB]
            eq = _equal(rs, cs, ref_dtype, cand_dtype)
            k = int(np.count_nonzero(eq))
            if k < eq.size:
                idx = np.flatnonzero(~eq)
                if self.first is None:
                    self.first = self.n + int(idx[0])
                rd, cd = rs[idx], cs[idx]
                self.max_ulp = max(self.max_ulp, float(_distance(rd, cd, ref_dtype, cand_dtype).max()))
                with np.errstate(invalid="ignore", over="ignore"):
                    d = np.abs(rd.astype(np.float64) - cd.astype(np.float64))
                d = d[np.isfinite(d)]
                if d.size:
                    self.max_abs = max(self.max_abs, float(d.max()))
            self.n += eq.size
            self.equal += k

    def merge(self, other: "Bits") -> None:
        """Fold in another tensor's figures (its ``first`` is not carried: indices are each one's own)."""
        self.dtype = other.dtype or self.dtype
        self.n, self.equal = self.n + other.n, self.equal + other.equal
        self.max_ulp, self.max_abs = max(self.max_ulp, other.max_ulp), max(self.max_abs, other.max_abs)

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "compared": self.n, "bitwise_equal": self.equal, "share_equal": self.share,
                "max_ulp": None if math.isinf(self.max_ulp) else int(self.max_ulp) if self.max_ulp.is_integer()
                else self.max_ulp, "max_ulp_unbounded": math.isinf(self.max_ulp), "max_abs": self.max_abs}

    def words(self) -> str:
        """'81.3% bitwise equal, max 3 ULP (bfloat16)'."""
        ulp = "an unbounded ULP distance (NaN or inf)" if math.isinf(self.max_ulp) else \
            f"max {self.max_ulp:.0f} ULP" if self.max_ulp.is_integer() else f"max {self.max_ulp:.3g} ULP"
        return f"{percent(self.share)} bitwise equal, {ulp} ({self.dtype})"


def percent(share: float) -> str:
    """A share as a percentage that never rounds a difference away: 99.97% is not '100.0%'."""
    if share >= 1.0:
        return "100%"
    v = 100.0 * share
    for digits in range(1, 9):  # as few decimals as keep it off 100% and 0%
        text = f"{v:.{digits}f}%"
        if float(text[:-1]) not in (0.0, 100.0) or share <= 0:
            return text
    return text


def ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude float bit patterns (as signed integers of ``width`` bits) mapped to integers that count
    representable values: consecutive floats differ by 1, +0 and -0 are both 0."""
    b = bits.astype(np.int64)
    mag = b & ((1 << (width - 1)) - 1)
    return np.where(b < 0, -mag, mag)


def _bits(x: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """The bit patterns of stored values in the dtype they were computed in, and their width."""
    if dtype == "bfloat16":  # stored as float32 exactly: the high 16 bits are the bfloat16
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.int32) >> 16), 16
    if dtype == "float16":
        return np.asarray(x, dtype=np.float16).view(np.int16), 16
    if dtype == "float64":
        return np.ascontiguousarray(x, dtype=np.float64).view(np.int64), 64
    return np.ascontiguousarray(x, dtype=np.float32).view(np.int32), 32


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values rounded to nearest (ties to even) in ``dtype``, held as _bits reads that dtype's stored values."""
    if dtype == "bfloat16":
        b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        return np.where(np.isnan(x), np.float32(np.nan), b.view(np.float32))
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return np.asarray(x, dtype=np.float16)
    return np.asarray(x, dtype=np.float64 if dtype == "float64" else np.float32)


def _equal(r: np.ndarray, c: np.ndarray, rd: str, cd: str) -> np.ndarray:
    """Per element: bitwise equal in the dtype both computed in (across dtypes: the same value, or both NaN)."""
    if rd == cd and rd in MANTISSA:
        return _bits(r, rd)[0] == _bits(c, cd)[0]
    with np.errstate(invalid="ignore"):
        return (r.astype(np.float64) == c.astype(np.float64)) | (np.isnan(r) & np.isnan(c))


def _distance(r: np.ndarray, c: np.ndarray, rd: str, cd: str) -> np.ndarray:
    """Per element of elements that are not equal: the ULP distance (inf where either is not finite)."""
    if rd == cd and rd in MANTISSA:
        (rb, width), (cb, _) = _bits(r, rd), _bits(c, cd)
    else:  # across dtypes: between both rounded to the coarser dtype
        coarse = min((rd, cd), key=lambda d: MANTISSA.get(d, 23))
        (rb, width), (cb, _) = _bits(_rounded(r, coarse), coarse), _bits(_rounded(c, coarse), coarse)
    oa, ob = ordered(rb, width), ordered(cb, width)
    if width == 64:  # across zero the distance may pass 2**63: those as floats, the rest exactly
        same = (oa >= 0) == (ob >= 0)
        dist = np.where(same, np.abs(np.where(same, oa - ob, 0)).astype(np.float64),
                        np.abs(oa).astype(np.float64) + np.abs(ob).astype(np.float64))
    else:
        dist = np.abs(oa - ob).astype(np.float64)
    return np.where(np.isfinite(r) & np.isfinite(c), dist, np.inf)


def compare(ref: np.ndarray, cand: np.ndarray, ref_dtype: str, cand_dtype: str) -> Bits:
    """``Bits`` of two equally shaped arrays."""
    b = Bits()
    b.add(ref, cand, ref_dtype, cand_dtype)
    return b
