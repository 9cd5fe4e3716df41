"""A short hint that matches the first break's pattern to the §2.11 table of docs/contract.md.

Worded as a hint, never as proof: it names what the pattern is consistent with. Called while the
report is built, with the traces still open (some hints read the candidate's inputs or cache).
"""
from __future__ import annotations

import numpy as np

from . import wording
from .cache_checks import layer_window
from .calibrate import UNIT_ROUNDOFF, precision_key, precision_label, precisions, unit_roundoff
from .identity import differences, hint
from .rank_checks import heads_note


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


def _reuse(cand, key: str) -> list:
    """The candidate's recorded prefix-reuse decisions with ``key`` set (hit, forced)."""
    return [o for o in (cand.meta.get("record") or {}).get("reuse") or () if o.get(key)]


CONTRACT = "See contract.md §2.11 (installed with prefill-diff: `prefill-diff docs contract` prints it)."


def diagnose(fb, pairs, final, ref, cand, policy=None, layers=(), cand_steps=None) -> str | None:
    """The hint for first break fb of a comparison of ref and cand (pairs: matched samples; final: the final
    stage's result or None; policy: the rule the values were judged by; layers: the compared layers' results,
    which say what agreed in the break's layer; cand_steps: the candidate's decode steps by (reference sample, token
    index), verify/align.py decode_steps); one that cites the §2.11 table says where that table is."""
    lr = next((x for x in layers if fb is not None and x.layer == fb.layer), None) if fb is not None else None
    text = _hint(fb, pairs, final, ref, cand, policy, lr)
    step = None if fb is None else (cand_steps or {}).get((fb.sample, fb.position))
    if step is not None and text and fb.stage == "layer":
        text = (f"The break's position was computed by the candidate in decode step {step}, one token alone against "
                "its cache: a decode step's own position, the cache entries it reads (its own new one included) or "
                "its mask differ from the prefill's. " + text)
    return f"{text} {CONTRACT}" if text and "§2.11" in text else text


def _hint(fb, pairs, final, ref, cand, policy=None, lr=None) -> str | None:
    if fb is None:
        return None
    if fb.kind == "coverage":
        return ("The candidate did not prefill every request of the reference: a request dropped by the candidate "
                "engine, or the same prompt tokenised differently (an extra BOS?). A gate that compared only the "
                "rest would pass without ever seeing them.")
    if fb.stage == "metadata":
        return "The traces are not of the same model architecture or prompts, so no layer can be compared."
    structural = STRUCTURAL.get(fb.kind)
    if structural is not None:
        return structural(fb, pairs, cand)
    identity = hint(differences(ref.meta, cand.meta), fb)  # a different model explains a value break before numerics
    if identity:
        return identity
    too_fine = _declared_too_fine(policy, cand)
    if too_fine:
        return too_fine
    if fb.kind == "top_ids":
        return ("Logits agree within tolerance but the top-ranked ids differ beyond it: check the logits' "
                "tolerance; a top-k difference alone changes greedy decoding.")
    if fb.stage == "final":
        return _final_values(pairs, final, cand)
    if fb.kind == "routing":
        return _routing(fb, lr)
    return _layer_values(fb, pairs, ref, cand, lr)


def _shape(fb, pairs, cand) -> str:
    return f"Tensor shapes differ at layer {fb.layer}: the two runs do not use the same model configuration?"


def _cache_length(fb, pairs, cand) -> str:
    prev = "" if fb.layer == 0 else " (layer 0 agrees)" if fb.layer == 1 else f" (layers 0..{fb.layer - 1} agree)"
    return (f"The cache of layer {fb.layer} holds a different number of tokens{prev}: consistent with one layer "
            "skipping (or duplicating) a KV write — §2.11 row 2, 'equal lengths across layers'. "
            "The first decode step would fail on shape or read misaligned history.")


