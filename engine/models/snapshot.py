"""Model snapshots: immutable weights (and adapter) with content digests (docs/contract.md).

A snapshot keeps float32 master weights under our names (weights.py) and the adapter as data (adapter.py); an
engine builds its runnable model from them (ours: engine/native/skeleton.py's ``build``). Where snapshots come
from: ``sources.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from .adapter import Adapter
from .args import ModelArgs
from .digest import digest_tensors


@dataclass
class Snapshot:
    """Immutable weights + adapter + tokenizer, identified by digests."""
    source: str
    args: ModelArgs
    state: dict[str, torch.Tensor]  # float32 master weights, our names
    adapter: Adapter | None = None
    tokenizer: object | None = None
    _digest: str = field(default="", repr=False)
    foreign: str | None = None  # a checkpoint only transformers runs: why our engine refused it (args: sizes only)

    @property
    def weights_digest(self) -> str:
        if not self._digest:
            self._digest = digest_tensors(self.state)
        return self._digest

    def identity(self) -> dict:
        """What prefix reuse and cache invariant 5 compare (contract §2.9 condition 1)."""
        return {"weights_digest": self.weights_digest,
                "adapter": None if self.adapter is None else self.adapter.identity(),
                "layers": json.dumps(self.args.as_dict(), sort_keys=True)}

    def with_adapter(self, adapter: Adapter | None) -> "Snapshot":
        return Snapshot(self.source, self.args, self.state, adapter, self.tokenizer, self._digest, self.foreign)

    def described_args(self) -> dict:
        """The model's arguments as a trace records them: all of them, or for a foreign model only the sizes
        read from its config (the rest would be our defaults, not the model's)."""
        d = self.args.as_dict()
        if self.foreign is None:
            return d
        return {k: d[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
                                  "max_position", "tokenizer_vocab_size", "arch")}
