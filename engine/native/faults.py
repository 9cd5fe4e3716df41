"""Deliberate faults (contract §2.11): each changes execution, never the model.

The engine applies them around the model (prefill.py): the mask, the cache writes, the head map
and the gather. ``native_engine.faults_for`` turns a run's [fault] into one call's ``Faults`` (engine/calls.py).
"""
from __future__ import annotations

import torch

from .attention import AttentionMask
from ..calls import Faults, SkippedKV
from ..coords import CacheWrite, Cell


# -- applied by the engine, around the model (prefill.ForwardStep and Engine._finish)

def padding_visible_mask(q_tok, q_seq, row_seqs: list[list[int]], c0: int, c1: int, sentinel: bool) -> AttentionMask:
    """Row 5: keys ordered by physical column, validity ignored: padding keys are visible. A padding cell
    counts as its row's (first) sequence; a valid cell stays in its own, so the sequences packed into one row
    still see only themselves."""
    col = torch.arange(c0, c1).expand_as(q_tok)
    row_seq = torch.tensor([s[0] if s else -1 for s in row_seqs])[:, None].expand_as(q_seq)
    seq = torch.where(q_seq >= 0, q_seq, row_seq)
    return AttentionMask(torch.where(q_tok >= 0, col, -1), col, seq, seq, sentinel)


def skipped_kv_keep(skip: SkippedKV | None, layer: int, w: CacheWrite):
    """Row 2: which of a write's cells reach the cache (a bool mask), or None when all of them do."""
    if skip is None:
        return None
    skip_layer, seq, token = skip
    if skip_layer != layer or seq != w.seq or not w.tok0 <= token < w.tok0 + w.e - w.a:
        return None
    return torch.arange(w.e - w.a) != token - w.tok0


def rewire_heads(out, kernel, q_rot, keys, values, mask, head_map: list[int], standard: list[int]) -> None:
    """Row 4: query heads whose KV head is not g(h) are recomputed alone (in place); the others stay
    bit-identical."""
    wrong = [h for h in range(len(standard)) if head_map[h] != standard[h]]
    if wrong:
        kv = [head_map[h] for h in wrong]
        out[:, wrong] = kernel(q_rot[:, wrong], keys[:, kv], values[:, kv], mask)


def decode_positions(positions, decoding, faults: Faults):
    """decode-position: a decode step rotates and caches its token at the previous position (positions, as
    given, elsewhere)."""
    if decoding is None or not faults.decode_position:
        return positions
    return positions - decoding.to(positions.dtype)


def stale_keys(k_tok, k_seq, q_tok, q_seq, decoding, faults: Faults):
    """decode-stale-cache: a decode step reads the cache without the entry it has just written (its own token's
    key is hidden from it); every other forward reads the cache as it is. A decode step is one column: one query
    cell per row."""
    if decoding is None or not faults.decode_stale_cache or not bool(decoding.any()):
        return k_tok
    own = decoding[:, :1] & (k_tok == q_tok[:, :1]) & (k_seq == q_seq[:, :1])
    return torch.where(own, torch.full_like(k_tok, -1), k_tok)


class PaddingKV:
    """decode-mask: the padding cells' keys and values a call's prompt forward computed (a cache that stored its
    padding slots), per layer, shown to that row's decode steps as if the mask let them through."""

    def __init__(self):
        self.kv: dict = {}  # layer -> [(keys, values) (H_kv, P, d_h) per row]

    def keep(self, layer: int, q_tok, k_rot, v) -> None:
        """The padding cells of a forward that decodes nothing (the prompt's)."""
        if layer not in self.kv:
            pad = q_tok < 0
            self.kv[layer] = [(k_rot[b][:, pad[b]], v[b][:, pad[b]]) for b in range(q_tok.shape[0])]

    def shown(self, layer: int, rows, q_seq, decoding):
        """``rows`` (a cache read) with each decoding row's padding keys added, visible to its query."""
        kept = self.kv.get(layer)
        if kept is None or decoding is None or not bool(decoding.any()):
            return rows
        P = max(k.shape[1] for k, _ in kept)
        if P == 0:
            return rows
        B, H, _, D = rows.keys.shape
        pk, pv = rows.keys.new_zeros((B, H, P, D)), rows.values.new_zeros((B, H, P, D))
        tok = torch.full((B, P), -1, dtype=rows.k_tok.dtype)
        for b, (k, v) in enumerate(kept):
            if bool(decoding[b].any()) and k.shape[1]:
                pk[b, :, :k.shape[1]], pv[b, :, :k.shape[1]] = k, v
                tok[b, :k.shape[1]] = 0  # token 0: seen by every query of its sequence
        seq = q_seq[:, :1].expand(B, P)
        return type(rows)(torch.cat([rows.keys, pk], 2), torch.cat([rows.values, pv], 2),
                          torch.cat([rows.k_tok, tok], 1), torch.cat([rows.k_seq, seq], 1))


def gathered_cell(last: Cell, n_cols: int, faults: Faults) -> Cell:
    """gather_last_valid_position; row 1 takes the rectangle's last column instead."""
    return last._replace(col=n_cols - 1) if faults.last_column else last
