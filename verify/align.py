"""Which reference sample is which candidate sample, and which cells of each hold the same token.

Samples are matched by their token ids (never by index: a candidate may batch them in another
order); within a matched pair, cells are aligned by token index (never by column: padding, reuse
and chunking move them). What cannot be aligned is a failure: traces of other architectures or
without a common sample cannot be compared at all (a ``metadata`` break), and a reference sample
with no counterpart is a ``coverage`` break unless the user asked for a subset.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..dumps.reader import Trace, TraceError
from . import wording
from .breaks import Break

ARCH_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")


class Pair(NamedTuple):
    """A reference sample and the candidate sample with the same token ids."""
    ref: int
    cand: int


class Cells(NamedTuple):
    """The cells of one matched pair that hold the same tokens, and each side's padding columns."""
    ref_cols: slice | np.ndarray
    cand_cols: slice | np.ndarray
    tokens: np.ndarray  # token index of each aligned cell
    ref_pad: np.ndarray
    cand_pad: np.ndarray


class NearMiss(NamedTuple):
    """An unmatched reference sample and the closest unmatched candidate sample."""
    ref_sample: int
    cand_sample: int
    ref_tokens: tuple
    cand_tokens: tuple
    prefix: int  # tokens in common at the start
    suffix: int  # at the end


class Alignment:
    """Matched samples of two traces, their aligned cells, and what is on one side only."""

    def __init__(self, ref: Trace, cand: Trace):
        self.ref, self.cand = ref, cand
        self.pairs, self.ref_only, self.cand_only = match_samples(ref, cand)
        self.dropped = []  # pairs an explained routing flip took out of the comparison (verify/routing.py)
        self.cells: dict[int, Cells] = {}  # reference sample -> its aligned cells
        self.notes: list[str] = []
        for rs, cs in self.pairs:
            rcols, rtoks = ref.cells(rs)
            ccols, ctoks = cand.cells(cs)
            common, ri, ci = np.intersect1d(rtoks, ctoks, assume_unique=True, return_indices=True)
            self.cells[rs] = Cells(as_slice(rcols[ri]), as_slice(ccols[ci]), common, ref.pad_cols(rs),
                                   cand.pad_cols(cs))
            only_r, only_c = np.setdiff1d(rtoks, ctoks), np.setdiff1d(ctoks, rtoks)
            if only_r.size:
                self.notes.append(wording.only_in_reference(rs, only_r))
            if only_c.size:
                self.notes.append(wording.only_in_candidate(rs, only_c))

    def near_misses(self) -> list[NearMiss]:
        return near_misses(self.ref, self.cand, self.ref_only, self.cand_only)

    def structure_break(self, allow_subset: bool) -> tuple[Break | None, list[str]]:
        """(the metadata or coverage break, or None; notes on samples left out)."""
        ra, ca = self.ref.args, self.cand.args
        diffs = [f"{k} {ra.get(k)} vs {ca.get(k)}" for k in ARCH_KEYS if ra.get(k) != ca.get(k)]
        if self.ref.n_layers != self.cand.n_layers and not any(d.startswith("n_layers") for d in diffs):
            diffs.append(f"layers stored {self.ref.n_layers} vs {self.cand.n_layers}")
        if diffs and ra.get("n_layers") != ca.get("n_layers"):  # a side cut to its first layers says so
            cut = [w for w in (wording.cut_to(self.ref.meta, "reference"), wording.cut_to(self.cand.meta, "candidate"))
                   if w]
            if cut:
                diffs.append("; ".join(cut))
        if diffs:
            return Break(stage="metadata", kind="metadata", message=wording.architectures_differ(diffs)), []
        if not self.pairs:
            return Break(stage="metadata", kind="metadata", message=wording.no_common_sample(
                len(self.ref.samples), len(self.cand.samples), self.near_misses())), []
        notes = [wording.candidate_only_note(self.cand_only)] if self.cand_only else []
        if self.ref_only and allow_subset:
            notes.append(wording.subset_note(self.ref_only, len(self.ref.samples)))
        elif self.ref_only:
            return self.coverage_break(), notes
        return None, notes

    def coverage_break(self) -> Break:
        """Reference requests the candidate never produced: a failure, never a silent pass."""
        return Break(stage="metadata", kind="coverage",
                     message=wording.coverage(self.ref_only, len(self.ref.samples), self.near_misses()),
                     sample=self.ref_only[0], samples=tuple(self.ref_only))

    def positions_break(self) -> Break | None:
        """/inputs/positions of the cells both sides computed (by token index), exactly: the position ids the
        model was given. Reported at layer 0, after the cache checks and before values, like cache positions."""
        rp, cp = self.ref.inputs["positions"], self.cand.inputs["positions"]
        first, bad = None, []
        for rs, cs in self.pairs:
            cells = self.cells[rs]
            a, b = rp[rs, cells.ref_cols], cp[cs, cells.cand_cols]
            diff = np.flatnonzero(a != b)
            if diff.size:
                bad.append(rs)
                if first is None:
                    j = int(diff[0])
                    tok = int(cells.tokens[j])
                    first = (rs, tok, wording.positions_differ(rs, tok, int(b[j]), int(a[j]), diff.size,
                                                               cells.tokens.size))
        if first is None:
            return None
        return Break(stage="layer", kind="positions", message=first[2], layer=0, tensor="positions", sample=first[0],
                     position=first[1], samples=tuple(bad))


