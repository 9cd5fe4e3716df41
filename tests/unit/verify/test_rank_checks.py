"""verify/rank_checks.py: the checks only a tensor-parallel rank set needs. Shards that do not tile are a shape
break; replicated states on which a rank disagrees with rank 0 are a rank_divergence naming the ranks and the
reference's samples (full level: the element rule over valid cells; stats level: checksums); a break's query
heads are attributed to the ranks that hold them.

A rank set is stood in for by a logical trace given ``ranks`` (one recorded trace per rank, the same layout)
and ``shard_problems``, the two attributes dumps/rank_merge.py's RankTrace adds.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from prefill_diff.verify.breaks import Break
from prefill_diff.verify.rank_checks import divergence_break, heads_note, heads_notes, tiling_break

from ._traces import context, make_spec, record

RANKS = [{"rank": 0, "query_heads": [0, 2], "kv_heads": [0, 1]},
         {"rank": 1, "query_heads": [2, 4], "kv_heads": [1, 2]}]


def _ranked(trace, specs, level="full", problems=None):
    """``trace`` as a rank set whose rank r recorded ``specs[r]``."""
    trace.ranks = [record(s, level, name=f"rank{r}") for r, s in enumerate(specs)]
    trace.shard_problems = dict(problems or {})
    return trace


def _permuted(spec, order):
    """The same samples batched in another order: sample j of the result is sample order[j] of spec."""
    out = spec.copy()
    src = spec.copy()
    out.samples = [src.samples[o] for o in order]
    out.pad, out.start = [src.pad[o] for o in order], [src.start[o] for o in order]
    out.states = {k: [v[o] for o in order] for k, v in src.states.items()}
    out.caches = {k: [v[o] for o in order] for k, v in src.caches.items()}
    out.finals = [src.finals[o] for o in order]
    return out


def _cand_ranks(ref_spec, rank_specs, level="full", cand_spec=None, **kw):
    """A comparison whose candidate is a rank set (the candidate's logical trace: ``cand_spec``, else rank 0's)."""
    ref = record(ref_spec, level, name="ref")
    cand = _ranked(record(cand_spec or rank_specs[0], level, name="cand"), rank_specs, level, **kw)
    return context(ref, cand)


# -- tiling ---------------------------------------------------------------------------------------------------

def test_plain_traces_have_no_rank_checks():
    spec = make_spec()
    ctx = context(record(spec, name="ref"), record(spec, name="cand"))
    assert tiling_break(ctx, 0) is None and divergence_break(ctx, 0) is None


def test_shards_that_do_not_tile_are_a_shape_break_at_their_layer():
    spec = make_spec(n_layers=3)
    problems = {(0, "cache_values"): "values-why", (0, "attn_heads"): "heads-why", (1, "cache_keys"): "keys-why"}
    ctx = _cand_ranks(spec, [spec, spec], problems=problems)
    assert tiling_break(ctx, 0) == Break(stage="layer", kind="shape", message="candidate heads-why", layer=0,
                                         tensor="attn_heads")
    assert tiling_break(ctx, 1) == Break(stage="layer", kind="shape", message="candidate keys-why", layer=1,
                                         tensor="cache_keys")
    assert tiling_break(ctx, 2) is None


def test_the_references_tiling_problem_is_reported_first():
    spec = make_spec()
    ref = _ranked(record(spec, name="ref"), [spec, spec], problems={(0, "cache_keys"): "ref-why"})
    cand = _ranked(record(spec, name="cand"), [spec, spec], problems={(0, "attn_heads"): "cand-why"})
    b = tiling_break(context(ref, cand), 0)
    assert (b.kind, b.message, b.tensor) == ("shape", "reference ref-why", "cache_keys")


# -- divergence of replicated states --------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["full", "stats"])
def test_identical_replicas_do_not_diverge(level):
    spec = make_spec(pad=[0, 2, 1], n_layers=2)
    ctx = _cand_ranks(spec, [spec, spec.copy(), spec.copy()], level)
    assert divergence_break(ctx, 0) is None and divergence_break(ctx, 1) is None


def test_replicas_within_the_tolerance_do_not_diverge():
    """|Δ| = 5e-4 everywhere in mid, below atol = 1e-3 of the comparison's policy."""
    spec = make_spec()
    other = spec.copy()
    for x in other.states[(0, "mid")]:
        x += np.float32(5e-4)
    assert divergence_break(_cand_ranks(spec, [spec, other]), 0) is None


