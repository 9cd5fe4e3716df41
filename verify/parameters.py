"""Two traces' per-parameter digests compared: the model as each engine held it after loading ("after sync").

Each trace MAY list every parameter and buffer with its dtype, shape and content digest (``meta.parameters``,
written by engine/models/param_digests.py). When both do, tensors are matched by name:

- the FIRST parameter, in the reference's order, whose shape, dtype or digest differs is an identity difference
  (verify/identity.py): the two sides do not run the same weights. A dtype difference counts only when both sides
  ran at the same precisions (a float32 reference and a bfloat16 candidate hold every weight in another dtype on
  purpose; their values are then not compared digest by digest);
- every buffer whose dtype differs is one too, and RoPE's ``inv_freq`` gets a named note: a model loaded in float32
  then cast with ``.to(bfloat16)`` casts that buffer too, which a model loaded with ``dtype=bfloat16`` keeps in
  float32, and every rotation then differs;
- a name on one side only (engines name some tensors differently; ours has no RoPE buffer) is listed in a note and
  is not a difference by itself; a tensor one side holds as a parameter and the other as a buffer (int8 weights)
  is compared by neither rule.

An engine that writes no list (vLLM, llama.cpp) is said in a note: "not reported by this engine".
"""
from __future__ import annotations

import re

ANYWHERE = "anywhere"
TRAP = "a model loaded in float32 then cast casts RoPE's inv_freq too"
SHOWN = 6  # names listed per side in a note


def tensors(meta: dict) -> list | None:
    """The trace's per-parameter list, or None when it has none."""
    p = meta.get("parameters")
    t = p.get("tensors") if isinstance(p, dict) else None
    return [x for x in t if isinstance(x, dict) and "name" in x] if isinstance(t, list) else None


def _precision(meta: dict) -> tuple:
    run = (meta.get("side") or {}).get("run") or {}
    return (run.get("dtype") or (meta.get("engine") or {}).get("dtype"), run.get("weight_quant", "none"))


def _layer(name: str):
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


def differences(ref_meta: dict, cand_meta: dict) -> list[dict]:
    """Identity differences ({key, what, reference, candidate, first, says}): the first parameter that differs, and
    every buffer whose dtype differs; empty when either trace lists no digests."""
    r, c = tensors(ref_meta), tensors(cand_meta)
    if r is None or c is None:
        return []
    same_precision = _precision(ref_meta) == _precision(cand_meta)
    theirs = {t["name"]: t for t in c}
    out, param = [], None
    for t in r:
        o = theirs.get(t["name"])
        if o is None or t.get("kind") != o.get("kind"):
            continue
        name = t["name"]
        if t.get("kind") == "buffer":
            if t.get("dtype") != o.get("dtype"):
                trap = f" ({TRAP})" if name.endswith("inv_freq") else ""
                out.append({"key": "buffer", "what": name, "reference": str(t.get("dtype")),
                            "candidate": str(o.get("dtype")), "first": ANYWHERE,
                            "says": f"buffer {name}: {t.get('dtype')} in the reference, {o.get('dtype')} in the "
                                    f"candidate{trap}"})
            continue
        if param is not None:
            continue
        if t.get("shape") != o.get("shape"):
            param = ("shape", str(tuple(t.get("shape") or ())), str(tuple(o.get("shape") or ())), t)
        elif t.get("dtype") != o.get("dtype"):
            if same_precision:
                param = ("dtype", str(t.get("dtype")), str(o.get("dtype")), t)
        elif t.get("sha256") != o.get("sha256"):
            param = ("sha256", str(t.get("sha256")), str(o.get("sha256")), t)
    if param is not None:
        what, a, b, t = param
        out.insert(0, {"key": "parameter", "what": t["name"], "reference": a, "candidate": b, "first": ANYWHERE,
                       "layer": _layer(t["name"]),
                       "says": f"parameter {t['name']} differs ({what} {a} vs {b})"})
    return out


def _names(names: list) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def notes(ref_meta: dict, cand_meta: dict) -> list[str]:
    """What the per-parameter comparison could not do: a side that lists no digests (when the other does), the
    names on one side only and how many matched."""
    r, c = tensors(ref_meta), tensors(cand_meta)
    if r is None and c is None:
        return []
    if r is None or c is None:
        side, meta = ("reference", ref_meta) if r is None else ("candidate", cand_meta)
        why = (meta.get("parameters") or {}).get("not_reported") if isinstance(meta.get("parameters"), dict) else None
        engine = (meta.get("engine") or {}).get("name") or "its engine"
        return [f"per-parameter digests: the {side}'s are not reported "
                + (f"({why})" if why else f"by this engine ({engine})")
                + "; the weights are compared by their source digest only"]
    rn, cn = [t["name"] for t in r], [t["name"] for t in c]
    rs, cs = set(rn), set(cn)
    only_r, only_c = [n for n in rn if n not in cs], [n for n in cn if n not in rs]
    if not only_r and not only_c:
        return []
    matched = len(rn) - len(only_r)
    parts = [f"per-parameter digests: {matched} of {len(rn)} reference tensors matched by name"]
    if only_r:
        parts.append(f"reference only: {_names(only_r)}")
    if only_c:
        parts.append(f"candidate only: {_names(only_c)}")
    return ["; ".join(parts) + " (named on one side only: not compared)"]
