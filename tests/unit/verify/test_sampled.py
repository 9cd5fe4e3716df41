"""verify/sampled.py: values at the sampled level's declared (token, channel) subset, the full side subset to
match; only tokens both sides computed are compared."""
from __future__ import annotations

import numpy as np
import pytest

from prefill_diff.verify import wording
from prefill_diff.verify.sampled import compare_sampled, compare_sampled_or_stats

from ._traces import HEAD_DIM, TOL, context, make_spec, record

KEEP = dict(sample_tokens=3, sample_channels=3)  # 3 of 8 channels: a real subset


def _traces(ref_spec, cand_spec, levels=("sampled", "full")):
    kw = [KEEP if lv == "sampled" else {} for lv in levels]
    ref = record(ref_spec, levels[0], name="ref", **kw[0])
    cand = record(cand_spec, levels[1], name="cand", **kw[1])
    return ref, cand, context(ref, cand)


def _subset(trace, name="mid"):
    """(channels, {sample: sampled token indices}) as the sampled trace declares them."""
    channels = np.asarray(trace.layer(0).sampled(name).attrs["channels"])
    toks = trace.f["sampled/token_index"][:]
    return channels, {s: [int(t) for t in row if t >= 0] for s, row in enumerate(toks)}


def _sampled(ref_spec, cand_spec, name="mid", levels=("sampled", "full")):
    ref, cand, ctx = _traces(ref_spec, cand_spec, levels)
    return compare_sampled(ctx, ref.layer(0), cand.layer(0), name, TOL), ctx, ref if levels[0] == "sampled" else cand


def test_the_declared_subset_is_compared_and_nothing_else():
    spec = make_spec(pad=[0, 1, 2])
    t, ctx, sampled = _sampled(spec, spec.relayout([2, 0, 0]))
    channels, toks = _subset(sampled)
    assert 0 < channels.size < 8
    assert t and t.level == "sampled" and t.max_abs == 0.0
    assert t.compared == sum(len(v) for v in toks.values()) * channels.size
    assert wording.SAMPLED_ONLY in ctx.skipped


def test_a_change_at_a_sampled_cell_breaks_at_its_sample_and_token():
    ref = make_spec()
    r = record(ref, "sampled", **KEEP)
    channels, toks = _subset(r)
    cand = ref.copy()
    tok = toks[1][1]
    old = float(ref.row("mid", 1, tok)[channels[0]])
    cand.row("mid", 1, tok)[channels[0]] += 0.5
    t, _, _ = _sampled(ref, cand)
    assert not t and t.n_bad == 1 and t.worst[:2] == (1, tok)
    assert t.max_abs == pytest.approx(0.5, abs=1e-6)
    assert t.worst_values == pytest.approx((old, old + 0.5), abs=1e-6)
    assert t.bad_samples == (1,)


def test_the_worst_element_is_named_by_the_tensors_channel():
    """docs/report-format.md: ``channel`` is the channel of the worst element, as at the full level."""
    ref = make_spec()
    channels, toks = _subset(record(ref, "sampled", **KEEP))
    assert channels[-1] != channels.size - 1  # the last sampled channel is not its own index
    cand = ref.copy()
    cand.row("mid", 0, toks[0][1])[channels[-1]] += 0.5
    t, _, _ = _sampled(ref, cand)
    assert t.worst == (0, toks[0][1], int(channels[-1]))


def test_a_change_outside_the_subset_is_not_seen():
    """A channel that is not sampled, and a token that is not: the sampled level cannot see either."""
    ref = make_spec()
    channels, toks = _subset(record(ref, "sampled", **KEEP))
    cand = ref.copy()
    other_channel = next(c for c in range(8) if c not in channels)
    other_token = next(t for t in ref.tokens(0) if t not in toks[0])
    cand.row("mid", 2, toks[2][0])[other_channel] += 5.0
    cand.row("mid", 0, other_token)[channels[0]] += 5.0
    t, _, _ = _sampled(ref, cand)
    assert t and t.max_abs == 0.0


