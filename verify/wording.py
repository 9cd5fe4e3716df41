"""Every sentence a comparison says, built in one place from the numbers the results carry.

Results (verify/results.py, verify/breaks.py) hold numbers; the messages stored beside them
(``Break.message``, ``CacheResult.detail``, ``TensorResult.shape_detail``, notes) are worded here,
and so is the one-line verdict of a break (``break_line``). The wording is part of the report's
contract: the README's outputs are checked byte for byte (tests/test_readme.py).
"""
from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """n and the noun agreeing with it: '1 sample', '0 samples', '3 samples' (plural: where adding 's' is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def agree(n: int, one: str, many: str) -> str:
    """The verb (or noun) form that agrees with a count of n: agree(1, 'has', 'have') == 'has'."""
    return one if n == 1 else many


def some(noun: str, items, plural: str | None = None) -> str:
    """Indices with their noun: 'sample 2' for one, 'samples [1, 2]' for more."""
    items = [int(i) for i in items]
    return f"{noun} {items[0]}" if len(items) == 1 else f"{plural or noun + 's'} {items}"


def span(toks) -> str:
    """Token indices in words: '3..7' for a run, '5' for one, else the first eight as a list."""
    toks = sorted(int(t) for t in toks)
    if toks == list(range(toks[0], toks[-1] + 1)):
        return f"{toks[0]}..{toks[-1]}" if len(toks) > 1 else str(toks[0])
    return str(toks[:8])[:-1] + (", ...]" if len(toks) > 8 else "]")


# -- alignment and coverage -------------------------------------------------------------------------

def only_in_reference(sample: int, toks) -> str:
    return (f"sample {sample}: positions {span(toks)} have residual states in the reference only"
            " (compared as cache entries where the cache holds them)")


def only_in_candidate(sample: int, toks) -> str:
    return f"sample {sample}: positions {span(toks)} have residual states in the candidate only"


def near_miss(m) -> str:
    """One ``align.NearMiss`` in words."""
    i, j, r, c = m.ref_sample, m.cand_sample, m.ref_tokens, m.cand_tokens
    if len(c) == len(r) + 1 and c[1:] == r:
        return f"candidate sample {j} equals reference sample {i} with one extra leading token {c[0]}"
    if len(c) == len(r) + 1 and c[:-1] == r:
        return f"candidate sample {j} equals reference sample {i} with one extra trailing token {c[-1]}"
    if len(r) == len(c) + 1 and r[1:] == c:
        return f"candidate sample {j} equals reference sample {i} without its leading token {r[0]}"
    if len(r) == len(c) + 1 and r[:-1] == c:
        return f"candidate sample {j} equals reference sample {i} without its trailing token {r[-1]}"
    return (f"reference sample {i} ({count(len(r), 'token')}) and candidate sample {j} ({count(len(c), 'token')}) "
            f"share a prefix of {count(m.prefix, 'token')} and a suffix of {count(m.suffix, 'token')}")


def near_misses(misses) -> str:
    """'; ' and every near miss in words, or '' when there is none."""
    return ("; " + "; ".join(near_miss(m) for m in misses)) if misses else ""


def architectures_differ(diffs) -> str:
    return "traces are not comparable: architectures differ (" + "; ".join(diffs) + ")"


def no_common_sample(n_ref: int, n_cand: int, misses) -> str:
    return ("traces are not comparable: no sample has the same token ids "
            f"(reference {count(n_ref, 'sample')}, candidate {count(n_cand, 'sample')})" + near_misses(misses))


COVERAGE_SPLIT = " (not compared): "  # a coverage break's message: how many, then which samples and the rest


def coverage(ref_only, total: int, misses) -> str:
    n = len(ref_only)
    return (f"{n} of {count(total, 'reference sample')} {agree(n, 'has', 'have')} no counterpart "
            f"in the candidate{COVERAGE_SPLIT}{some('sample', ref_only)}" + near_misses(misses)
            + "; pass --allow-subset to compare against a subset on purpose")


def candidate_only_note(cand_only) -> str:
    return (f"candidate {some('sample', cand_only)} {agree(len(cand_only), 'has', 'have')} no counterpart in the "
            "reference (not compared)")


def subset_note(ref_only, total: int) -> str:
    return (f"{len(ref_only)} of {count(total, 'reference sample')} skipped (--allow-subset): "
            f"{some('sample', ref_only)} {agree(len(ref_only), 'has', 'have')} no counterpart in the candidate")


def positions_differ(sample: int, token: int, cand_id: int, ref_id: int, n_diff: int, n_tokens: int) -> str:
    return (f"sample {sample}: token {token} was given position id {cand_id} in the candidate, {ref_id} in the "
            f"reference ({n_diff} of {count(n_tokens, 'computed token')} "
            f"{agree(n_diff, 'differs', 'differ')})")


# -- shapes, finite masks, cache ---------------------------------------------------------------------

def width_differs(name: str, ref_width: int, cand_width: int) -> str:
    return f"{name} width {ref_width} vs {cand_width}"


def cache_shape_differs(name: str, ref_shape, cand_shape) -> str:
    return (f"cache {name}: n_kv_heads x head_dim {ref_shape[1]}x{ref_shape[3]} vs "
            f"{cand_shape[1]}x{cand_shape[3]}")


def cache_length_differs(sample: int, cand_len: int, ref_len: int, first_slot: int) -> str:
    return (f"sample {sample}: candidate holds {count(cand_len, 'token')}, reference {ref_len} "
            f"(first differing slot {first_slot})")


def cache_positions_differ(sample: int, slot: int, cand_pos: int, ref_pos: int, n_diff: int, n_slots: int) -> str:
    return (f"sample {sample}: slot {slot} holds position {cand_pos} in the candidate, "
            f"{ref_pos} in the reference ({n_diff} of {count(n_slots, 'slot')} "
            f"{agree(n_diff, 'differs', 'differ')})")


def nonfinite_valid(t) -> str:
    f = t.finite
    return (f"non-finite values in valid rows of {t.tensor}: {count(f.cand_only, 'valid value')} finite only in "
            f"the candidate, {f.ref_only} finite only in the reference, {f.both} non-finite in both")


def nonfinite_padding(t) -> str:
    f = t.finite
    side = "candidate" if f.pad_cand > f.pad_ref else "reference"
    each = ", ".join(f"{s}: {max(r, c)}" for s, r, c in f.pad_by_sample)
    where = f" (sample{'s' if len(f.pad_by_sample) > 1 else ''} {each})" if each else ""
    return (f"{count(max(f.pad_cand, f.pad_ref), 'non-finite value')} in padding rows of {t.tensor} in the {side} "
            f"only{where}; "
            "the valid rows agree (a padding row entered a softmax with no finite score?)")


# -- values ------------------------------------------------------------------------------------------

def stats_values(t) -> str:
    return (f"{t.n_bad} of {t.compared} {agree(t.compared, 'statistic', 'statistics')} (min, max, mean, rms per "
            f"sample) of {t.tensor} out of "
            f"tolerance; largest statistic error {t.max_abs:.3g} (atol={t.atol:g}, rtol={t.rtol:g}, "
            f"ntol={t.ntol:g} of the sample's rms); would pass with atol>={t.needed.atol:.3g} [stats level: "
            "no element, row or relative error is recorded]")


def share(n: int, total: int) -> str:
    """n of total in percent, as torch.testing.assert_close says it: '100.0%', '0.0012%', never 0.0% for n > 0
    nor 100.0% for n < total."""
    if not total:
        return "0%"
    p = 100.0 * n / total
    if 0 < p < 0.05:
        return f"{p:.2g}%"
    if n < total and p >= 99.95:
        return ">99.9%"
    return f"{p:.1f}%"


def pair(a: float, b: float) -> tuple[str, str]:
    """Two values with the fewest significant digits (at least 4, at most 9) that tell them apart."""
    for digits in range(4, 10):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y:
            break
    return x, y


def worst_element(t) -> str:
    """'; worst element (sample 1, pos 0, channel 17): reference 0.4123, candidate -2.248, tolerance there 5.8e-04',
    or '' where the values are not known."""
    if not t.worst or not t.worst_values or t.worst[1] is None:
        return ""
    (s, pos, ch), (ref, cand) = t.worst, pair(*t.worst_values)
    there = "" if t.worst_bound is None else f", tolerance there {t.worst_bound:.1e}"
    return f"; worst element (sample {s}, pos {pos}, channel {ch}): reference {ref}, candidate {cand}{there}"


def values(t) -> str:
    n = t.needed
    msg = (f"{t.n_bad} of {t.compared} {agree(t.compared, 'value', 'values')} of {t.tensor} out of tolerance "
           f"({share(t.n_bad, t.compared)})"
           f"{worst_element(t)}; max_abs={t.max_abs:.3g}, "
           f"largest row error {t.max_row_rel:.3g} of the row norm (atol={t.atol:g}, rtol={t.rtol:g}, "
           f"ntol={t.ntol:g}, row_rtol={t.row_rtol:g}); would pass with atol>={n.atol:.3g}, "
           f"rtol>={n.rtol:.3g}, ntol>={n.ntol:.3g} or row_rtol>={n.row_rtol:.3g}")
    return msg if t.level == "full" else msg + f" [{t.level} level]"


def calibrated_values(t, label: str) -> str:
    k = t.calib
    s, pos = k.worst if k.worst else (None, None)
    return (f"row error {k.max_ratio:.3g}x the measured {label} noise (allowed {k.factor:g}x): "
            f"{k.bad_rows} of {k.rows} {agree(k.rows, 'row', 'rows')} of {t.tensor} out "
            f"({share(k.bad_rows, k.rows)}); at the worst row "
            f"(sample {s}, pos {pos}) the candidate is {k.cand_error:.3g} "
            f"of the row norm from the float64 golden, the twin {k.noise:.3g}, allowed {k.allowed:.3g} "
            f"(K x noise + floor {k.floor:.2g}); would pass with --noise-factor {k.min_factor:.3g}")


def numerics(label: str, policy_name: str, message: str) -> str:
    return (f"the {label} numerics themselves break here (check 2): the twin, the reference's own path in {label}, "
            f"differs from the reference beyond the fixed {policy_name} envelope: {message}")


def top_ids_differ(sample: int, index: int, cand_id: int, ref_id: int, got: float, want: float) -> str:
    """The first top id out of tolerance, at ``index`` (from 0) of the top ids: worded as a rank counted from 1, as
    the top-ids table lists them."""
    return (f"sample {sample}: rank {index + 1} is id {cand_id} in the candidate, id {ref_id} in the reference "
            f"(reference logits {got:.4g} vs {want:.4g}, beyond tolerance)")


# -- what was not checked ----------------------------------------------------------------------------

SAMPLED_ONLY = "values compared on the sampled subset only (sampled level)"
STATS_ONLY = "values compared as statistics only (stats level): max_abs is the largest statistic error"
def absent_state(name: str, why: str) -> str:
    return f"{name}: not compared, the model's layers do not have it ({why})"


def routing_not_compared(layer: int, why: str) -> str:
    return f"routing at layer {layer}: not compared ({why})"


def routing_flip(f, noise: str, n: int) -> str:
    more = f" (and {count(n - 1, 'more token')})" if n > 1 else ""
    if f.margin == float("inf"):
        return (f"the candidate takes {count(len(f.candidate), 'expert')} per token, the reference "
                f"{len(f.reference)}: "
                f"experts {list(f.reference)} vs {list(f.candidate)}")
    return (f"routing flip: experts {list(f.reference)} vs {list(f.candidate)}{more}; the reference's router margin "
            f"there is {f.margin:.3g}, beyond the {f.bound:.3g} that noise can flip (from {noise})")


def routing_inconclusive(flips, n_compared: int, n_layers: int) -> str:
    samples = sorted({f.sample for f in flips})
    first = min(f.layer for f in flips)
    return (f"INCONCLUSIVE | {n_compared}/{n_layers} layers: {count(len(flips), 'routing flip')} within noise from "
            f"layer {first}; {some('sample', samples)} not compared from there on (the candidate was not rerun with "
            "the reference's routing)")


def routing_was_forced(side: str, n: int) -> str:
    return (f"the {side} ran with its router overruled at {count(n, 'token')} (a routing replay forced the reference's "
            "experts there: record.routing_forced)")


def twin_skipped(what: str) -> str:
    return f"check (2), the twin against the reference: {what}"


def routing_replayed(flips: int, cells: int) -> str:
    return (f" | {count(flips, 'routing flip')} within noise, replayed with the reference's experts forced at its "
            f"{count(cells, 'near-tie token')}")


def routing_not_replayed(f) -> str:
    return (f"sample {f.sample}: not compared from layer {f.layer} on: its token {f.position} took experts "
            f"{list(f.candidate)} instead of {list(f.reference)}, a flip within noise (margin {f.margin:.3g} <= "
            f"{f.bound:.3g}), and the candidate was not rerun with the reference's routing")


WINDOW_CACHE_NOT_FULL = ("the cache of a sliding-window layer whose two sides hold different numbers of slots: not "
                         "compared below the full level (sampled slots and statistics cover different slots)")


def stats_for_lack_of_values(name: str, ref_level: str, cand_level: str) -> str:
    return (f"{name}: compared as statistics only (levels {ref_level} and {cand_level} share no values of it): "
            "max_abs is the largest statistic error")


def stopped_at(layer: int, n_layers: int) -> str:
    """What a --fail-fast comparison that stopped at ``layer`` never compared."""
    rest = "" if layer + 1 >= n_layers else (f"layer {layer + 1}" if layer + 2 == n_layers
                                             else f"layers {layer + 1}..{n_layers - 1}") + " and "
    return (f"--fail-fast stopped at layer {layer} of {n_layers} (layers 0..{n_layers - 1}): {rest}the final logits "
            "and top ids not compared")


def not_recorded(name: str) -> str:
    return f"{name}: not recorded in one trace"


def stats_cover_other_cells(name: str) -> str:
    return f"statistics of {name} cover different cells on the two sides; not compared"


# -- the report's header, notes and verdict ---------------------------------------------------------

def calibrated_rule(calib, policy_name: str) -> str:
    by = f" (run by {calib.maker_words})" if calib.maker else ""
    twin = "the reference itself" if calib.twin is None else f"the reference's path in {calib.label}{by}"
    golden = "a float64 golden" + (by if calib.twin is None else "")
    return (f"calibrated: each row within {calib.factor:g}x the noise of {twin} against {golden} "
            f"(+ floor {calib.floor:.2g})" + ("" if calib.twin is None else f"; numerics: twin vs reference within "
                                                                            f"the fixed {policy_name} envelope"))


def own_twin_rule(label: str, policy_name: str) -> str:
    """The rule where the candidate is the reference's own path in a lower precision (its twin): its numerics are
    judged by the fixed envelope of that precision's policy."""
    return (f"calibrated: the candidate is the reference's own path in {label} (its twin), so it adds no error "
            f"beyond its numerics; numerics: candidate vs reference within the fixed {policy_name} envelope")


