"""Small hand-made traces for the verify/ unit tests: every value chosen here, written through the public
Recorder into memory (no engine, no disk), and the Context the comparers take.

A ``Spec`` holds one side's arrays by sample, in the cells that sample computes: ``pad[s]`` padding cells
first (left padding), then its tokens ``start[s]..n-1`` (``start[s] > 0``: a reused prefix, recorded as a
reuse hit). Tests copy a spec, change the candidate's arrays, record both and compare; the expected
numbers are computed from the arrays themselves, by token index, in float64.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.verify.align import Alignment
from prefill_diff.verify.context import Context
from prefill_diff.dumps.schema import TOL_KINDS
from prefill_diff.verify.tolerance import Policy, Tolerance

DIM, N_HEADS, N_KV, HEAD_DIM, VOCAB = 8, 2, 2, 4, 16
SAMPLES = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]
STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")
TOL = Tolerance(1e-3, 1e-3)


def args(**kw) -> dict:
    return {"dim": DIM, "n_layers": 1, "n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HEAD_DIM,
            "vocab_size": VOCAB, **kw}


@dataclass
class Spec:
    samples: list
    pad: list
    start: list
    meta: dict
    states: dict = field(default_factory=dict)  # (layer, name) -> [per sample (pad + computed, W)]
    caches: dict = field(default_factory=dict)  # layer -> [per sample [keys (H, T, D), values, positions (T,)]]
    finals: list = field(default_factory=list)  # per sample [norm_last (dim,), logits (vocab,), column, token]

    @property
    def n_layers(self) -> int:
        return self.meta["model"]["args"]["n_layers"]

    def copy(self) -> "Spec":
        return copy.deepcopy(self)

    def row(self, name: str, s: int, token: int, layer: int = 0) -> np.ndarray:
        """The state row of sample s's token ``token`` (a view: writing to it changes the spec)."""
        return self.states[(layer, name)][s][self.pad[s] + token - self.start[s]]

    def tokens(self, s: int) -> range:
        return range(self.start[s], len(self.samples[s]))

    def relayout(self, pad: list) -> "Spec":
        """The same values per token in other cells: ``pad`` padding cells before each sample's tokens (new
        padding rows get values of their own)."""
        out = self.copy()
        rng = np.random.default_rng(99)
        for key, per in out.states.items():
            for s, x in enumerate(per):
                own = x[self.pad[s]:]
                per[s] = np.concatenate([rng.standard_normal((pad[s], x.shape[1])).astype(x.dtype), own])
        for s, fin in enumerate(out.finals):
            fin[2] = pad[s] + len(self.samples[s]) - self.start[s] - 1
        out.pad = list(pad)
        return out


def make_spec(samples=SAMPLES, *, pad=None, start=None, n_layers: int = 1, seed: int = 0, heads: bool = True,
              dim: int = DIM, n_kv: int = N_KV, head_dim: int = HEAD_DIM, **meta) -> Spec:
    """Random values (every row differs) for every state, cache and final output of ``samples``."""
    rng = np.random.default_rng(seed)
    S = len(samples)
    pad, start = list(pad or [0] * S), list(start or [0] * S)
    m = {"model": {"args": args(n_layers=n_layers, dim=dim, n_kv_heads=n_kv, head_dim=head_dim)},
         "engine": {"dtype": "float32"}}
    for k, v in meta.items():
        if isinstance(v, dict) and isinstance(m.get(k), dict):
            m[k] = {**m[k], **v}
        else:
            m[k] = v
    reuse = [{"sample": s, "prefix_len": start[s], "hit": True} for s in range(S) if start[s]]
    if reuse:
        m.setdefault("record", {})["reuse"] = reuse
    spec = Spec([list(x) for x in samples], pad, start, m)
    widths = {name: dim for name in STATES}
    if heads:
        widths["attn_heads"] = N_HEADS * head_dim
    for layer in range(n_layers):
        for name, w in widths.items():
            spec.states[(layer, name)] = [rng.standard_normal((pad[s] + len(samples[s]) - start[s], w))
                                          .astype(np.float32) for s in range(S)]
        spec.caches[layer] = [[rng.standard_normal((n_kv, len(samples[s]), head_dim)).astype(np.float32),
                               rng.standard_normal((n_kv, len(samples[s]), head_dim)).astype(np.float32),
                               np.arange(len(samples[s]))] for s in range(S)]
    for s in range(S):
        logits = rng.permutation(VOCAB).astype(np.float32)  # distinct values 0..V-1: clear top ids
        spec.finals.append([rng.standard_normal(dim).astype(np.float32), logits,
                            pad[s] + len(samples[s]) - start[s] - 1, len(samples[s]) - 1])
    return spec


def record(spec: Spec, level: str = "full", edit=None, name: str = "trace", **kw) -> Trace:
    """The spec through the Recorder, in memory; ``edit(f)`` may change the finished file before it is read."""
    S = len(spec.samples)
    n_cols = max(spec.pad[s] + len(spec.samples[s]) - spec.start[s] for s in range(S))
    rec = Recorder(None, level, **kw)
    rec.begin(spec.samples, n_cols, spec.meta)
    for s, toks in enumerate(spec.samples):
        p, a, n = spec.pad[s], spec.start[s], len(toks)
        ids = np.concatenate([np.zeros(p, np.int64), np.asarray(toks[a:])])
        valid = np.concatenate([np.zeros(p), np.ones(n - a)])
        positions = np.concatenate([np.zeros(p, np.int64), np.arange(a, n)])
        token_index = np.concatenate([np.full(p, -1), np.arange(a, n)])
        rec.inputs(s, 0, ids, valid, positions, token_index)
    for layer in range(spec.n_layers):
        for (lay, nm), per in spec.states.items():
            if lay == layer:
                for s, x in enumerate(per):
                    rec.state(layer, nm, s, 0, x)
        for s, (k, v, pos) in enumerate(spec.caches[layer]):
            rec.cache(layer, s, k, v, pos)
        rec.layer_done(layer)
    for s, (h, z, col, tok) in enumerate(spec.finals):
        rec.final(s, h, z, column=col, token_index=tok)
    rec.close()
    if edit is not None:
        edit(rec.f)
    return Trace(rec.f, name=name)


def policy(tol: Tolerance = TOL, **kw) -> Policy:
    """One tolerance for every kind."""
    return Policy("test", {k: tol for k in TOL_KINDS}, **kw)


def context(ref: Trace, cand: Trace, pol: Policy | None = None, calib=None) -> Context:
    align = Alignment(ref, cand)
    return Context(ref, cand, pol or policy(), align, calib, notes=list(align.notes))


def element_rule(a, b, tol: Tolerance) -> np.ndarray:
    """The element rule, naively in float64: True where |b - a| > atol + rtol·|a| + ntol·rms(a's row)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bad = np.zeros(a.shape, dtype=bool)
    for i in range(a.shape[0]):
        rms = np.sqrt(np.mean(a[i] ** 2))
        for j in range(a.shape[1]):
            bad[i, j] = abs(b[i, j] - a[i, j]) > tol.atol + tol.rtol * abs(a[i, j]) + tol.ntol * rms
    return bad
