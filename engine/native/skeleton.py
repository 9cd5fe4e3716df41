"""An unfilled Transformer: the module tree and its parameter shapes, with no weights in it yet.

Built on the meta device with torch.nn.init's random initialisers switched off, as transformers'
``no_init_weights`` does: initialising a meta tensor goes through torch._refs and imports
torch._dynamo (0.7 s of every start-up), and a snapshot's weights replace them anyway.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn import init

from .model import ModelArgs, Transformer

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


def state_shapes(args: ModelArgs) -> dict[str, tuple]:
    """Every tensor name of the model's state dict and its shape, in state-dict order."""
    return {name: tuple(t.shape) for name, t in skeleton(args).state_dict().items()}