def _cache_positions(fb, pairs, cand) -> str:
    restarts = _restarted(cand, pairs, cand.layer(0))
    if fb.layer == 0 and restarts and _reuse(cand, "hit"):
        s, at = restarts[0]
        return (f"Cache positions differ from layer 0 and restart at 0 at slot {at} of sample {s}, right after "
                "the reused prefix: position ids restarted after prefix reuse? — §2.11 row 3, "
                "'token/position mapping'.")
    return (f"Cache positions differ from layer {fb.layer}: the position descriptor (or its offset after a "
            "reused prefix or chunk) is not the reference's.")


def _positions(fb, pairs, cand) -> str:
    return ("The position ids given to the model differ while the cache positions agree: the position "
            "descriptor (or its offset after a reused prefix or chunk) is not the reference's, or one trace's "
            "/inputs/positions does not record what was run.")


def _finite_mask(fb, pairs, cand) -> str:
    if fb.padding:
        return ("NaN/Inf first appear in padding rows: consistent with a fully masked padding query row "
                "entering softmax (no sentinel) — §2.11 row 7; it spreads through padding keys/values into "
                "valid rows in later layers.")
    return (f"Non-finite values appear in valid rows at {fb.tensor}: overflow in low precision, or NaN "
            "spreading from padding rows at an earlier layer?")


def _rank_divergence(fb, pairs, cand) -> str:
    sub = "attention output projection" if fb.tensor == "attn_update" else (
        "MLP down projection" if fb.tensor == "mlp_update" else "layer")
    return (f"Tensor-parallel ranks hold different values of {fb.tensor} at layer {fb.layer}, which every rank "
            f"must hold identically: consistent with the {sub}'s row-parallel partial sums not being "
            "all-reduced (or reduced over the wrong group), or a rank-dependent computation.")


def _declared_too_fine(policy, cand) -> str | None:
    """A declared fixed rule finer than the candidate's precision (a float32 baseline rule against a bf16
    candidate): the break may be rounding alone, and the fix is a calibrated baseline."""
    if policy is None or policy.calibration is not None:
        return None
    declared = sorted({str(v) for v in policy.sources.values() if not str(v).endswith("default")})
    base = policy.name.split("+")[0].split(" ")[0]
    prec = precisions(cand.meta)
    if not declared or base not in UNIT_ROUNDOFF or UNIT_ROUNDOFF[base] >= unit_roundoff(prec):
        return None
    label = precision_label(prec)
    return (f"The rule was declared ({', '.join(declared)}): a fixed {base} rule, but the candidate computes in "
            f"{label}, so this break may be that precision's own rounding. To judge a {label} candidate against "
            f"measured noise, record the baseline without --policy and with --twin-of {precision_key(prec)} "
            "(its float64 golden and twin beside it) and compare without a declared tolerance: the verdict is "
            "then calibrated.")


# breaks that say what is wrong by their kind alone, hinted before any model-identity difference
STRUCTURAL = {"shape": _shape, "cache_length": _cache_length, "cache_positions": _cache_positions,
              "positions": _positions, "finite_mask": _finite_mask, "rank_divergence": _rank_divergence}


def _final_values(pairs, final, cand) -> str:
    """Every layer agrees but the final stage does not: a gather at the wrong token, or the head itself."""
    gathers = [g for g in (final.gather if final is not None else ()) if g.candidate != g.last_valid]
    if not gathers:
        return "All layers agree but the final logits do not: the final norm, the unembedding or its bias differs?"
    cand_of = dict(pairs)
    cols = cand.final["gather_col"]
    each = []
    for g in gathers:
        read = "a padding cell" if g.candidate < 0 else f"token {g.candidate}"
        each.append(f"sample {g.sample} from stored column {int(cols[cand_of[g.sample]])} ({read}; its last valid "
                    f"token is {g.last_valid})")
    width = cand.n_cols
    last_col = all(int(cols[cand_of[g.sample]]) == width - 1 for g in gathers)
    return (f"All layers agree, but the final logits of sample{'s' if len(gathers) > 1 else ''} "
            f"{', '.join(str(g.sample) for g in gathers)} were not gathered at the last valid token: "
            + "; ".join(each) + ". " +
            (f"Every one was read from column {width - 1}, the rectangle's last: the gather took the last "
             "column instead of each sample's last valid token" if last_col else
             "The gather did not use each sample's last valid token") +
            " — §2.11 row 1, 'first-step condition prefix'.")