def test_a_replica_that_differs_is_named_by_ranks_state_reference_sample_and_position():
    """The candidate batches the samples as [2, 0, 1]; rank 1 differs in its samples 0 (reference 2, token 3,
    by 0.5) and 1 (reference 0, token 1, by 0.25): two values, the worst in reference sample 2."""
    spec = make_spec(pad=[0, 2, 1])
    cand = _permuted(spec, [2, 0, 1])
    r1 = cand.copy()
    r1.row("mid", 0, 3)[5] += 0.5
    r1.row("mid", 1, 1)[2] += 0.25
    b = divergence_break(_cand_ranks(spec, [cand, r1]), 0)
    assert (b.stage, b.kind, b.layer, b.tensor, b.sample, b.position, b.samples) == \
        ("layer", "rank_divergence", 0, "mid", 2, 3, (0, 2))
    assert b.max_abs_error == pytest.approx(0.5, abs=1e-6)
    assert b.message == ("ranks 0 and 1 of the candidate disagree on replicated mid: 2 values differ beyond "
                         "tolerance, max_abs=0.5 (sample 2, position 3)")


def test_the_first_replicated_state_in_layer_order_is_reported():
    """attn_update comes before mlp_update and layer_output (layer_input, attn_update, mid, mlp_update,
    layer_output)."""
    spec = make_spec(n_layers=2)
    r1 = spec.copy()
    r1.row("layer_output", 0, 0, layer=1)[0] += 1.0
    r1.row("mlp_update", 2, 1, layer=1)[0] += 1.0
    r1.row("attn_update", 1, 2, layer=1)[7] += 1.0
    ctx = _cand_ranks(spec, [spec, r1])
    assert divergence_break(ctx, 0) is None
    b = divergence_break(ctx, 1)
    assert (b.layer, b.tensor, b.sample, b.position, b.samples) == (1, "attn_update", 1, 2, (1,))


def test_a_later_rank_is_named():
    spec = make_spec()
    r2 = spec.copy()
    r2.row("layer_input", 0, 4)[1] -= 3.0
    b = divergence_break(_cand_ranks(spec, [spec, spec.copy(), r2]), 0)
    assert b.message.startswith("ranks 0 and 2 of the candidate disagree on replicated layer_input: 1 value ")
    assert b.max_abs_error == pytest.approx(3.0, abs=1e-5)


def test_padding_cells_are_not_compared_across_ranks():
    spec = make_spec(pad=[0, 2, 1])
    r1 = spec.copy()
    r1.states[(0, "mid")][1][0] += 100.0  # sample 1's first padding cell
    r1.states[(0, "mid")][2][0, 3] = np.nan  # sample 2's padding cell
    assert divergence_break(_cand_ranks(spec, [spec, r1]), 0) is None


def test_a_value_finite_on_one_rank_only_diverges():
    spec = make_spec()
    r1 = spec.copy()
    r1.row("mid", 1, 1)[2] = np.inf
    b = divergence_break(_cand_ranks(spec, [spec, r1]), 0)
    assert (b.kind, b.tensor, b.sample, b.samples) == ("rank_divergence", "mid", 1, (1,))
    assert b.message.startswith("ranks 0 and 1 of the candidate disagree on replicated mid: 1 value differs")


def test_a_value_finite_on_one_rank_only_is_placed_at_its_token():
    spec = make_spec()
    r1 = spec.copy()
    r1.row("mid", 1, 1)[2] = np.inf
    b = divergence_break(_cand_ranks(spec, [spec, r1]), 0)
    assert b.position == 1 and "position None" not in b.message


def test_the_same_nan_on_every_rank_is_agreement():
    spec = make_spec()
    spec.row("mid", 0, 2)[4] = np.nan
    assert divergence_break(_cand_ranks(spec, [spec, spec.copy()]), 0) is None


@pytest.mark.parametrize("other", [-np.inf, np.nan])
def test_different_non_finite_values_on_two_ranks_diverge(other):
    spec = make_spec()
    r0, r1 = spec.copy(), spec.copy()
    r0.row("mid", 1, 1)[2] = np.inf
    r1.row("mid", 1, 1)[2] = other
    b = divergence_break(_cand_ranks(spec, [r0, r1]), 0)
    assert b is not None and b.kind == "rank_divergence" and b.sample == 1


