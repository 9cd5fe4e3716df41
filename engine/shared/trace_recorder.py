"""The one interface a trace is written through, declared once: ``TraceRecorder``.

dumps/recorder.py's ``Recorder`` implements it (into a file or in memory, for a whole run or one
tensor-parallel rank); engines write through it (engine/engines.py: ``execute``). Coordinates are the
trace's: ``sample`` is a trace row, ``col`` a stored column. An engine reports in its own forward
coordinates, (batch row, column), and engine/calls.py's ``Placement`` maps those onto these calls.

Who calls what: the job drives the life cycle (``begin``; ``layer_done`` after each layer; ``flush`` for a
reader of the file being recorded; ``close`` or ``abort``), the engine writes the values (``inputs`` and
``steps``; ``state``, ``op``, ``routing``, ``cache`` per layer; ``final`` and ``response_logits`` per sample;
``update_meta`` and ``meta`` at any time after ``begin``). A layer's statistics, cache positions and sampled values, the inputs and the final
outputs are kept in memory until ``close``. Part of the shared leaf: it imports nothing heavy (an array is
a numpy array or a torch tensor: llama.cpp hands over numpy arrays, the torch engines tensors).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    Array = torch.Tensor | np.ndarray


class TraceRecorder(Protocol):
    """A trace being written, in trace coordinates (see the module docstring for who calls what)."""

    meta: dict  # the trace's metadata as written so far (llama.cpp completes its engine and layout)
    ops: object  # None, or the op-level states being recorded (dumps/ops.py OpStore: ``wants``, ``absent``)

    def begin(self, samples, n_cols: int, meta: dict) -> None: ...

    def inputs(self, sample: int, col: int, ids: Array, valid: Array, positions: Array,
               token_index: Array) -> None: ...

    def steps(self, sample: int, col: int, phase: Array, step: Array, cache_len: Array) -> None: ...

    def state(self, layer: int, name: str, sample: int, col: int, x: Array) -> None: ...

    def op(self, layer: int, name: str, sample: int, col: int, x: Array) -> None: ...

    def routing(self, layer: int, sample: int, col: int, ids: Array, weights: Array, margin: Array,
                scale: Array, logits: Array | None = None) -> None: ...

    def cache(self, layer: int, sample: int, keys: Array, values: Array, positions: Array) -> None: ...

    def layer_done(self, layer: int) -> None: ...

    def final(self, sample: int, norm_last: Array, logits: Array, column: int, token_index: int) -> None: ...

    def response_logits(self, sample: int, token_index: Array, logits: Array) -> None: ...

    def final_top_ids(self) -> list[int]: ...

    def update_meta(self, **items) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...