def match_samples(ref: Trace, cand: Trace) -> tuple[list[Pair], list[int], list[int]]:
    """Pairs (ref sample, cand sample) with equal token ids, in order; and the unmatched of each side."""
    free = {}
    for j, toks in enumerate(cand.samples):
        free.setdefault(toks, []).append(j)
    pairs, ref_only = [], []
    for i, toks in enumerate(ref.samples):
        if free.get(toks):
            pairs.append(Pair(i, free[toks].pop(0)))
        else:
            ref_only.append(i)
    cand_only = sorted(j for js in free.values() for j in js)
    return pairs, ref_only, cand_only


def as_slice(idx: np.ndarray):
    """A contiguous ascending index array as a slice (a view, no copy); otherwise the array."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size < 2 or (np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def same_layout(ref: Trace, other: Trace) -> None:
    """A golden or twin must be the reference's own path: the same samples, in the same cells."""
    if other.samples != ref.samples:
        raise TraceError(f"{other.name}: not a golden or twin of {ref.name} (its samples' token ids differ)")
    for s in range(ref.n_samples):
        a, b = ref.cells(s), other.cells(s)
        if not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])):
            raise TraceError(f"{other.name}: not a golden or twin of {ref.name} (sample {s} is laid out in other "
                             "cells: another batching, reuse or chunking)")


def near_misses(ref: Trace, cand: Trace, ref_only, cand_only) -> list[NearMiss]:
    """For each of the first four unmatched reference samples, the unmatched candidate sample sharing the most
    tokens at its ends, if any shares one."""
    out = []
    for i in ref_only[:4]:
        r = ref.samples[i]
        best = None
        for j in cand_only:
            c = cand.samples[j]
            p, q = common_prefix(r, c), common_prefix(r[::-1], c[::-1])
            score = min(p + q, min(len(r), len(c)))
            if best is None or score > best[0]:
                best = (score, NearMiss(i, j, tuple(r), tuple(c), p, q))
        if best is not None and best[0] > 0:
            out.append(best[1])
    return out


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def decode_steps(t: Trace, pairs, side: int) -> dict:
    """{(reference sample, token index): decode step} of every cell trace ``t`` computed in a decode step; ``side``:
    which index of each (reference, candidate) pair is ``t``'s row."""
    rows, tok = t.rows, t.inputs["token_index"]
    out = {}
    for pair in pairs:
        row = pair[side]
        at = rows["step"][row] >= 0
        out.update({(pair[0], int(i)): int(st) for i, st in zip(tok[row][at], rows["step"][row][at])})
    return out
