"""What model to prefill, as data: a source and, for the built-in synthetic models, seed and size overrides.

Imports nothing heavy: a trace's metadata can be turned back into the spec it was recorded from.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """*What* model to prefill: a source plus, for the built-in synthetic models, seed and size overrides."""
    source: str = "synthetic"
    seed: int = 0
    overrides: tuple = ()  # sorted (ModelArgs field, value) pairs
    adapter: tuple = ()  # sorted (key, value) pairs: id, rank, seed, scale
    first_layers: int | None = None  # run the model's first this many layers only (--first-layers N): None, all

    def describe(self) -> dict:
        return {"source": self.source, "seed": self.seed, "overrides": dict(self.overrides),
                "adapter": dict(self.adapter) or None, **({} if self.first_layers is None else {"first_layers": self.first_layers})}

    @classmethod
    def from_description(cls, d: dict) -> "ModelSpec":
        """The inverse of ``describe``, also after a JSON round trip (lists and tables become sorted tuples)."""
        return cls(source=d.get("source", "synthetic"), seed=d.get("seed", 0),
                   overrides=_frozen(d.get("overrides") or {}), adapter=_frozen(d.get("adapter") or {}),
                   first_layers=d.get("first_layers"))


def _frozen(value):
    """JSON values made hashable the way ModelSpec holds them: a table as sorted pairs, a list as a tuple."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value
