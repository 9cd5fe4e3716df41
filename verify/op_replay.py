"""Replayed ops judged (``--replay-ops``): which op differs itself and which only inherits a difference.

The candidate engine ran each of its ops on the reference's input to that op (engine/shared/op_replay.py); each
replayed output is compared bit for bit with the reference's own output of that op. An op whose replayed output
is bitwise equal computes exactly as the reference does: any difference it shows in the candidate's own forward
is inherited from an earlier op. An op whose replayed output still differs computes differently itself; where the
cause is known from the engines' code it is named (verify/op_hints.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..dumps.schema import OP_NAMES
from .bitwise import Bits, percent
from .op_hints import op_cause


@dataclass
class OpReplay:
    name: str
    replayed: Bits
    own: Bits | None = None  # the op in the candidate's own forward against the reference's (--exact's)
    cause: str | None = None

    @property
    def verdict(self) -> str:
        """'differs itself', 'inherits' (equal when fed the reference's input, not in its own forward) or 'equal'."""
        if not self.replayed.exact:
            return "differs itself"
        return "inherits" if self.own is not None and not self.own.exact else "equal"

    def as_dict(self) -> dict:
        return {"op": self.name, "verdict": self.verdict, "replayed": self.replayed.as_dict(),
                "own": None if self.own is None else self.own.as_dict(), "cause": self.cause}


@dataclass
class ReplayResult:
    engine: str
    layers: list = field(default_factory=list)  # (layer, [OpReplay, ...])
    not_replayed: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "not_replayed": dict(self.not_replayed), "notes": list(self.notes),
                "layers": [{"layer": layer, "ops": [o.as_dict() for o in ops]} for layer, ops in self.layers]}

    def op(self, layer: int, name: str) -> OpReplay | None:
        return next((o for lay, ops in self.layers if lay == layer for o in ops if o.name == name), None)


def judge_replay(engine: str, out: dict, not_replayed: dict, notes: list, out_dtype: str, n_samples: int,
                 reference: Callable, ref_dtype: str, exact=None, ref_meta: dict | None = None,
                 cand_meta: dict | None = None) -> ReplayResult:
    """``out[(layer, op)]``: the replayed outputs, one array per replayed sample (``n_samples``); ``reference(layer,
    op, i)``: the reference's own output for sample i (same shape); ``exact``: the own-forward comparison
    (verify/exact.py ExactResult), for each op's own share."""
    res = ReplayResult(engine, not_replayed=dict(not_replayed), notes=list(notes))
    own = {} if exact is None else {(lb.layer, t.name): t.bits for lb in exact.layers for t in lb.tensors}
    for layer in sorted({lay for lay, _ in out}):
        ops = []
        for name in OP_NAMES:
            got = out.get((layer, name))
            if got is None:
                continue
            b = Bits()
            for i in range(n_samples):
                r = reference(layer, name, i)
                if r is not None and got[i] is not None:
                    b.add(r, got[i], ref_dtype, out_dtype)
            o = OpReplay(name, b, own.get((layer, name)))
            if not b.exact:
                o.cause = op_cause(name, layer, ref_meta or {}, cand_meta or {})
            ops.append(o)
        res.layers.append((layer, ops))
    return res


def replay_lines(result: ReplayResult) -> list:
    """Per layer: the ops that differ themselves (with their shares) and those that only inherit; each known
    cause once; what could not be replayed."""
    lines, causes = [], {}
    for layer, ops in result.layers:
        itself = [o for o in ops if o.verdict == "differs itself"]
        inherit = [o.name for o in ops if o.verdict == "inherits"]
        equal = [o.name for o in ops if o.verdict == "equal"]
        parts = []
        if itself:
            parts.append("differ themselves: " + ", ".join(
                f"{o.name} {percent(o.replayed.share)} (max {o.replayed.max_ulp:.0f} ULP)" for o in itself))
        if inherit:
            parts.append("inherit only (100% when fed the reference's input): " + ", ".join(inherit))
        if equal:
            parts.append("bitwise equal: " + ", ".join(equal))
        lines.append(f"replay on {result.engine}, layer {layer}: " + "; ".join(parts))
        for o in itself:
            if o.cause:
                causes.setdefault(o.cause, []).append(o.name)
    for cause, names in causes.items():
        lines.append(f"replay: {', '.join(dict.fromkeys(names))}: {cause}")
    for name, why in result.not_replayed.items():
        lines.append(f"not replayed: {name} ({why})")
    lines += [f"replay: {n}" for n in result.notes]
    return lines