def test_the_reference_side_is_checked_and_names_its_own_samples():
    spec = make_spec()
    r1 = spec.copy()
    r1.row("mlp_update", 2, 0)[6] += 0.75
    ref = _ranked(record(spec, name="ref"), [spec, r1])
    cand = record(_permuted(spec, [1, 2, 0]), name="cand")
    b = divergence_break(context(ref, cand), 0)
    assert b.message == ("ranks 0 and 1 of the reference disagree on replicated mlp_update: 1 value differs beyond "
                         "tolerance, max_abs=0.75 (sample 2, position 0)")
    assert (b.sample, b.samples) == (2, (2,))


def test_stats_level_replicas_are_compared_by_checksum_naming_reference_samples():
    """The candidate batches the samples as [1, 2, 0]; rank 1 differs in its samples 0 and 1 (reference 1 and 2)
    by one value each, far below any tolerance: the checksums still differ."""
    spec = make_spec()
    cand = _permuted(spec, [1, 2, 0])
    r1 = cand.copy()
    r1.row("mid", 0, 0)[0] = np.nextafter(r1.row("mid", 0, 0)[0], np.float32(np.inf))
    r1.row("mid", 1, 3)[1] += 1.0
    b = divergence_break(_cand_ranks(spec, [cand, r1], "stats"), 0)
    assert (b.kind, b.layer, b.tensor, b.sample, b.samples, b.position) == \
        ("rank_divergence", 0, "mid", 1, (1, 2), None)
    assert b.message == ("ranks 0 and 1 of the candidate disagree on replicated mid: checksums differ for samples "
                         "[1, 2] (stats level)")


# -- the ranks that hold a break's query heads ----------------------------------------------------------------

def _side(ranks):
    return SimpleNamespace(meta={"parallel": {"ranks": ranks}} if ranks is not None else {})


@pytest.mark.parametrize("heads,note", [
    ((2, 3), "query heads 2,3 are rank 1's (it holds query heads 2..3 and KV head 1)"),
    ((0,), "query head 0 is rank 0's (it holds query heads 0..1 and KV head 0)"),
    ((3, 1), "query head 1 is rank 0's (it holds query heads 0..1 and KV head 0); "
             "query head 3 is rank 1's (it holds query heads 2..3 and KV head 1)"),
])
def test_heads_note_names_the_ranks_holding_the_heads(heads, note):
    assert heads_note(_side(RANKS), heads) == note


def test_heads_note_gives_a_range_of_kv_heads():
    ranks = [{"rank": 0, "query_heads": [0, 8], "kv_heads": [0, 4]}, {"rank": 1, "query_heads": [8, 16],
                                                                     "kv_heads": [4, 8]}]
    assert heads_note(_side(ranks), (9,)) == "query head 9 is rank 1's (it holds query heads 8..15 and KV heads 4..7)"


@pytest.mark.parametrize("ranks,heads", [(None, (1,)), ([], (1,)), (RANKS, (4, 7)), (RANKS, ())])
def test_heads_note_is_none_when_no_rank_holds_the_heads(ranks, heads):
    assert heads_note(_side(ranks), heads) is None


def test_heads_note_survives_a_rank_without_kv_heads():
    ranks = [{"rank": 0, "query_heads": [0, 2], "kv_heads": [0, 1]}, {"rank": 1, "query_heads": [2, 4],
                                                                     "kv_heads": None}]
    note = heads_note(_side(ranks), (3,))
    assert note is None or "rank 1" in note


def test_heads_notes_adds_one_note_per_side_with_ranks_once():
    spec = make_spec()
    cand = _ranked(record(spec, name="cand"), [spec, spec])
    cand.meta["parallel"] = {"ranks": RANKS}
    ctx = context(record(spec, name="ref"), cand)
    first = Break(stage="layer", kind="value", message="m", layer=3, tensor="attn_heads", heads=(2,))
    heads_notes(ctx, 3, first)
    heads_notes(ctx, 3, first)
    want = "layer 3: candidate query head 2 is rank 1's (it holds query heads 2..3 and KV head 1)"
    assert [n for n in ctx.notes if n.startswith("layer 3")] == [want]


def test_heads_notes_adds_nothing_without_ranks():
    spec = make_spec()
    ctx = context(record(spec, name="ref"), record(spec, name="cand"))
    before = list(ctx.notes)
    heads_notes(ctx, 0, Break(stage="layer", kind="value", message="m", layer=0, tensor="attn_heads", heads=(1,)))
    assert ctx.notes == before
