"""Our engine's settings as plain data, with no torch: the numerics (``NumericalConfig``), the KV layout
(``CacheLayout``, ``CacheConfig``). The model's shape is the shared vocabulary of engine/models/args.py.

A config file is checked against these (engine/config.py) before anything imports torch, so a typo or a bad
value is answered at once; ``prefill.py`` and ``kv_cache.py`` build on them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..shared.errors import ConfigError, did_you_mean
from ..shared.precisions import ACT_DTYPES, CACHE_DTYPES, DTYPE_ALIASES, FP8_DTYPES

KERNELS = ("eager", "sdpa", "tiled")  # attention.py's kernels
WEIGHT_QUANTS = ("none", "int8")
CACHE_KINDS = ("contiguous", "paged")
LAYOUT_VERSION = 1


def _one_of(name: str, value, allowed) -> None:
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
        _one_of("kind", self.kind, CACHE_KINDS)
        if self.dtype is not None:
            _one_of("dtype", self.dtype, CACHE_DTYPES)
        if self.key_rotation not in ("post", "pre"):
            raise ConfigError(f"key_rotation must be 'post' or 'pre' (got {self.key_rotation!r})")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page_size must be a positive integer (got {self.page_size!r})")
        if self.int8_scales not in ("per-token", "per-head"):
            raise ConfigError(f"int8_scales must be 'per-token' or 'per-head' (got {self.int8_scales!r})")

    def resolved(self, act_dtype: str) -> "CacheLayout":
        return self if self.dtype else CacheLayout(**{**asdict(self), "dtype": act_dtype})

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def plain(self) -> bool:
        """True when the cache holds exactly what attention used, contiguously (no read-through needed)."""
        return self.kind == "contiguous" and self.key_rotation == "post" and self.dtype not in ("int8", *FP8_DTYPES)


@dataclass(frozen=True)
class NumericalConfig:
    """Precision of weights and activations, the attention kernel, determinism."""
    dtype: str = "float32"
    kernel: str = "eager"
    block_size: int = 16
    weight_quant: str = "none"
    deterministic: bool = True
    training: bool = False
    dropout_seed: int | None = None
    compile: bool = False  # torch.compile (inductor) each layer's norms and MLP (engine/native/compiled.py)

    def __post_init__(self):
        _one_of("dtype", self.dtype, ACT_DTYPES)
        _one_of("kernel", self.kernel, KERNELS)
        _one_of("weight_quant", self.weight_quant, WEIGHT_QUANTS)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be a positive integer (got {self.block_size!r})")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be true or false (got {self.compile!r})")


@dataclass(frozen=True)
class CacheConfig:
    """KV layout and how the prompt is fed: whole, or in chunks against the growing cache."""
    layout: CacheLayout = CacheLayout()
    chunk_size: int = 0  # 0: the whole prompt in one forward
    invariants: str = "raise"  # "raise" or "record" (recording runs keep going so the diff can localise)

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or self.chunk_size < 0:
            raise ConfigError(f"chunk_size must be a non-negative integer (got {self.chunk_size!r})")
        if self.invariants not in ("raise", "record"):
            raise ConfigError(f"invariants must be 'raise' or 'record' (got {self.invariants!r})")
