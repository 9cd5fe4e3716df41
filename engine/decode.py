"""Decode as the torch engines run it: the most extreme chunking there is, one column per forward against the cache.

A call's columns are computed in forwards: the whole rectangle at once, chunks of ``chunk_size`` columns, or —
for a sequence whose response is decoded — its prompt first, then each response token alone (a decode step that
writes its own K/V into the cache and reads the cache back, contract §2.8's cache used for real). A left-padded
batch aligns its samples' last tokens, so a column holds one step of every sample whose response is that long.
What each cell's forward was — its phase, its decode step, the cache length it read — is what a trace's rows say.
"""
from __future__ import annotations

import torch

PREFILL, DECODE = 0, 1  # a cell's phase, as a trace's inputs/phase holds it


def forward_starts(tok: torch.Tensor, seq: torch.Tensor, n: int, chunk: int, decode_from: dict) -> list[int]:
    """The first column of each forward: chunks of ``chunk`` columns up to the first column holding a token a
    sequence decodes (token index >= ``decode_from[seq]``), then one column per forward."""
    first = n
    for s, t0 in decode_from.items():
        cols = ((seq == s) & (tok >= t0)).nonzero()
        if cols.numel():
            first = min(first, int(cols[:, 1].min()))
    return list(range(0, first, chunk)) + list(range(first, n))


def forward_facts(tok: torch.Tensor, seq: torch.Tensor, starts: list[int], decode_from: dict):
    """Per cell (B, n): its phase (PREFILL, DECODE), its decode step (-1 outside decode) and the cache length its
    forward read (its sequence's tokens in the cache once the forward wrote; 0 for padding)."""
    valid = tok >= 0
    phase = torch.zeros(tok.shape, dtype=torch.int8)
    step = torch.full(tok.shape, -1, dtype=torch.int32)
    for s, t0 in decode_from.items():
        dec = (seq == s) & (tok >= t0)
        phase[dec] = DECODE
        step[dec] = (tok[dec] - t0).to(torch.int32)
    cache_len = torch.zeros(tok.shape, dtype=torch.int32)
    ends = starts[1:] + [tok.shape[1]]
    for a, b in zip(starts, ends):
        part, pseq = tok[:, a:b], seq[:, a:b]
        for s in pseq[part >= 0].unique().tolist():
            mine = (pseq == s) & (part >= 0)
            cache_len[:, a:b][mine] = int(part[mine].max()) + 1
    cache_len[~valid] = 0
    return phase, step, cache_len


def decoding_columns(tok: torch.Tensor, seq: torch.Tensor, c0: int, c1: int, decode_from: dict) -> torch.Tensor:
    """(B, c1 - c0): the cells of columns [c0, c1) that are decode steps."""
    part, pseq = tok[:, c0:c1], seq[:, c0:c1]
    out = torch.zeros(part.shape, dtype=torch.bool)
    for s, t0 in decode_from.items():
        out |= (pseq == s) & (part >= t0)
    return out


def response_rows(prep, call) -> dict:
    """A call's response rows in its sequences' terms (engine/prepared.py's Prepared, engine/calls.py's Call):
    where each decodes from (a decoding run) and where the logits predicting its response begin (every run with a
    response); empty without a response."""
    if "response" not in prep.record:
        return {}
    starts = {q: prep.prompt_lengths[s] for q, s in enumerate(call.samples)}
    return {"decode_from": starts if prep.side.run.decode else None,
            "logits_from": {q: t - 1 for q, t in starts.items()}}
