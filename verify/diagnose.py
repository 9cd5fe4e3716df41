"""A short hint that matches the first break's pattern to the seed's §2.11 table.

Worded as a hint, never as proof: it names what the pattern is consistent with.
"""
from __future__ import annotations

import numpy as np


def _padded_samples(trace, pairs) -> set:
    inp = trace.inputs
    out = set()
    for rs, cs in pairs:
        if ((inp["computed"][cs] == 1) & (inp["valid_mask"][cs] == 0)).any():
            out.add(rs)
    return out


def _restarted(cand, pairs, layer0) -> list:
    """Candidate samples whose cache positions fall back to 0 after the start."""
    out = []
    for rs, cs in pairs:
        T = int(layer0.cache_lengths[cs])
        p = layer0.cache_positions[cs, :T]
        drops = np.flatnonzero(p[1:] <= p[:-1])
        if drops.size and p[drops[0] + 1] == 0:
            out.append((rs, int(drops[0]) + 1))
    return out


def diagnose(report, ref, cand) -> str | None:
    fb = report.first_break
    if fb is None:
        return None
    pairs = report.pairs
    rec = cand.meta.get("record") or {}
    if fb.stage == "metadata":
        return "The traces are not of the same model architecture or prompts, so no layer can be compared."
    if fb.kind == "shape":
        return f"Tensor shapes differ at layer {fb.layer}: the two runs do not use the same model configuration?"
    if fb.kind == "cache_length":
        prev = "" if fb.layer == 0 else f" (layers 0..{fb.layer - 1} agree)"
        return (f"The cache of layer {fb.layer} holds a different number of tokens{prev}: consistent with one layer "
                "skipping (or duplicating) a KV write — §2.11 row 2, 'equal lengths across layers'. "
                "The first decode step would fail on shape or read misaligned history.")
    if fb.kind == "cache_positions":
        restarts = _restarted(cand, pairs, cand.layer(0))
        reused = [o for o in rec.get("reuse") or () if o.get("hit")]
        if fb.layer == 0 and restarts and reused:
            s, at = restarts[0]
            return (f"Cache positions differ from layer 0 and restart at 0 at slot {at} of sample {s}, right after "
                    "the reused prefix: position ids restarted after prefix reuse? — §2.11 row 3, "
                    "'token/position mapping'.")
        return (f"Cache positions differ from layer {fb.layer}: the position descriptor (or its offset after a "
                "reused prefix or chunk) is not the reference's.")
    if fb.kind == "finite_mask":
        if fb.padding:
            return ("NaN/Inf first appear in padding rows: consistent with a fully masked padding query row "
                    "entering softmax (no sentinel) — §2.11 row 7; it spreads through padding keys/values into "
                    "valid rows in later layers.")
        return (f"Non-finite values appear in valid rows at {fb.tensor}: overflow in low precision, or NaN "
                "spreading from padding rows at an earlier layer?")
    if fb.kind == "top_ids":
        return ("Logits agree within tolerance but the top-ranked ids differ beyond it: check the logits' "
                "tolerance; a top-k difference alone changes greedy decoding.")
    if fb.stage == "final":
        gathers = [g for g in (report.final.gather if report.final is not None else ()) if g[2] != g[3]]
        if gathers:
            s, _, got, last = gathers[0]
            return (f"All layers agree, but the final logits of sample {s} were gathered at token {got}, "
                    f"not at its last valid token {last}: the gather took the rectangle's last column? — "
                    "§2.11 row 1, 'first-step condition prefix'.")
        return ("All layers agree but the final logits do not: the final norm, the unembedding or its bias differs?")
    # value breaks inside a layer
    forced = [o for o in rec.get("reuse") or () if o.get("forced")]
    if fb.tensor in ("cache_keys", "cache_values") and forced:
        return (f"Cache values of the reused prefix differ at layer {fb.layer}, and the candidate forced a prefix "
                f"reuse that the metadata check refused ({forced[0]['reason']}): a cache built under another "
                "adapter or weights was reused? — §2.11 row 6, 'snapshot identity'.")
    rope = [k for k in ("rope_theta", "rope_scaling") if ref.args.get(k) != cand.args.get(k)]
    if fb.tensor == "cache_keys" and rope:
        what = ", ".join(f"{k} {ref.args.get(k)!r} vs {cand.args.get(k)!r}" for k in rope)
        return (f"Keys in the cache differ from layer {fb.layer} and the two sides' RoPE parameters differ "
                f"({what}): one side's model metadata (e.g. an edited GGUF rope.freq_base) does not match "
                "the other's, so keys after position 0 are rotated by other angles.")
    if fb.tensor in ("attn_update", "attn_heads") and fb.layer == 0:
        n_heads = ref.args.get("n_heads")
        if fb.heads is not None and 0 < len(fb.heads) < (n_heads or 0):
            return (f"At layer 0 only query heads {list(fb.heads)} of {n_heads} differ while K/V agree: "
                    "consistent with a query head reading the wrong KV head (g(h) = ⌊h·H_kv/H_q⌋) — §2.11 row 4.")
        padded = _padded_samples(cand, pairs)
        bad = set(fb.samples)
        if bad and padded and bad <= padded and len(bad) < len(pairs):
            return (f"At layer 0 only padded samples {sorted(bad)} differ; unpadded samples agree: padding keys "
                    "visible to valid queries? — §2.11 row 5, 'valid-position semantics'.")
    t = fb.max_abs_error
    return (f"First value difference at layer {fb.layer} {fb.tensor} (max_abs={t:.2g}); the smallest atol that "
            f"would pass is in the report. If it grows steadily with depth it is numeric drift of the candidate's "
            "precision or kernel; a jump at one layer points at that layer's computation.") if t is not None else None
