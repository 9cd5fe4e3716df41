"""Our engine's settings as plain data, with no torch: its options (``NativeOptions``, the table ``[run.native]``)
and what it builds from them and a run's neutral settings — the numerics (``NumericalConfig``) and the KV cache
(``CacheConfig``), the contract's ``numerical_config`` and ``cache_config``. The model's shape is the shared
vocabulary of engine/models/args.py, the layout's engine/models/cache_layout.py.

A config file is checked against these (engine/config.py) before anything imports torch, so a typo or a bad
value is answered at once; ``prefill.py`` and ``kv_cache.py`` build on them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError
from ..shared.precisions import ACT_DTYPES, WEIGHT_QUANTS
from ..models.cache_layout import CACHE_KINDS, CacheLayout, one_of

KERNELS = ("eager", "sdpa", "tiled")  # attention.py's kernels


@dataclass(frozen=True)
class NativeOptions:
    """[run.native]: our engine's own settings — the attention kernel, training mode, compilation and its KV
    cache's layout (the cache's dtype is the run's, [cache] dtype)."""
    kernel: str = "eager"
    block_size: int = 16  # the tiled kernel's block
    training: bool = False
    dropout_seed: int | None = None
    compile: bool = False  # torch.compile (inductor) each layer's norms and MLP (engine/native/compiled.py)
    cache_kind: str = "contiguous"  # contiguous | paged
    page_size: int = 16
    key_rotation: str = "post"  # post: keys after RoPE; pre: the cache rotates them on read
    invariants: str = "record"  # the cache invariants broken: "record" them and go on, or "raise"

    def __post_init__(self):
        one_of("kernel", self.kernel, KERNELS)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be a positive integer (got {self.block_size!r})")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be true or false (got {self.compile!r})")
        one_of("cache_kind", self.cache_kind, CACHE_KINDS)
        if self.invariants not in ("raise", "record"):
            raise ConfigError(f"invariants must be 'raise' or 'record' (got {self.invariants!r})")
        self.layout_fields()  # the layout's own checks (page_size, key_rotation)

    def layout_fields(self) -> dict:
        """The cache layout these options choose (engine/models/cache_layout.py's fields)."""
        lay = CacheLayout(kind=self.cache_kind, key_rotation=self.key_rotation, page_size=self.page_size)
        return {"kind": lay.kind, "key_rotation": lay.key_rotation, "page_size": lay.page_size}


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
        one_of("dtype", self.dtype, ACT_DTYPES)
        one_of("kernel", self.kernel, KERNELS)
        one_of("weight_quant", self.weight_quant, WEIGHT_QUANTS)
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


def numerical_config(run) -> NumericalConfig:
    """The numerics our engine runs a RunConfig (engine/config.py) with: its precisions and our options."""
    o = run.options
    return NumericalConfig(dtype=run.dtype, kernel=o.kernel, block_size=o.block_size, weight_quant=run.weight_quant,
                           deterministic=run.deterministic, training=o.training, dropout_seed=o.dropout_seed,
                           compile=o.compile)


def cache_config(run) -> CacheConfig:
    """The KV cache our engine builds for a RunConfig: the run's cache dtype and chunks, our options' layout."""
    o = run.options
    layout = CacheLayout(dtype=run.cache_dtype, int8_scales=run.int8_scales, **o.layout_fields())
    return CacheConfig(layout, run.chunk_size, o.invariants)
