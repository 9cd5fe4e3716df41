"""The model's whole identity beyond its shapes, compared between two traces.

Shapes (``align.ARCH_KEYS``) decide whether two traces can be compared at all. The keys here do not
change a tensor's shape but do change what the model computes: two traces that differ in one of them
compare, and the difference is the first thing a report says (a note and the diagnosis hint), because it
explains a break better than any numeric cause.
"""
from __future__ import annotations

# key -> (what it is, where a difference first shows: (layer 0 tensors) or "final")
IDENTITY_KEYS = {
    "arch": ("architecture family", ("cache_keys", "cache_values", "attn_update")),
    "rope_theta": ("RoPE base", ("cache_keys", "attn_update", "attn_heads")),
    "rope_scaling": ("RoPE scaling", ("cache_keys", "attn_update", "attn_heads")),
    "norm_eps": ("RMSNorm epsilon", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "hidden_act": ("MLP activation", ("mlp_update",)),
    "qkv_bias": ("Q/K/V bias", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "lm_head_bias": ("unembedding bias", "final"),
    "tie_embeddings": ("tied embeddings", "final"),
}
ADAPTER_FIRST = ("cache_keys", "cache_values", "attn_update", "attn_heads")  # LoRA on wq, wk, wv, wo


def _shown(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_shown(x)}" for k, x in sorted(v.items())) + "}" if v else "none"
    if isinstance(v, str):
        return repr(v)  # foreign text: quoted, control characters escaped
    return "none" if v is None else str(v)


def _adapter(a) -> str:
    if not a:
        return "none"
    digest = str(a.get("digest", "?"))
    return f"{a.get('id', '?')!r} (digest {digest[:19]}…, rank {a.get('rank', '?')})"


def differences(ref_meta: dict, cand_meta: dict) -> list[dict]:
    """[{key, what, reference, candidate, first}] for every identity key that differs (absent keys: skipped,
    a trace from another writer may not record them)."""
    rm, cm = ref_meta.get("model") or {}, cand_meta.get("model") or {}
    ra, ca = rm.get("args") or {}, cm.get("args") or {}
    out = []
    for key, (what, first) in IDENTITY_KEYS.items():
        if key not in ra or key not in ca:
            continue
        r, c = ra[key], ca[key]
        if key == "rope_scaling":
            r, c = dict(r or {}), dict(c or {})
        if r != c:
            out.append({"key": key, "what": what, "reference": _shown(r), "candidate": _shown(c), "first": first})
    r, c = rm.get("adapter"), cm.get("adapter")
    if ("adapter" in rm or "adapter" in cm) and (
            (r or {}).get("id"), (r or {}).get("digest")) != ((c or {}).get("id"), (c or {}).get("digest")):
        out.append({"key": "adapter", "what": "LoRA adapter", "reference": _adapter(r), "candidate": _adapter(c),
                    "first": ADAPTER_FIRST})
    return out


def note(d: dict) -> str:
    return (f"MODEL IDENTITY DIFFERS: {d['key']} ({d['what']}) is {d['reference']} in the reference, "
            f"{d['candidate']} in the candidate: the two sides do not run the same model")


def hint(diffs: list[dict], fb) -> str | None:
    """The diagnosis for a break when the identities differ: the difference, and whether the break sits where
    that difference first shows."""
    if not diffs or fb is None or fb.stage == "metadata":
        return None
    where = (f"layer-{fb.layer} {fb.tensor}" if fb.stage == "layer" else f"final {fb.tensor}") + " break"
    parts = []
    for d in diffs:
        first = d["first"]
        fits = (fb.stage == "final") if first == "final" else (fb.stage == "layer" and fb.layer == 0 and
                                                                fb.tensor in first)
        says = f"{d['key']} differs (reference {d['reference']} vs candidate {d['candidate']})"
        parts.append(f"{says}: consistent with the {where}" if fits else
                     f"{says}: it would first show at " +
                     ("the final logits" if first == "final" else f"layer 0 {'/'.join(first)}") +
                     f", the first break is the {where}")
    return ("The two sides do not run the same model: " + "; ".join(parts) +
            ". Make the configurations agree before reading the break as a numeric or kernel difference.")