@pytest.mark.parametrize("levels", [("sampled", "sampled"), ("full", "sampled")])
def test_either_side_may_hold_the_sampled_values(levels):
    """Both sides sampled, or the reference full and the candidate sampled: the same subset, and a change in it
    is found."""
    ref = make_spec()
    channels, toks = _subset(record(ref, "sampled", **KEEP))
    t, _, _ = _sampled(ref, ref.copy(), levels=levels)
    assert t and t.compared == sum(len(v) for v in toks.values()) * channels.size
    cand = ref.copy()
    cand.row("mid", 2, toks[2][-1])[channels[1]] -= 1.0
    t, _, _ = _sampled(ref, cand, levels=levels)
    assert not t and t.worst[:2] == (2, toks[2][-1])


@pytest.mark.parametrize("reused_by", ["reference", "candidate"])
def test_tokens_one_side_did_not_compute_are_left_out(reused_by):
    """A reused prefix of sample 0 (tokens 0 and 1): the sampled token 0 is compared on neither side."""
    full, reused = make_spec(), make_spec(start=[2, 0, 0])
    for key, per in reused.states.items():
        for s, x in enumerate(per):
            x[:] = full.states[key][s][reused.start[s]:]
    ref_spec, cand_spec = (reused, full) if reused_by == "reference" else (full, reused)
    t, _, sampled = _sampled(ref_spec, cand_spec)
    channels, toks = _subset(sampled)
    assert 0 in toks[0]  # declared, though one side never computed it (a reused sampled side's slot is NaN)
    compared = sum(len([x for x in v if s or x >= 2]) for s, v in toks.items())
    assert t and t.compared == compared * channels.size


def test_no_values_on_one_side_is_no_comparison():
    spec = make_spec()
    t, _, _ = _sampled(spec, spec, levels=("sampled", "stats"))
    assert t.level == "none" and t.note == "no values in one trace" and t.compared == 0


def test_cache_values_are_compared_at_sampled_slots_when_both_sides_kept_them():
    """Cache rows are (slot, KV head·head_dim): channel c is head c // head_dim, dimension c % head_dim."""
    ref = make_spec()
    r = record(ref, "sampled", **KEEP)
    channels, toks = _subset(r, "cache_keys")
    cand = ref.copy()
    c = int(channels[1])
    slot = toks[2][1]
    cand.caches[0][2][0][c // HEAD_DIM, slot, c % HEAD_DIM] += 1.0
    ref_t, cand_t, ctx = _traces(ref, cand, ("sampled", "sampled"))
    t = compare_sampled_or_stats(ctx, ref_t.layer(0), cand_t.layer(0), "cache_keys", TOL)
    assert t.level == "sampled" and not t and t.worst[:2] == (2, slot)
    assert t.compared == sum(len(v) for v in toks.values()) * channels.size
    assert compare_sampled_or_stats(ctx, ref_t.layer(0), cand_t.layer(0), "cache_values", TOL)


def test_a_cache_sampled_on_one_side_only_is_compared_as_statistics():
    spec = make_spec()
    ref, cand, ctx = _traces(spec, spec, ("sampled", "full"))
    t = compare_sampled_or_stats(ctx, ref.layer(0), cand.layer(0), "cache_keys", TOL)
    assert t.level == "stats" and t
    assert wording.stats_for_lack_of_values("cache_keys", "sampled", "full") in ctx.skipped


def test_a_sample_whose_cache_lengths_differ_is_skipped():
    """Sampled slots of caches of other lengths do not line up: the cache-length check reports that sample."""
    ref = make_spec()
    cand = ref.copy()
    k, v, pos = cand.caches[0][1]
    cand.caches[0][1] = [k[:, :2], v[:, :2] + 1.0, pos[:2]]  # one slot fewer, and other values
    ref_t, cand_t, ctx = _traces(ref, cand, ("sampled", "sampled"))
    channels, toks = _subset(ref_t, "cache_values")
    t = compare_sampled_or_stats(ctx, ref_t.layer(0), cand_t.layer(0), "cache_values", TOL)
    assert t and t.compared == (len(toks[0]) + len(toks[2])) * channels.size
