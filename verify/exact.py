"""Bit for bit: every tensor both traces hold, op by op, layer by layer (``--exact``).

For each layer, in the order the layer computes them, every layer state, cache tensor and op-level state (format
1.4, ``--level ops``) both traces recorded is compared bit for bit over the cells both computed (aligned by
logical position, verify/align.py), then the final norm, the logits and a response's logits. The first tensor whose
bits part is the exact verdict's break: its layer, its name, where (sample, position, decode step), the share of
elements bitwise equal and the largest ULP distance (verify/bitwise.py). Every layer also says the first op where
its bits part, which a trainer-vs-rollout audit reads as its table. Bitwise needs every element: full traces.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dumps.reader import Trace, TraceError
from ..dumps.schema import FINAL_TENSORS, OP, OP_NAMES, TENSOR
from .bitwise import Bits, compare
from .breaks import Break

# One layer's tensors in the order it computes them: layer states (schema LAYER_TENSORS), the cache and the ops
# (schema OP_TENSORS) interleaved where each is computed.
LAYER_ORDER = ("layer_input", "attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "cache_keys",
               "cache_values", "attn_core", "attn_heads", "o_proj", "attn_update", "attn_residual", "mid", "mlp_norm",
               "gate", "up", "act_mul", "down", "mlp_update", "layer_output")
BITS_BEFORE = ("value", "top_ids")  # the breaks an exact verdict's first parting bits come at or before
assert set(OP_NAMES) <= set(LAYER_ORDER) and set(TENSOR) <= set(LAYER_ORDER)


@dataclass
class Where:
    """The first element whose bits part in a tensor: the reference's sample, its token index, a decode step."""
    sample: int
    position: int | None
    step: int | None = None


@dataclass
class TensorBits:
    name: str
    bits: Bits
    where: Where | None = None

    def as_dict(self) -> dict:
        d = {"tensor": self.name, "op": self.name in OP, **self.bits.as_dict()}
        if self.where is not None:
            d.update(sample=self.where.sample, position=self.where.position, decode_step=self.where.step)
        return d


@dataclass
class LayerBits:
    layer: int
    tensors: list = field(default_factory=list)

    @property
    def first(self) -> TensorBits | None:
        """The first tensor whose bits part (None: every tensor compared is bitwise equal)."""
        return next((t for t in self.tensors if not t.bits.exact), None)

    def as_dict(self) -> dict:
        f = self.first
        return {"layer": self.layer, "first_part": None if f is None else f.name,
                "tensors": [t.as_dict() for t in self.tensors]}


@dataclass
class ExactResult:
    layers: list
    final: list
    not_compared: dict  # name -> why (recorded by one side only, or by neither)

    @property
    def first(self) -> tuple[int | None, TensorBits] | None:
        """(layer or None for the final stage, the tensor) of the first bits that part."""
        for lb in self.layers:
            if lb.first is not None:
                return lb.layer, lb.first
        f = next((t for t in self.final if not t.bits.exact), None)
        return None if f is None else (None, f)

    def brk(self) -> Break | None:
        got = self.first
        return None if got is None else self.break_at(*got)

    def layer_break(self, layer: int) -> Break | None:
        """The break of layer ``layer``'s first tensor whose bits part (None: bitwise equal, or not compared)."""
        lb = next((x for x in self.layers if x.layer == layer), None)
        return None if lb is None or lb.first is None else self.break_at(layer, lb.first)

    @staticmethod
    def break_at(layer: int | None, t: TensorBits) -> Break:
        w = t.where or Where(None, None)
        return Break(stage="layer" if layer is not None else "final", kind="bits", layer=layer, tensor=t.name,
                     sample=w.sample, position=w.position, max_abs_error=t.bits.max_abs,
                     message=f"bits part: {t.bits.words()}")

    def as_dict(self) -> dict:
        got = self.first
        return {"bitwise_equal": got is None,
                "first": None if got is None else {"layer": got[0], **got[1].as_dict()},
                "layers": [lb.as_dict() for lb in self.layers], "final": [t.as_dict() for t in self.final],
                "not_compared": dict(self.not_compared)}


def _dataset(view, name: str):
    if name in OP:
        return view.op(name)
    if name.startswith("cache_"):
        return view.cache(name[len("cache_"):])
    return view.state(name)


def _bits(name: str, parts, rd: str, cd: str) -> TensorBits:
    """Bits over ``parts``, each (reference array, candidate array, where_of): ``where_of(flat index)`` places the
    first element whose bits part, in the first part that has one."""
    total, where = Bits(), None
    for r, k, where_of in parts:
        b = compare(r, k, rd, cd)
        if where is None and b.first is not None:
            where = where_of(b.first)
        total.merge(b)
    return TensorBits(name, total, where)


