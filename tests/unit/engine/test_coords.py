"""engine/coords.py: the named coordinates, and the SeqRun and CacheWrite values prefill.Cells derives from a
call's validity and sequences, against an independent cell-by-cell enumeration."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.engine.coords import CacheWrite, Cell, SeqRun, TraceRun
from prefill_diff.engine.native.prefill import Cells


@pytest.mark.parametrize("cls,values", [
    (TraceRun, dict(row=1, c0=2, c1=9, sample=4, t0=3)),
    (SeqRun, dict(row=2, seq=5, c0=1, c1=7)),
    (Cell, dict(row=3, col=8)),
    (CacheWrite, dict(row=1, seq=2, a=3, e=6, tok0=11)),
])
def test_keyword_fields_unpack_in_the_order_callers_destructure(cls, values):
    """Built by keyword, each tuple unpacks positionally in its declared order (Placement unpacks a TraceRun as
    ``r, c0, c1, s, t0``; skipped_kv_keep a SkippedKV-like triple), and equals the plain tuple of those values."""
    t = cls(**values)
    assert tuple(t) == tuple(values.values())
    assert t == tuple(values.values())  # plain tuples (tests/bench/bench_record.py passes them) are the same run
    for name, v in values.items():
        assert getattr(t, name) == v


def test_replace_changes_one_field_only():
    """``_replace`` (gathered_cell's fault row 1) returns a new cell with one field changed, the original intact."""
    c = Cell(row=2, col=5)
    d = c._replace(col=9)
    assert (d.row, d.col) == (2, 9)
    assert (c.row, c.col) == (2, 5)


@pytest.mark.parametrize("cls,values", [
    (TraceRun, (1, 2, 9, 4)),
    (SeqRun, (2, 5, 1)),
    (Cell, (3,)),
    (CacheWrite, (1, 2, 3, 6)),
])
def test_incomplete_coordinates_are_refused_and_fields_are_read_only(cls, values):
    """A coordinate missing a field is refused at construction; a complete one cannot be modified in place."""
    with pytest.raises(TypeError):
        cls(*values)
    full = cls(*values, 0)
    with pytest.raises(AttributeError):
        setattr(full, cls._fields[0], 99)


# -- SeqRun and CacheWrite as prefill.Cells computes them ---------------------------------------------------

def naive_cells(valid, seq, offsets):
    """{seq: [(row, col, token index), ...]} walking the rectangle cell by cell."""
    out = {}
    B, n = valid.shape
    for b in range(B):
        for c in range(n):
            if valid[b, c]:
                s = int(seq[b, c])
                cells = out.setdefault(s, [])
                cells.append((b, c, offsets.get(s, 0) + len(cells)))
    return out


def naive_writes(valid, seq, offsets, x0, x1):
    """The CacheWrites of chunk columns [x0, x1): each sequence's cells there, in chunk coordinates."""
    want = []
    for s, cells in naive_cells(valid, seq, offsets).items():
        inside = [(b, c, t) for b, c, t in cells if x0 <= c < x1]
        if inside:
            b = inside[0][0]
            want.append(CacheWrite(row=b, seq=s, a=inside[0][1] - x0, e=inside[-1][1] + 1 - x0, tok0=inside[0][2]))
    return want


@st.composite
def layouts(draw):
    """A call's rectangle: left- or right-padded rows (one sequence each) or one packed row, and prefix offsets."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    mode = draw(st.sampled_from(["left", "right", "packed"]))
    if mode == "packed":
        n = sum(lengths)
        valid = torch.ones(1, n, dtype=torch.bool)
        seq = torch.tensor([[i for i, k in enumerate(lengths) for _ in range(k)]])
    else:
        n = max(lengths)
        valid = torch.zeros(len(lengths), n, dtype=torch.bool)
        for b, k in enumerate(lengths):
            c0 = n - k if mode == "left" else 0
            valid[b, c0:c0 + k] = True
        seq = torch.arange(len(lengths))[:, None].expand(len(lengths), n)
    offsets = {s: draw(st.integers(0, 5)) for s in range(len(lengths)) if draw(st.booleans())}
    chunk = draw(st.integers(1, n))
    return valid, seq, offsets, chunk


@settings(max_examples=examples(60), deadline=None)
@given(layouts())
def test_cells_runs_and_chunk_writes_equal_a_cell_by_cell_enumeration(case):
    """Each sequence's SeqRun covers exactly its valid cells; for every chunk, Cells.writes lists, in chunk
    coordinates, the cells each sequence has there with the token index of the first one (reused prefixes
    counted), and nothing for a sequence with no cell in the chunk."""
    valid, seq, offsets, chunk = case
    positions = torch.zeros(valid.shape, dtype=torch.long)
    cells = Cells(valid, seq, positions, offsets)
    want = naive_cells(valid, seq, offsets)
    assert cells.n_seqs == len(want)
    for r in cells.runs:
        assert isinstance(r, SeqRun)
        assert [(r.row, c) for c in range(r.c0, r.c1)] == [(b, c) for b, c, _ in want[r.seq]]
        assert cells.tok[r.row, r.c0:r.c1].tolist() == [t for _, _, t in want[r.seq]]
        assert cells.last[r.seq] == Cell(row=r.row, col=r.c1 - 1)
    assert sorted(r.seq for r in cells.runs) == sorted(want)
    n = valid.shape[1]
    for x0 in range(0, n, chunk):
        x1 = min(x0 + chunk, n)
        got = cells.writes(x0, x1)
        assert all(isinstance(w, CacheWrite) for w in got)
        assert sorted(got) == sorted(naive_writes(valid, seq, offsets, x0, x1)), (x0, x1)
