"""Our engine's runnable model from a snapshot: an unfilled Transformer (the module tree and its parameter shapes,
with no weights in it yet), then the snapshot's weights, its adapter and any weight quantisation.

The skeleton is built on the meta device with torch.nn.init's random initialisers switched off, as transformers'
``no_init_weights`` does: initialising a meta tensor goes through torch._refs and imports torch._dynamo (0.7 s of
every start-up), and a snapshot's weights replace them anyway.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn import init

from ..models.args import ModelArgs
from ..models.dtypes import torch_dtype
from ..models.snapshot import Snapshot
from ..shared.errors import ConfigError, ModelLoadError, UnsupportedModel
from ..shared.precisions import ACT_DTYPES
from .lora import apply_adapter
from .model import Transformer
from .quantize import quantize_int8

_INITIALISERS = ("kaiming_uniform_", "uniform_", "normal_")  # what nn.Linear and nn.Embedding call


@contextlib.contextmanager
def _no_init():
    saved = {name: getattr(init, name) for name in _INITIALISERS}
    try:
        for name in saved:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def skeleton(args: ModelArgs) -> Transformer:
    """The model's modules on the meta device: load weights with ``load_state_dict(..., assign=True)``."""
    with _no_init(), torch.device("meta"):
        return Transformer(args)


def build(snapshot: Snapshot, dtype: str = "float32", weight_quant: str = "none", training: bool = False):
    """A runnable model of the snapshot; returns (model, quantised weights digest or None)."""
    if snapshot.foreign is not None:
        raise UnsupportedModel(snapshot.foreign)
    if dtype not in ACT_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ACT_DTYPES)} (got {dtype!r})")
    model = skeleton(snapshot.args)
    tdt = torch_dtype(dtype)
    state = {k: v.to(tdt) for k, v in snapshot.state.items()}
    missing = set(model.state_dict()) - set(state)
    if snapshot.args.tie_embeddings:
        missing.discard("output.weight")
    if missing:
        raise ModelLoadError(f"weights are missing tensors {sorted(missing)[:5]} (source {snapshot.source})")
    model.load_state_dict(state, strict=False, assign=True)
    if snapshot.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    qdigest = None
    if snapshot.adapter is not None:
        apply_adapter(model, snapshot.adapter, tdt)
    if weight_quant == "int8":
        qdigest = quantize_int8(model)
    elif weight_quant != "none":
        raise ConfigError(f"weight_quant must be 'none' or 'int8' (got {weight_quant!r})")
    model.train(training)
    return model, qdigest
