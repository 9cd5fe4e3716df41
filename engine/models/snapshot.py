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
from ..shared.errors import ConfigError


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
    truncated_of: int | None = None  # the whole model's layers when this snapshot keeps only its first n_layers

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
        return Snapshot(self.source, self.args, self.state, adapter, self.tokenizer, self._digest, self.foreign,
                        self.truncated_of)

    def truncated(self, n: int) -> "Snapshot":
        """The model's first ``n`` layers (the four-layer trick): n_layers = n, the later layers' weights dropped,
        the final norm and unembedding kept (applied after layer n - 1). Every engine gets it through its own
        path: ours and the converters (vLLM's checkpoint, llama.cpp's GGUF) read these args and weights;
        transformers cuts its own module list (hf_engine.build_model)."""
        L = self.args.n_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= L:
            raise ConfigError(f"--first-layers must be from 1 to the model's {L} layers (got {n!r})")
        if n == L and self.truncated_of is None:
            return self
        keep = lambda k: not (k.startswith("layers.") and int(k.split(".")[1]) >= n)
        cut = {"n_layers": n}
        if self.args.layer_types:
            cut["layer_types"] = tuple(self.args.layer_types[:n])
        if self.args.dense_layers:
            cut["dense_layers"] = tuple(i for i in self.args.dense_layers if i < n)
        return Snapshot(self.source, self.args.replace(**cut), {k: v for k, v in self.state.items() if keep(k)},
                        self.adapter, self.tokenizer, "", self.foreign, self.truncated_of or L)

    def described_args(self) -> dict:
        """The model's arguments as a trace records them: all of them, or for a foreign model only the sizes
        read from its config (the rest would be our defaults, not the model's)."""
        d = self.args.as_dict()
        if self.foreign is None:
            return d
        return {k: d[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
                                  "max_position", "tokenizer_vocab_size", "arch")}
