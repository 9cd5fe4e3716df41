"""The two recorder interfaces engines write through, declared once.

``TraceRecorder`` is what ``engines.execute`` is given (a dumps Recorder satisfies it): trace
coordinates, one row per sample. ``CallRecorder`` is what one prefill call writes in its own
(row, column) coordinates: ``calls.Placement`` implements it over a TraceRecorder, and our engine
(prefill.py), the transformers engine and the llama.cpp engine call it.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

Array = torch.Tensor | np.ndarray  # llama.cpp hands over numpy arrays, the torch engines tensors


class TraceRecorder(Protocol):
    """Trace coordinates: ``sample`` is the trace row, ``col`` a trace column."""

    meta: dict  # the trace's metadata as written so far (llama.cpp completes its engine and layout)

    def inputs(self, sample: int, col: int, ids: Array, valid: Array, positions: Array,
               token_index: Array) -> None: ...

    def state(self, layer: int, name: str, sample: int, col: int, x: Array) -> None: ...

    def routing(self, layer: int, sample: int, col: int, ids: Array, weights: Array, margin: Array,
                scale: Array, logits: Array | None = None) -> None: ...

    def cache(self, layer: int, sample: int, keys: Array, values: Array, positions: Array) -> None: ...

    def final(self, sample: int, norm_last: Array, logits: Array, column: int, token_index: int) -> None: ...

    def update_meta(self, **items) -> None: ...


class CallRecorder(Protocol):
    """One prefill call's coordinates: rows and columns of its rectangle, its sequences ``seq``."""

    def inputs(self, ids: Array, valid: Array, positions: Array, tok: Array, seq: Array) -> None: ...

    def state(self, layer: int, name: str, x: Array, col_start: int) -> None: ...

    def routing(self, layer: int, ids: Array, weights: Array, margin: Array, scale: Array,
                logits: Array | None, col_start: int) -> None: ...

    def cache(self, layer: int, seq: int, keys: Array, values: Array, positions: Array) -> None: ...

    def final(self, seq: int, h: Array, logits: Array, cell: tuple[int, int], tok: int) -> None: ...