def _rows(name: str, ref: Trace, cand: Trace, rds, cds, pairs, cells, steps) -> TensorBits:
    """Bits of a per-cell tensor [S, C, W] over every matched pair's aligned cells."""
    def parts():
        for rs, cs in pairs:
            c = cells[rs]
            if c.tokens.size:
                r = rds[rs][c.ref_cols]

                def where_of(i, rs=int(rs), toks=c.tokens, w=max(r.shape[-1], 1)):
                    tok = int(toks[i // w])
                    return Where(rs, tok, steps.get((rs, tok)))
                yield r, cds[cs][c.cand_cols], where_of
    return _bits(name, parts(), ref.source_dtype(rds), cand.source_dtype(cds))


def _cache(name: str, ref: Trace, cand: Trace, rv, cv, rds, cds, pairs) -> TensorBits:
    """Bits of a cache tensor [S, H, T, D] over each pair's common cache length, slot by slot in logical order."""
    rl, cl, rpos = rv.cache_lengths, cv.cache_lengths, rv.cache_positions

    def parts():
        for rs, cs in pairs:
            n = int(min(rl[rs], cl[cs]))
            if n:
                r = rds[rs, :, :n]
                yield r, cds[cs, :, :n], lambda i, rs=int(rs), n=n, d=r.shape[-1]: Where(rs, int(rpos[rs, (i // d) % n]))
    return _bits(name, parts(), ref.source_dtype(rds), cand.source_dtype(cds))


def compare_exact(ref: Trace, cand: Trace, pairs, cells, steps: dict) -> ExactResult:
    """Every tensor both traces hold, bit for bit. ``pairs``/``cells``: the alignment (verify/align.py);
    ``steps``: (reference sample, token index) -> the decode step that computed it (either side's)."""
    low = [f"{t.name} ({t.level})" for t in (ref, cand) if t.level != "full"]
    if low:
        raise TraceError(f"a bitwise comparison (--exact) needs every element: full traces (got {', '.join(low)})")
    layers, not_compared = [], {}
    for name, why in _absent(ref, cand).items():
        not_compared[name] = why
    for i in range(min(ref.n_layers, cand.n_layers)):
        rv, cv = ref.layer(i), cand.layer(i)
        lb = LayerBits(i)
        for name in LAYER_ORDER:
            rds, cds = _dataset(rv, name), _dataset(cv, name)
            if rds is None or cds is None:
                if (rds is None) != (cds is None) and name not in not_compared:
                    side = "reference" if rds is None else "candidate"
                    not_compared[name] = f"not recorded by the {side} (layer {i})"
                continue
            lb.tensors.append(_cache(name, ref, cand, rv, cv, rds, cds, pairs) if name.startswith("cache_") else
                              _rows(name, ref, cand, rds, cds, pairs, cells, steps))
        layers.append(lb)
    return ExactResult(layers, _final(ref, cand, pairs), not_compared)


def _final(ref: Trace, cand: Trace, pairs) -> list:
    out = []
    for name in reversed(FINAL_TENSORS):  # the final norm, then the logits computed from it
        rf, cf = ref.final.get(name), cand.final.get(name)
        if rf is not None and cf is not None:
            gathered = ref.final["gather_token"]
            parts = ((rf[rs], cf[cs], lambda i, rs=int(rs): Where(rs, int(gathered[rs]))) for rs, cs in pairs)
            out.append(_bits(name, parts, ref.source_dtype(ref.f[f"final/{name}"]),
                             cand.source_dtype(cand.f[f"final/{name}"])))
    rr, cr = ref.response, cand.response
    if rr is not None and cr is not None:
        def parts():
            for rs, cs in pairs:
                rt, ct = rr["token_index"][rs], cr["token_index"][cs]
                common, ri, ci = np.intersect1d(rt[rt >= 0], ct[ct >= 0], return_indices=True)
                if common.size:
                    ri, ci = np.flatnonzero(rt >= 0)[ri], np.flatnonzero(ct >= 0)[ci]
                    yield rr["logits"][rs][ri], cr["logits"][cs][ci], \
                        lambda i, rs=int(rs), common=common: Where(rs, int(common[i // rr["logits"].shape[-1]]))
        out.append(_bits("response_logits", parts(), ref.source_dtype(ref.f["response/logits"]),
                         cand.source_dtype(cand.f["response/logits"])))
    return out


def _absent(ref: Trace, cand: Trace) -> dict:
    """The ops either side declared it cannot produce, with why (meta.record.ops)."""
    out = {}
    for t, side in ((ref, "reference"), (cand, "candidate")):
        for name, why in ((t.ops or {}).get("absent") or {}).items():
            out.setdefault(name, f"{side}: {why}")
    if ref.ops is None or cand.ops is None:
        missing = [s for t, s in ((ref, "reference"), (cand, "candidate")) if t.ops is None]
        out["ops"] = f"the {' and the '.join(missing)} recorded no op-level states (--level ops records them)"
    return out