def declared_rule(rule: str) -> str:
    return f"declared rule, not calibrated: {rule}"


def envelope_rule(policy_name: str, rule: str, why: str | None = None) -> str:
    """The fixed envelope where a comparison below float32 (or across precisions) is not calibrated, and why."""
    return f"uncalibrated{f' ({why})' if why else ''}: fixed {policy_name} envelope ({rule})"


def same_precisions_rule(policy_name: str, rule: str) -> str:
    return f"fixed {policy_name} rule ({rule})"


def reuse_refused(side: str, sample: int, reason: str, forced: bool) -> str:
    if forced:
        return f"{side} sample {sample}: prefix reuse FORCED although refused: {reason}"
    return f"{side} sample {sample}: prefix reuse refused: {reason}"


def cache_hits(side: str, hits) -> str:
    """How many tokens of each sample came from the prefix cache: (sample, tokens reused, length) each."""
    return f"{side}: tokens from the prefix cache: " + ", ".join(f"sample {s} {k} of {n}" for s, k, n in hits)


def warm_missed(side: str, sample: int, reason) -> str:
    return (f"{side} sample {sample} was to reuse its prefix from the cache and reused nothing"
            + (f" ({reason})" if reason else "") + ": nothing about reuse is shown for it")


def invariant_broken(side: str, violation) -> str:
    return f"{side} cache invariant broken after prefill: {violation}"


