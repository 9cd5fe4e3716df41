"""A data-parallel rank's trace as the calls it wrote, and the one trace the ranks' calls make.

A data-parallel rank runs whole samples (its share of the prompts), so what it records is already in the trace's
coordinates: every value it writes through the recorder interface (engine/shared/trace_recorder.py) belongs to
one of its samples, by the sample's index in the whole run. ``RankTape`` is that interface for a rank: it keeps
each write (the method, its arguments, tensors copied), grouped by the call (engine/calls.py) that made it, and
saves them to a file its launcher reads back. ``replay`` writes the ranks' calls into the run's recorder in the
order of the run's plan, so the trace they make is the trace one process running every call would have written:
the same writes, the same values, bit for bit.

With op-level states asked for (``--level ops``), a tape's ``ops`` is ``RankOps``: the trace's OpStore (dumps/ops.py)
as the engine's capture sees it. It answers ``wants`` as the trace's does (the same layers), keeps each ``absent``
as a write of the call it is made in (replayed into the trace's OpStore in plan order, among the ``op`` writes) and
``how`` as a dict saved with the tape (merged into the trace's after the replay).
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


class RankOps:
    """The trace's op request in a rank: ``wants``, ``absent``, ``how`` and ``recorded`` as dumps/ops.py's OpStore has
    them, for ``tape``; ``layers`` None (every layer) or the layers asked for."""

    def __init__(self, tape: "RankTape", layers):
        self.layers = None if layers is None else sorted({int(x) for x in layers})
        self.how: dict = {}  # op name -> how the engine computes it (merged into the trace's OpStore.how)
        self.recorded: list = []  # the op names this rank recorded, in the order it first did
        self._tape = tape

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def absent(self, name: str, why: str) -> None:
        """Kept as a write of the current call: the trace's OpStore hears it in plan order."""
        self._tape.write(OPS_ABSENT, (name, why), {})


OPS_ABSENT = "ops.absent"  # a tape entry replayed as recorder.ops.absent(name, why)


class RankTape:
    """The recorder interface a rank writes through: each write is kept, under the call that made it. ``ops``: None,
    or the op request (``RankOps``) when the trace records op-level states (``ops_layers``: None every layer, or the
    layers asked for; ``ops`` False: none)."""

    def __init__(self, ops: bool = False, ops_layers=None):
        self.meta: dict = {}
        self.calls: dict[int, list] = {}  # call index in the run's plan -> [(method, args, kwargs)]
        self._at: int | None = None
        self.ops = RankOps(self, ops_layers) if ops else None

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
            if name == "op" and self.ops is not None and self.ops.wants(args[0]) and args[1] not in self.ops.recorded:
                self.ops.recorded.append(args[1])
            self.write(name, args, kwargs)
        return keep

    def write(self, name: str, args: tuple, kwargs: dict) -> None:
        """Keep write ``name`` (tensors copied) under the current call."""
        if self._at is None:
            raise RuntimeError(f"{name}: a rank's write outside any call")
        self.calls[self._at].append((name, _copy(args), {k: _copy(v) for k, v in kwargs.items()}))

    def save(self, path, **extra) -> None:
        torch.save({"calls": self.calls, "ops_how": {} if self.ops is None else dict(self.ops.how), **extra}, path)


def load(path) -> dict:
    """A saved tape: {"calls": {call index: writes}, and what the rank saved beside them}."""
    return torch.load(path, weights_only=True)


def replay(tapes: list[dict], recorder: TraceRecorder) -> None:
    """Every rank's writes into ``recorder``, call by call in the order of the run's plan; an op declared absent goes
    to ``recorder.ops``, and each rank's ``how`` of its ops into ``recorder.ops.how`` after the writes."""
    calls = {}
    for tape in tapes:
        for index, writes in tape["calls"].items():
            if index in calls:
                raise RuntimeError(f"call {index} of the plan was run by two ranks")
            calls[index] = writes
    ops = getattr(recorder, "ops", None)
    for index in sorted(calls):
        for name, args, kwargs in calls[index]:
            if name == OPS_ABSENT:
                ops.absent(*args, **kwargs)
            else:
                getattr(recorder, name)(*args, **kwargs)
    for tape in tapes:
        if tape.get("ops_how"):
            ops.how.update(tape["ops_how"])
