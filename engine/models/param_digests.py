"""The model as an engine holds it after loading ("after sync"): one digest per parameter and per buffer.

A trace carries them as ``meta.parameters`` (dumps/meta_fields.py): ``naming`` says whose names the list uses
(``hf``: Hugging Face module paths, ``model.layers.1.self_attn.k_proj.weight``), ``tensors`` lists every
parameter, then every buffer, in the module's order, each with its dtype, shape and the first 16 hex digits of
the sha256 of its bytes. A weight tied to another (the unembedding to the embedding) is listed once, under the
name the module reaches it by first. verify/parameters.py compares two such lists.

``stale_param`` is the fault ``stale-param``: one element of one named parameter moved by one unit in the last
place after loading, as a weight sync that left one tensor stale would leave it.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch

from ..shared.errors import ConfigError

DIGITS = 16  # hex digits of sha256 kept per tensor: 64 bits, one JSON list of short texts for thousands of tensors
_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in row-major order, its first ``DIGITS`` hex digits."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    data = flat.numpy() if flat.dtype == torch.bool else flat.view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:DIGITS]


def _row(name: str, kind: str, t: torch.Tensor) -> dict:
    return {"name": name, "kind": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "sha256": tensor_digest(t)}


def module_digests(model: torch.nn.Module, naming: str, rename: Callable[[str], str] | None = None) -> dict:
    """``meta.parameters`` of ``model``: every parameter (tied ones once), then every buffer, under ``rename``'s
    names (the module's own where it gives none)."""
    return tensor_digests(model.named_parameters(), model.named_buffers(), naming, rename)


def tensor_digests(parameters, buffers, naming: str, rename: Callable[[str], str] | None = None) -> dict:
    """``meta.parameters`` of (name, tensor) pairs, parameters then buffers, each digested as it comes (an iterator
    may make each tensor just before: a gathered shard). No timing: two recordings of one run under
    SOURCE_DATE_EPOCH keep the same metadata (docs/guarantees.md, Determinism)."""
    rename = rename or (lambda n: n)
    rows = [_row(rename(n), "parameter", p) for n, p in parameters]
    rows += [_row(rename(n), "buffer", b) for n, b in buffers]
    return {"naming": naming, "tensors": rows}


def not_reported(why: str) -> dict:
    """``meta.parameters`` of an engine that does not report them, saying why."""
    return {"naming": None, "tensors": None, "not_reported": why}


def stale_param(model: torch.nn.Module, name: str) -> str:
    """Move element 0 of parameter ``name`` by one unit in the last place (its bits + 1: the next float away from
    zero), in a copy the parameter then holds; returns the name. A name the model does not have is a KeyError naming the ones near it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        near = [n for n in params if n.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]][:4]
        raise KeyError(f"the model has no parameter {name!r} (near: {near})")
    p = params[name]
    if not p.is_contiguous():
        raise ValueError(f"parameter {name!r} is not contiguous: its first element has no bits of its own to move")
    with torch.no_grad():
        p.data = p.data.clone()  # its own storage: a loaded weight may share the snapshot's, which other sides read
        bits = p.data.reshape(-1)[:1].view(_SAME_WIDTH[p.element_size()])
        bits += 1
    return name


def stale_param_layer(fault, n_layers: int) -> int:
    """The layer whose k_proj weight the fault stale-param moves: [fault] layer, default layer 1 (layer 0 of a
    one-layer model); a layer the model does not have is refused in one line."""
    layer = min(1, n_layers - 1) if fault.layer is None else fault.layer
    if not 0 <= layer < n_layers:
        raise ConfigError(f"fault stale-param layer must be in [0, {n_layers}) (got {layer})")
    return layer