def compile_time(side: str, compile_s: float, prefill_s: float | None) -> str:
    then = "" if prefill_s is None else f"; the prefill itself took {prefill_s:.3g} s"
    return f"{side}: torch.compile took {compile_s:.1f} s before the prefill (not in the prefill's time{then})"


def truncating_kernels(side: str) -> str:
    return (f"{side}: vLLM's kernels here round float32 to bfloat16 toward zero, not to nearest (learned from "
            f"its rotary embedding; its x86 CPU kernels do so without AVX512-BF16): its RoPE and attention "
            f"outputs carry about twice bfloat16's rounding error, biased, and the calibrated twin rounds to "
            f"nearest (docs/tolerances.md)")


def truncated(d: dict) -> str:
    """', first 2 of 30 layers' for a side that ran its model's first layers only (--first-layers N), else ''."""
    t = d.get("truncated")
    return f", first {t['layers']} of {t['of']} layers" if isinstance(t, dict) and "of" in t else ""


def cut_to(meta: dict, side: str) -> str:
    """Why a side has fewer layers than its model: 'the reference ran its model's first 2 of 4 layers
    (--first-layers)', or '' when it ran them all."""
    t = (meta.get("model") or {}).get("truncated")
    if not isinstance(t, dict) or "of" not in t:
        return ""
    return f"the {side} ran its model's first {t['layers']} of {t['of']} layers (--first-layers)"


