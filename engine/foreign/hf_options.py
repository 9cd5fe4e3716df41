"""The transformers engine's own options, the table ``[run.transformers]`` (plain data, no torch): read and checked
with the rest of a config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError


@dataclass(frozen=True)
class TransformersOptions:
    """[run.transformers]: Hugging Face transformers' own model."""
    attn_implementation: str = "eager"  # eager | sdpa

    def __post_init__(self):
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ConfigError(f"attn_implementation must be 'eager' or 'sdpa' (got {self.attn_implementation!r})")
