"""A KV cache's layout as every engine and the trace name it (plain data, no torch): its kind, what it stores, how
keys are rotated, its page size. The trace's ``layout`` section is its ``as_dict()``; our engine builds its cache on
it (engine/native/kv_cache.py), a foreign engine describes its own cache with it."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..shared.errors import ConfigError, did_you_mean
from ..shared.precisions import CACHE_DTYPES, DTYPE_ALIASES, FP8_DTYPES, INT8_SCALES

CACHE_KINDS = ("contiguous", "paged")
LAYOUT_VERSION = 1


def one_of(name: str, value, allowed) -> None:
    """Refuse ``value`` unless it is one of ``allowed``, naming them and the closest."""
    if value not in allowed:
        near = DTYPE_ALIASES.get(value) if isinstance(value, str) and DTYPE_ALIASES.get(value) in allowed else None
        hint = f"; did you mean {near}?" if near else did_you_mean(value, allowed, "; did you mean {}?")
        raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {value!r}{hint})")


@dataclass(frozen=True)
class CacheLayout:
    kind: str = "contiguous"
    dtype: str | None = None  # storage dtype; None = the activation dtype
    key_rotation: str = "post"  # "post": keys after RoPE (as attention used them); "pre": rotated on read
    page_size: int = 16
    int8_scales: str = "per-token"  # or "per-head" (one scale per head and write)
    version: int = LAYOUT_VERSION

    def __post_init__(self):
        one_of("kind", self.kind, CACHE_KINDS)
        if self.dtype is not None:
            one_of("dtype", self.dtype, CACHE_DTYPES)
        if self.key_rotation not in ("post", "pre"):
            raise ConfigError(f"key_rotation must be 'post' or 'pre' (got {self.key_rotation!r})")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page_size must be a positive integer (got {self.page_size!r})")
        if self.int8_scales not in INT8_SCALES:
            raise ConfigError(f"int8_scales must be 'per-token' or 'per-head' (got {self.int8_scales!r})")

    def resolved(self, act_dtype: str) -> "CacheLayout":
        return self if self.dtype else CacheLayout(**{**asdict(self), "dtype": act_dtype})

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def plain(self) -> bool:
        """True when the cache holds exactly what attention used, contiguously (no read-through needed)."""
        return self.kind == "contiguous" and self.key_rotation == "post" and self.dtype not in ("int8", *FP8_DTYPES)
