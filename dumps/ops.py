"""Op-level states inside a layer (format 1.4; schema ``OP_TENSORS``), as a recorder writes them.

``--level ops`` records, besides a layer's states, the output of each op its engine computes under a name of
schema ``OP_TENSORS`` (the input norm, Q/K/V, q/k-norm, rotary, the attention core, the output projection, the
residual sum, the post-attention norm, gate, up, act·mul, down), every stored cell, in the tensor's own dtype
(bfloat16 widened to float32, exactly): a bitwise comparison needs every bit. An op an engine cannot produce is
declared absent with the reason (``absent``), never filled from another; one it neither records nor declares is
said to be absent because the engine recorded none. The trace's ``meta.record.ops`` lists both.

This module does not import torch: tensors are used through their own methods.
"""
from __future__ import annotations

import h5py

from . import schema as sc
from .h5write import text_attr
from .reductions import source_dtype, to_numpy
from .trace_file import RecorderError

NOT_RECORDED = "the engine recorded no such op"


class OpStore:
    """The op-level states of one trace being recorded: datasets ``layers/NNN/ops/NAME`` (S, C, width)."""

    def __init__(self, group_of, dims: dict, widths: dict, n_layers: int, gzip: bool, layers=None):
        """``group_of(layer)``: the recorder's group of that layer (made once, by whoever writes to it first)."""
        self.group_of, self.dims, self.widths, self.n_layers, self.gzip = group_of, dims, dict(widths), n_layers, gzip
        self.layers = None if layers is None else sorted({int(x) for x in layers})
        self._ds: dict = {}  # (layer, name) -> dataset
        self._absent: dict = {}  # name -> why
        self.how: dict = {}  # name -> how the engine computes it (its rounding), where its code makes that known
        self.recorded: list = []

    def wants(self, layer: int) -> bool:
        """Whether layer ``layer``'s ops are recorded (every layer, or those asked for)."""
        return self.layers is None or layer in self.layers

    def add(self, layer: int, name: str, sample: int, col: int, x) -> None:
        """One sample's cells [col, col + T) of op ``name`` at ``layer``: (T, width)."""
        op = sc.OP.get(name)
        if op is None:
            raise RecorderError(f"op name must be one of {', '.join(sc.OP_NAMES)} (got {name!r})")
        if not 0 <= int(layer) < self.n_layers:
            raise RecorderError(f"op {name}: layer {layer} out of range (the model has {self.n_layers} layers)")
        if not self.wants(layer):
            return
        shape = tuple(x.shape)
        width = self.widths.get(op.width)
        if len(shape) != 2 or (width is not None and shape[1] != width) or not 0 <= col or \
                col + shape[0] > self.dims["C"] or not 0 <= sample < self.dims["S"]:
            raise RecorderError(f"layer {layer} op {name} of sample {sample}: got shape {shape} from column {col}, "
                                f"expected (T, {width if width is not None else 'W'}) within the "
                                f"{self.dims['C']} columns of {self.dims['S']} samples")
        if width is None:  # the MLP's width: fixed by the first op that has it
            self.widths[op.width] = shape[1]
        if name in self._absent:
            raise RecorderError(f"op {name} was declared absent ({self._absent[name]}) and then recorded")
        key = (int(layer), name)
        ds = self._ds.get(key)
        arr = to_numpy(x)
        if ds is None:
            ds = h5py.Dataset(sc.OP_STATE.create(self.group_of(int(layer)), {**self.dims, "W": shape[1]}, name, arr.dtype,
                                                 chunks=(1, self.dims["C"], shape[1]), gzip=self.gzip))
            text_attr(ds, sc.ATTR_SOURCE_DTYPE, source_dtype(x))
            self._ds[key] = ds
            if name not in self.recorded:
                self.recorded.append(name)
        ds[int(sample), col:col + shape[0]] = arr

    def absent(self, name: str, why: str) -> None:
        """Op ``name`` is one this engine cannot produce, for the reason ``why`` (said in the trace and report)."""
        if name not in sc.OP:
            raise RecorderError(f"op name must be one of {', '.join(sc.OP_NAMES)} (got {name!r})")
        if name in self.recorded:
            raise RecorderError(f"op {name} was recorded and then declared absent ({why})")
        self._absent.setdefault(name, why)

    def declared(self) -> dict:
        """``meta.record.ops``: what was recorded (in the order computed), what is absent with why, and how the engine
        computes an op where it said."""
        recorded = [n for n in sc.OP_NAMES if n in self.recorded]
        absent = {n: self._absent.get(n, NOT_RECORDED) for n in sc.OP_NAMES if n not in self.recorded}
        return {"recorded": recorded, "absent": absent, "layers": self.layers,
                "how": {n: self.how[n] for n in sc.OP_NAMES if n in self.how}}