def identity_differs(diffs) -> str:
    """An identity break's message: every field that differs, with both values."""
    return "model identity differs: " + "; ".join(
        d.get("says") or f"{d['key']} ({d['what']}) {d['reference']} in the reference, {d['candidate']} in the candidate"
        for d in diffs)


def levels_differ(ref_level: str, cand_level: str) -> str:
    return f"levels differ: reference {ref_level}, candidate {cand_level}; checks use what both traces have"


def passed(n_compared: int, n_layers: int, *, inconclusive: bool, identity_differs: bool,
           strict: bool = False, exact: bool = False) -> str:
    """The verdict line of a comparison with no break; under --strict an INCONCLUSIVE one is a failure."""
    head = "FAILED (strict)" if strict and inconclusive else "PASSED"
    line = f"{head} | {n_compared}/{n_layers} layers, logits and cache " + \
        ("bitwise equal" if exact else "within tolerance")
    if inconclusive:
        line += " | INCONCLUSIVE: the injected fault cannot show here"
    if identity_differs:
        line += " | the model identity differs (see notes)"
    return line


def failed(break_words: str) -> str:
    return "FAILED | " + break_words


# -- the verdict line of a break ---------------------------------------------------------------------

def break_line(b, token_text: str | None = None, step: int | None = None) -> str:
    """One fixed wording per kind, e.g. 'layer 3 attn_update | sample 1 pos 7 | max_abs=3.1e-02 > tol=1.0e-03'.

    tol is the tolerance at the worst element: atol + rtol·|ref| + ntol·rms(ref row). With token_text
    (the reference's token at that position), the position reads e.g. "pos 7 ' Paris'"; with ``step`` (a side
    computed that position in a decode step) "pos 73 (decode step 3)".
    """
    if b.kind == "coverage":
        return f"coverage | {b.message.split(COVERAGE_SPLIT, 1)[0]}{COVERAGE_SPLIT}{some('sample', b.samples)}"
    if b.kind == "identity":
        return "identity | " + b.message.split(": ", 1)[-1]
    if b.stage == "metadata":
        return f"metadata | {b.message}"
    parts = [_where(b)]
    who = (f"samples {','.join(map(str, b.samples))}" if b.kind == "finite_mask" and b.padding and len(b.samples) > 1
           else f"sample {b.sample}" if b.sample is not None else "")
    loc = " ".join(x for x in (who,
                               f"pos {b.position}" if b.position is not None else "",
                               repr(token_text) if token_text is not None and b.position is not None else "",
                               f"(decode step {step})" if step is not None and b.position is not None else "") if x)
    if loc:
        parts.append(loc)
    if b.kind == "value":
        parts += _value_parts(b)
    elif b.kind == "finite_mask":
        parts.append("NaN/Inf in padding rows" if b.padding else "NaN/Inf where the other side is finite")
    else:
        parts.append(b.message.split(": ", 1)[-1] if b.message.startswith("sample ") else b.message)
    return " | ".join(parts)


