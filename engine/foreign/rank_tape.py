"""A data-parallel rank's trace as the calls it wrote, and the one trace the ranks' calls make.

A data-parallel rank runs whole samples (its share of the prompts), so what it records is already in the trace's
coordinates: every value it writes through the recorder interface (engine/shared/trace_recorder.py) belongs to
one of its samples, by the sample's index in the whole run. ``RankTape`` is that interface for a rank: it keeps
each write (the method, its arguments, tensors copied), grouped by the call (engine/calls.py) that made it, and
saves them to a file its launcher reads back. ``replay`` writes the ranks' calls into the run's recorder in the
order of the run's plan, so the trace they make is the trace one process running every call would have written:
the same writes, the same values, bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..shared.trace_recorder import TraceRecorder

# what the job, not the engine, calls on a recorder (its life cycle and what it reads back): never on a tape
_NOT_WRITES = {"begin", "layer_done", "flush", "close", "abort", "final_top_ids", "update_meta"}
WRITES = frozenset(n for n, v in vars(TraceRecorder).items() if callable(v) and not n.startswith("_")) - _NOT_WRITES


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()  # a view would drag its whole buffer into the file
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


class RankTape:
    """The recorder interface a rank writes through: each write is kept, under the call that made it."""

    def __init__(self):
        self.meta: dict = {}
        self.calls: dict[int, list] = {}  # call index in the run's plan -> [(method, args, kwargs)]
        self._at: int | None = None

    @contextmanager
    def call(self, index: int):
        """The writes made inside belong to call ``index`` of the run's plan."""
        self._at = index
        self.calls.setdefault(index, [])
        try:
            yield self
        finally:
            self._at = None

    def __getattr__(self, name):
        if name not in WRITES:
            raise AttributeError(f"a rank's tape takes the recorder's writes ({', '.join(sorted(WRITES))}), not {name}")

        def keep(*args, **kwargs):
            if self._at is None:
                raise RuntimeError(f"{name}: a rank's write outside any call")
            self.calls[self._at].append((name, _copy(args), {k: _copy(v) for k, v in kwargs.items()}))
        return keep

    def save(self, path, **extra) -> None:
        torch.save({"calls": self.calls, **extra}, path)


def load(path) -> dict:
    """A saved tape: {"calls": {call index: writes}, and what the rank saved beside them}."""
    return torch.load(path, weights_only=True)


def replay(tapes: list[dict], recorder: TraceRecorder) -> None:
    """Every rank's writes into ``recorder``, call by call in the order of the run's plan."""
    calls = {}
    for tape in tapes:
        for index, writes in tape["calls"].items():
            if index in calls:
                raise RuntimeError(f"call {index} of the plan was run by two ranks")
            calls[index] = writes
    for index in sorted(calls):
        for name, args, kwargs in calls[index]:
            getattr(recorder, name)(*args, **kwargs)
