"""Model snapshots: immutable weights (and adapter) with content digests (docs/contract.md).

A snapshot keeps float32 master weights under our module names. ``build`` makes a
runnable ``Transformer`` in a given precision; adapters (LoRA, ``native/lora.py``) and
weight-only int8 quantisation (``quantize.py``) are applied to the built model from
outside, as gpt-fast does. Where snapshots come from: ``sources.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..native.lora import Adapter, apply_adapter
from ..native.kv_cache import torch_dtype
from .digest import digest_tensors
from ..shared.errors import ConfigError, ModelLoadError, UnsupportedModel
from ..native.model import ModelArgs
from ..native.quantize import quantize_int8
from ..shared.precisions import FLOATS as ACT_DTYPES
from ..native.skeleton import skeleton


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

    def build(self, dtype: str = "float32", weight_quant: str = "none", training: bool = False):
        """A runnable model; returns (model, quantised weights digest or None)."""
        if self.foreign is not None:
            raise UnsupportedModel(self.foreign)
        if dtype not in ACT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(ACT_DTYPES)} (got {dtype!r})")
        model = skeleton(self.args)
        tdt = torch_dtype(dtype)
        state = {k: v.to(tdt) for k, v in self.state.items()}
        missing = set(model.state_dict()) - set(state)
        if self.args.tie_embeddings:
            missing.discard("output.weight")
        if missing:
            raise ModelLoadError(f"weights are missing tensors {sorted(missing)[:5]} (source {self.source})")
        model.load_state_dict(state, strict=False, assign=True)
        if self.args.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        qdigest = None
        if self.adapter is not None:
            apply_adapter(model, self.adapter, tdt)
        if weight_quant == "int8":
            qdigest = quantize_int8(model)
        elif weight_quant != "none":
            raise ConfigError(f"weight_quant must be 'none' or 'int8' (got {weight_quant!r})")
        model.train(training)
        return model, qdigest