def phase_line(layers) -> str | None:
    """The rows grouped by phase: per layer, the largest error over its states in the prompt's rows and in the
    response's decoded rows (None when no side decoded)."""
    parts = []
    for lr in layers:
        got = [t.by_phase for t in lr.tensors if getattr(t, "by_phase", None)]
        if got:
            pre, dec = max(g["prefill"] for g in got), max(g["decode"] for g in got)
            parts.append(f"layer {lr.layer} prompt {pre:.1e} response {dec:.1e}")
    return "max abs by phase (prompt rows, decoded response rows): " + "; ".join(parts) if parts else None


def logprob_lines(lp, text_of=None) -> list[str]:
    """The response's log-prob figures (verify/logprobs.py) in lines: the figures, then the tokens that differ
    most. ``text_of``: a token id's text, when the model has a tokenizer."""
    if lp is None:
        return []
    pearson = "n/a" if lp.pearson_p is None else f"{lp.pearson_p:.6f}"
    who = {"candidate": ", chosen by the candidate", "self": ", chosen by the recorded side"}.get(lp.chosen_by, "")
    lines = [f"response log-probs ({lp.tokens} token{'s' if lp.tokens != 1 else ''}{who}): mean |dlogp| "
             f"{lp.mean_abs_dlogp:.3g}, max |dlogp| {lp.max_abs_dlogp:.3g}, mean |dp| {lp.mean_abs_dp:.3g}, "
             f"k3 KL {lp.k3_kl:.3g}, Pearson(p) {pearson}, log-ppl diff {lp.log_ppl_diff:.3g}"]
    for d in lp.largest[:3] if lp.max_abs_dlogp > 0 else ():
        text = None if text_of is None else text_of(d["token_id"])
        lines.append(f"  sample {d['sample']} pos {d['position']} id {d['token_id']}"
                     + (f" {text!r}" if text is not None else "") +
                     f": logp reference {d['reference']:.6g}, candidate {d['candidate']:.6g} (d {d['delta']:.3g})")
    return lines


