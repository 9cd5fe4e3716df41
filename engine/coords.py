"""Named coordinates that cross functions: where a call's cells sit, and where they land in the trace."""
from __future__ import annotations

from typing import NamedTuple


class TraceRun(NamedTuple):
    """Columns [c0, c1) of a call's row ``row`` hold trace sample ``sample`` from its column ``t0`` on."""
    row: int
    c0: int
    c1: int
    sample: int
    t0: int


class SeqRun(NamedTuple):
    """Columns [c0, c1) of row ``row`` hold sequence ``seq`` of a call (its valid cells, in order)."""
    row: int
    seq: int
    c0: int
    c1: int


class Cell(NamedTuple):
    """One cell of the input rectangle."""
    row: int
    col: int


class CacheWrite(NamedTuple):
    """A sequence's cells in one chunk: chunk columns [a, e) of row ``row``, its tokens from ``tok0`` on."""
    row: int
    seq: int
    a: int
    e: int
    tok0: int
