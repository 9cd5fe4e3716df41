"""The transformers engine's own options, the table ``[run.transformers]`` (plain data, no torch): read and checked
with the rest of a config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
# how the weights reach the compute dtype: "dtype" loads them in it (from_pretrained(dtype=...): RoPE's inv_freq
# buffer stays float32); "cast" loads float32, then model.to(dtype), which casts the buffers too (inv_freq included)
LOADS = ("dtype", "cast")


def check_choice(key: str, value, choices: tuple) -> None:
    """Refuse a value outside ``choices``, in one line naming the key and the value."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(repr(c) for c in choices)} (got {key}={value!r})")


@dataclass(frozen=True)
class TransformersOptions:
    """[run.transformers]: Hugging Face transformers' own model."""
    attn_implementation: str = "eager"  # eager | sdpa
    load: str = "dtype"  # dtype | cast (see LOADS)

    def __post_init__(self):
        check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice("load", self.load, LOADS)
