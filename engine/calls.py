"""Prefill calls and where their cells land in the trace.

A run is a list of ``Call``s (one per prefill the engine makes). Each call's ``runs`` map its rows
and columns onto the trace's (sample, column): one trace row per sample, columns as the engine laid
them out (padding kept visible). ``Placement`` is the recorder an engine writes a call through: it
takes the call's coordinates and hands the trace recorder the samples'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .coords import TraceRun
from .shared.trace_recorder import TraceRecorder


class Placement:
    """Maps one call's (row, column) and sequences onto trace (sample, column)."""

    def __init__(self, recorder: TraceRecorder, runs: list[TraceRun], sample_of_seq: list[int]):
        self.recorder = recorder
        self.runs = runs
        self.sample_of_seq = sample_of_seq

    def inputs(self, ids, valid, positions, tok, seq):
        for r, c0, c1, s, t0 in self.runs:
            self.recorder.inputs(s, t0, ids[r, c0:c1], valid[r, c0:c1], positions[r, c0:c1], tok[r, c0:c1])

    def _rows(self, n: int, col_start: int):
        """(batch row, slice of the n columns from col_start, trace sample, its first trace column) of each run the
        columns [col_start, col_start + n) cross."""
        for r, c0, c1, s, t0 in self.runs:
            a, b = max(c0, col_start), min(c1, col_start + n)
            if a < b:
                yield r, slice(a - col_start, b - col_start), s, t0 + a - c0

    def state(self, layer, name, x, col_start):
        for r, cols, s, col in self._rows(x.shape[1], col_start):
            self.recorder.state(layer, name, s, col, x[r, cols])

    def op(self, layer, name, x, col_start):
        """An op-level state (dumps/schema.py OP_TENSORS) of the call's rows, (B, n, width) from column col_start."""
        for r, cols, s, col in self._rows(x.shape[1], col_start):
            self.recorder.op(layer, name, s, col, x[r, cols])

    def routing(self, layer, ids, weights, margin, scale, logits, col_start):
        for r, sl, s, col in self._rows(ids.shape[1], col_start):
            self.recorder.routing(layer, s, col, ids[r, sl], weights[r, sl], margin[r, sl], scale[r, sl],
                                  None if logits is None else logits[r, sl])

    def steps(self, phase, step, cache_len):
        """What each cell's forward was (engine/native/decode.py): its phase, decode step and the cache length
        it read, (B, n) each."""
        for r, c0, c1, s, t0 in self.runs:
            self.recorder.steps(s, t0, phase[r, c0:c1], step[r, c0:c1], cache_len[r, c0:c1])

    def response_logits(self, seq, token_index, logits):
        self.recorder.response_logits(self.sample_of_seq[seq], token_index, logits)

    def cache(self, layer, seq, keys, values, positions):
        self.recorder.cache(layer, self.sample_of_seq[seq], keys, values, positions)

    def final(self, seq, h, logits, cell, tok):
        r, c = cell
        for rr, c0, c1, s, t0 in self.runs:
            if rr == r and s == self.sample_of_seq[seq]:
                c = t0 + c - c0
        self.recorder.final(self.sample_of_seq[seq], h, logits, c, tok)


def declare_ops_absent(recorder: TraceRecorder, args, why: dict | None = None, how: dict | None = None) -> None:
    """Tell a trace recording op-level states which ops the model never computes (ModelArgs.ops_not_computed), which
    the engine cannot produce (``why``: {op name: reason}) and how the engine computes an op where its code makes
    the rounding known (``how``: {op name: words}, read by the comparison's hints); nothing when it records none."""
    ops = getattr(recorder, "ops", None)
    if ops is not None:
        for name, reason in {**(why or {}), **args.ops_not_computed()}.items():  # the model's own reason first
            ops.absent(name, reason)
        ops.how.update(how or {})


def call_routing(forced: dict, samples) -> dict:
    """Routing replay in one call's terms: {layer: {(sequence, token index): experts}} from the trace's
    {layer: {(sample, token index): experts}}."""
    seq_of = {int(s): q for q, s in enumerate(samples)}
    return {layer: {(seq_of[s], t): ids for (s, t), ids in cells.items() if s in seq_of}
            for layer, cells in forced.items()}


