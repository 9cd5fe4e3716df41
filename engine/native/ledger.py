"""The shape ledger of contract §2.8, measured from a real prefill rather than derived.

A recorder that keeps only shapes rides along one prefill per call; the ledger lists
the logical shape of every object a layer reads and writes, and the cache total.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .settings import cache_config


@dataclass
class _Shapes:
    """Engine-side recorder that notes shapes (forward coordinates) and counts cached scalars."""
    seen: dict = field(default_factory=dict)
    cache_scalars: int = 0
    finals: list = field(default_factory=list)
    rect: tuple = ()

    def __call__(self, layer, name, shape):  # kernels report q, k, v, scores, attn_out
        self.seen.setdefault(name, tuple(shape))

    def inputs(self, ids, valid, positions, tok, seq):
        self.rect = tuple(ids.shape)

    def state(self, layer, name, x, col_start):
        self.seen.setdefault(name, tuple(x.shape))

    def cache(self, layer, seq, keys, values, positions):
        self.cache_scalars += keys.numel() + values.numel()

    def final(self, seq, h, logits, cell, tok):
        self.finals.append((seq, tok, tuple(h.shape), tuple(logits.shape)))

    def steps(self, phase, step, cache_len):  # the ledger lists shapes, not what each forward was
        pass

    def response_logits(self, seq, token_index, logits):
        pass


@dataclass
class Ledger:
    rows: list  # (object, shape)
    cache_scalars: int
    formula: str
    finals: list  # (sequence, token position, final shape, logits shape)
    rect: tuple


def ledger(prep) -> list[Ledger]:
    """One ledger per prefill call of a prepared side (engine.prepared.Prepared)."""
    args = prep.snapshot.args
    out = []
    for call in prep.calls:
        sh = _Shapes()
        prep.engine.prefill(call.ids, call.mask, call.positions, cache_config(prep.side.run), segments=call.segments,
                            history=call.history, recorder=sh, faults=call.faults, shapes=sh)
        s = sh.seen
        rows = [("layer-input residual R_l", s["layer_input"]), ("query Q", s["q"]), ("key K", s["k"]),
                ("value V", s["v"])]
        if "scores" in s:
            rows.append(("scores S (materialised)", s["scores"]))
        else:
            rows.append(("scores S", "not materialised by this kernel"))
        rows += [("attention output (before concat)", s["attn_out"]), ("layer-output residual R_l+1",
                                                                        s["layer_output"])]
        n_tokens = int(call.mask.sum()) + sum(h.length for h in call.history.values())
        formula = (f"2 x L x n x H_kv x d_h = 2 x {args.n_layers} x {n_tokens} x {args.n_kv_heads} x "
                   f"{args.head_dim} = {2 * args.n_layers * n_tokens * args.n_kv_heads * args.head_dim}")
        out.append(Ledger(rows, sh.cache_scalars, formula, sh.finals, sh.rect))
    return out