def _layer_values(fb, pairs, ref, cand, lr=None) -> str | None:
    """A value break inside a layer: a forced reuse, one head's wrong KV head, padding seen, the sliding window,
    attention itself, the experts' combination, or drift."""
    forced = _reuse(cand, "forced")
    if fb.tensor in ("cache_keys", "cache_values") and forced:
        return (f"Cache values of the reused prefix differ at layer {fb.layer}, and the candidate forced a prefix "
                f"reuse that the metadata check refused ({forced[0]['reason']}): a cache built under another "
                "adapter or weights was reused? — §2.11 row 6, 'snapshot identity'.")
    if fb.tensor in ("attn_update", "attn_heads"):
        attention = (_attention_at_layer0(fb, pairs, ref, cand) if fb.layer == 0 else None) or \
            _window(fb, ref, lr) or _every_head(fb, ref, lr)
        if attention:
            return attention
    if fb.tensor == "mlp_update":
        experts = _same_experts(fb, lr)
        if experts:
            return experts
    t = fb.max_abs_error
    return (f"First value difference at layer {fb.layer} {fb.tensor} (max_abs={t:.2g}); the smallest atol that "
            f"would pass is in the report. If it grows steadily with depth it is numeric drift of the candidate's "
            "precision or kernel; a jump at one layer points at that layer's computation.") if t is not None else None


def _agree(lr, *names) -> bool:
    """Every tensor ``names`` of layer result lr was compared (values, sampled or statistics) and is within
    tolerance."""
    if lr is None:
        return False
    found = [lr.tensor(n) for n in names]
    return all(t is not None and t.level != "none" and bool(t) for t in found)


def _first_token(lr, tensor: str) -> int | None:
    """The earliest token index out of tolerance in ``tensor`` over every sample, or None where unknown."""
    t = None if lr is None else lr.tensor(tensor)
    toks = [p for p in (t.bad_positions.values() if t is not None else ()) if p is not None]
    return min(toks) if toks else None


def _window(fb, ref, lr) -> str | None:
    """Attention in a sliding-window layer (W) first differs where the window first cuts (token W, or W - 1 for a
    window one short), its keys and values agreeing: the window's bound is off by one. A query at token t attends
    to tokens t-W+1..t, every earlier token while t < W."""
    window = layer_window(ref, fb.layer)
    first = _first_token(lr, fb.tensor)
    if window is None or first not in (window - 1, window) or first < 1 or not _agree(lr, "cache_keys", "cache_values"):
        return None
    how = ("one key too wide: queries past the window attend to W+1 keys instead of W (token W is the first whose "
           "window leaves out an earlier token)" if first == window else
           "one key too narrow: queries attend to W-1 keys instead of W from token W-1 on (the first token a window "
           "one key short cuts)")
    return (f"Layer {fb.layer} is a sliding-window layer (W={window}) and its attention output first differs at "
            f"token {first} (tokens 0..{first - 1} agree) while its cached keys and values agree: consistent with the "
            f"sliding window applied off by one, {how}.")


def _every_head(fb, ref, lr) -> str | None:
    """Every query head's attention output differs while the keys and values agree: the scores, the mask or the
    softmax, common to every head."""
    n_heads = ref.args.get("n_heads")
    if not n_heads or fb.heads is None or len(fb.heads) < n_heads or not _agree(lr, "cache_keys", "cache_values"):
        return None
    return (f"At layer {fb.layer} every query head's attention output differs ({n_heads} of {n_heads}) while the "
            "layer's cached keys and values agree: the difference enters inside attention, after K and V, and is "
            "common to every head — consistent with the attention scores (their scale or soft-cap), the mask or "
            "the softmax computed differently (or the query projection, which the trace does not hold). A jump at "
            "this one layer is such a logic difference; growth with depth from earlier layers would be numeric "
            "drift instead.")