def forced_list(forced: dict) -> list:
    """The forced cells as a trace's record lists them."""
    return [{"layer": layer, "sample": s, "token": t, "experts": list(ids)}
            for layer, cells in sorted(forced.items()) for (s, t), ids in sorted(cells.items())]


class SkippedKV(NamedTuple):
    """Fault row 2: layer ``layer`` does not write token ``token`` of the call's sequence ``seq``."""
    layer: int
    seq: int
    token: int


@dataclass(frozen=True)
class Faults:
    """A call's deliberate §2.11 faults; each changes execution, never the model (our engine applies them:
    engine/native/faults.py)."""
    unmasked_padding: bool = False  # row 5: padding keys visible
    masked_row_softmax: bool = False  # row 7: no sentinel, a fully masked padding row enters softmax
    last_column: bool = False  # row 1: gather the rectangle's last column
    head_map: tuple | None = None  # row 4: query head -> KV head map other than ⌊h·H_kv/H_q⌋
    skip_kv: SkippedKV | None = None  # row 2: one cache entry not written
    window_shift: int = 0  # sliding-window layers see this many more keys (1: the window applied off by one)
    router: str | None = None  # a mixture of experts' router or shared expert computed wrongly (config ROUTER_FAULTS)
    decode_position: bool = False  # a decode step uses the previous position
    decode_stale_cache: bool = False  # a decode step reads the cache without its own new entry
    decode_mask: bool = False  # a left-padded row's padding keys are visible to its decode steps (only)


@dataclass
class Call:
    """One prefill call: its rectangle, any reused prefixes per sequence, where its rows land, its faults."""
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor | None
    history: dict
    samples: list  # trace sample of each sequence
    runs: list[TraceRun]
    faults: Faults = Faults()


def _rect(rows, positions, samples, side: str, pad_id: int, history=None):
    """A padded rectangle of the given rows; side 'left' or 'right'."""
    n = max(len(r) for r in rows)
    B = len(rows)
    ids = torch.full((B, n), pad_id, dtype=torch.long)
    mask = torch.zeros((B, n), dtype=torch.long)
    pos = torch.zeros((B, n), dtype=torch.long)
    for b, (row, p) in enumerate(zip(rows, positions)):
        c0 = n - len(row) if side == "left" else 0
        ids[b, c0:c0 + len(row)] = torch.tensor(row)
        mask[b, c0:c0 + len(row)] = 1
        pos[b, c0:c0 + len(row)] = torch.tensor(p)
    runs = [TraceRun(row=b, c0=0, c1=n, sample=samples[b], t0=0) for b in range(B)]
    return Call(ids=ids, mask=mask, positions=pos, segments=None, history=history or {}, samples=list(samples),
                runs=runs)


def _packed(rows, positions, samples, history=None):
    ids = torch.tensor([[t for r in rows for t in r]])
    pos = torch.tensor([[p for ps in positions for p in ps]])
    seg = torch.tensor([[i for i, r in enumerate(rows) for _ in r]])
    runs, at = [], 0
    for i, r in enumerate(rows):  # cu_seqlens = cumulative lengths
        runs.append(TraceRun(row=0, c0=at, c1=at + len(r), sample=samples[i], t0=0))
        at += len(r)
    return Call(ids=ids, mask=torch.ones_like(ids), positions=pos, segments=seg, history=history or {},
                samples=list(samples), runs=runs)


def plan_calls(rows, positions, samples, batching: str, pad_id: int, history_of=None) -> list[Call]:
    """Split the samples into prefill calls for one batching mode."""
    history_of = history_of or {}
    if batching == "unbatched":
        return [_rect([r], [p], [s], "right", pad_id, {0: history_of[s]} if s in history_of else None)
                for r, p, s in zip(rows, positions, samples)]
    hist = {i: history_of[s] for i, s in enumerate(samples) if s in history_of}
    if batching == "packed":
        return [_packed(rows, positions, samples, hist)]
    return [_rect(rows, positions, samples, batching, pad_id, hist)]