def break_site(b) -> str:
    """Where a break is, in a few words: 'layer 0 attn_update', 'final logits', 'the metadata stage (coverage)'."""
    return f"the metadata stage ({b.kind})" if b.stage == "metadata" else _where(b)


def after_first_break(first, line: str) -> str:
    """A later break's one line, citing the first break (JUnit: later failures are counted, not explained)."""
    return f"after the first break at {break_site(first)}: {line}"


def _where(b) -> str:
    if b.kind in ("cache_length", "cache_positions"):
        what = "cache length" if b.kind == "cache_length" else "cache positions"
    elif b.kind == "top_ids":  # its tensor is topk_ids: named once, as the report's "final top ids"
        what = "top ids"
    else:
        what = b.tensor + (" finite mask" if b.kind == "finite_mask" else "")
    return f"layer {b.layer} {what}" if b.stage == "layer" else f"final {what}"


def _value_parts(b) -> list:
    if b.check == "change":
        parts = [f"row error {b.noise_ratio:.3g}x the measured {b.noise_of} noise > allowed {b.noise_factor:g}x"]
        if b.heads:
            parts.append("query heads " + ",".join(map(str, b.heads)))
        return parts
    parts = ["numerics (twin vs reference)"] if b.check == "numerics" else []
    if b.max_abs_error is not None and b.bound is not None:
        parts.append(f"max_abs={b.max_abs_error:.1e} > tol={b.bound:.1e}")
    elif b.max_abs_error is not None and "[stats level" in b.message:
        parts.append(f"statistic error={b.max_abs_error:.1e} (stats level: min, max, mean, rms; no values)")
    else:
        parts.append(b.message)
    if b.heads:
        parts.append("query heads " + ",".join(map(str, b.heads)) +
                     (" (reading KV heads " + ",".join(map(str, b.kv_heads)) + ")" if b.kv_heads else ""))
    elif b.kv_heads:
        parts.append("KV heads " + ",".join(map(str, b.kv_heads)))
    return parts


def exact_lines(exact, verbose: bool = False) -> list:
    """An exact comparison per layer: where its bits first part (runs of bitwise-equal layers on one line), the
    final stage, what was not compared bit for bit; with ``verbose`` every tensor's share."""
    from .bitwise import percent
    lines, run = [], []

    def flush():
        if run:
            lines.append(f"bits: layer{'s' if len(run) > 1 else ''} {run[0]}{f'-{run[-1]}' if len(run) > 1 else ''} "
                         "bitwise equal")
            run.clear()
    for lb in exact.layers:
        f = lb.first
        if f is None:
            run.append(lb.layer)
            continue
        flush()
        before = lb.tensors.index(f)
        lines.append(f"bits: layer {lb.layer} part first at {f.name}: {f.bits.words()}"
                     + (f" ({before} tensor{'s' if before != 1 else ''} before it equal)" if before else ""))
    flush()
    for t in exact.final:
        lines.append(f"bits: final {t.name}: {t.bits.words()}")
    if verbose:
        for lb in exact.layers:
            lines.append(f"bits, layer {lb.layer}: " + " · ".join(
                f"{t.name} {percent(t.bits.share)}" + ("" if t.bits.exact else f" ({t.bits.max_ulp:.0f} ULP)")
                for t in lb.tensors))
    by_why: dict = {}
    for name, why in exact.not_compared.items():
        by_why.setdefault(why, []).append(name)
    for why, names in by_why.items():
        lines.append(f"not compared bit for bit: {', '.join(names)} ({why})")
    return lines