def _same_experts(fb, lr) -> str | None:
    """A mixture of experts' MLP update differs while its input and every token's experts agree."""
    routing = None if lr is None else lr.routing
    if routing is None or not routing.compared or routing.flips or not _agree(lr, "mid"):
        return None
    return (f"At layer {fb.layer} the MLP update differs while its input (mid) agrees and every token compared "
            f"({wording.count(routing.compared, 'token')}) chose the same experts on both sides: the experts' "
            "outputs are weighted or computed differently — the top-k weights (renormalised or not: norm_topk_prob), "
            "a shared expert's gate, or an expert's own weights — a logic difference, not a routing decision.")


def _routing(fb, lr) -> str:
    """A routing flip that noise does not explain: the router decided differently (fb.max_abs_error holds the
    reference's router margin there, fb.bound the most noise can move it)."""
    if fb.max_abs_error is None or fb.max_abs_error == float("inf"):
        return (f"At layer {fb.layer} the two sides take a different number of experts per token: the routing "
                "configuration differs (experts per token, n_active_experts), a logic difference, not numeric "
                "drift.")
    where = f"token {fb.position} of sample {fb.sample}" if fb.position is not None else "a token"
    cause = (" The router's input (mid) agrees within tolerance, so the router itself decided differently: its "
             "top-k selection (which ranks it takes), how it ranks the experts (router weights, a bias, the "
             "softmax or sigmoid before the top-k) or how many it takes." if _agree(lr, "mid") else
             " The router's input (mid) differs beyond tolerance too: the flip may follow from that difference; "
             "see the layer's mid.")
    return (f"A routing decision differs at layer {fb.layer}, not numeric drift: the candidate sent {where} to "
            f"other experts although the reference's router margin there (its k-th minus its (k+1)-th router "
            f"logit) is {fb.max_abs_error:.3g}, more than the {fb.bound:.3g} that noise can overturn." + cause)


def _attention_at_layer0(fb, pairs, ref, cand) -> str | None:
    """Attention differs at layer 0: some query heads only (a head-to-KV-head mapping), or padded samples only."""
    n_heads = ref.args.get("n_heads")
    if fb.heads is not None and 0 < len(fb.heads) < (n_heads or 0):
        owner = heads_note(cand, fb.heads) if getattr(cand, "ranks", None) else None
        if owner:
            return (f"At layer 0 only {_only(fb.heads, n_heads)} while the cached K/V agree, and {owner}: "
                    "consistent with that rank attending with another rank's KV shard (a tensor-parallel "
                    "head-to-rank mapping error; cf. §2.11 row 4).")
        return (f"At layer 0 only {_only(fb.heads, n_heads)} while K/V agree: "
                "consistent with a query head reading the wrong KV head (g(h) = ⌊h·H_kv/H_q⌋) — §2.11 row 4.")
    padded = _padded_samples(cand, pairs)
    bad = set(fb.samples)
    if bad and padded and bad <= padded and len(bad) < len(pairs):
        return (f"At layer 0 only padded {wording.some('sample', sorted(bad))} "
                f"{wording.agree(len(bad), 'differs', 'differ')}; unpadded samples agree: padding keys "
                "visible to valid queries? — §2.11 row 5, 'valid-position semantics'.")
    return None


def _only(heads, n_heads: int) -> str:
    """'query head 1 of 4 differs', 'query heads [0, 2] of 4 differ'."""
    return (f"{wording.some('query head', heads)} of {n_heads} "
            f"{wording.agree(len(heads), 'differs', 'differ')}")
