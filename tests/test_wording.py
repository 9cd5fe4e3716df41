"""verify/wording.py: counts agree with their nouns and verbs, the final top-ids break is named once and ranks its
ids from 1 (as the top-ids table lists them), and a fixed envelope is named by its precision."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefill_diff.jobs import run_lockstep
from prefill_diff.verify import wording
from prefill_diff.verify.breaks import Break
from prefill_diff.verify.rank_checks import heads_note
from prefill_diff.verify.routing import Flip


def test_count_agree_and_some():
    assert [wording.count(n, "sample") for n in (0, 1, 2)] == ["0 samples", "1 sample", "2 samples"]
    assert wording.agree(1, "has", "have") == "has" and wording.agree(3, "has", "have") == "have"
    assert wording.some("sample", [2]) == "sample 2" and wording.some("sample", (1, 2)) == "samples [1, 2]"


def test_sample_counts_agree():
    assert wording.no_common_sample(3, 1, []).endswith("(reference 3 samples, candidate 1 sample)")
    assert wording.candidate_only_note([2]) == "candidate sample 2 has no counterpart in the reference (not compared)"
    assert wording.candidate_only_note([1, 2]).startswith("candidate samples [1, 2] have no counterpart")
    assert wording.subset_note([1], 2) == ("1 of 2 reference samples skipped (--allow-subset): sample 1 has no "
                                           "counterpart in the candidate")
    assert wording.coverage([1], 1, []).startswith("1 of 1 reference sample has no counterpart in the candidate "
                                                   "(not compared): sample 1;")
    cov = Break(stage="metadata", kind="coverage", message=wording.coverage([2], 3, []), samples=(2,))
    assert wording.break_line(cov) == "coverage | 1 of 3 reference samples has no counterpart in the candidate " \
                                      "(not compared): sample 2"


def test_token_slot_and_value_counts_agree():
    assert wording.positions_differ(0, 2, 7, 2, 1, 3).endswith("(1 of 3 computed tokens differs)")
    assert wording.cache_length_differs(0, 1, 2, 1) == ("sample 0: candidate holds 1 token, reference 2 (first "
                                                        "differing slot 1)")
    assert wording.cache_positions_differ(0, 1, 5, 1, 1, 4).endswith("(1 of 4 slots differs)")
    t = SimpleNamespace(tensor="mid", finite=SimpleNamespace(cand_only=1, ref_only=0, both=0, pad_cand=1, pad_ref=0,
                                                             pad_by_sample=((0, 0, 1),)))
    assert "mid: 1 valid value finite only in the candidate" in wording.nonfinite_valid(t)
    assert wording.nonfinite_padding(t).startswith("1 non-finite value in padding rows of mid in the candidate only")


def _flip(**kw) -> Flip:
    base = dict(layer=1, sample=0, position=3, reference=(0, 1), candidate=(0, 2), margin=0.01, bound=0.02,
                cand_sample=0)
    return Flip(**{**base, **kw})


def test_routing_counts_agree():
    assert wording.routing_inconclusive([_flip()], 1, 4) == (
        "INCONCLUSIVE | 1/4 layers: 1 routing flip within noise from layer 1; sample 0 not compared from there on "
        "(the candidate was not rerun with the reference's routing)")
    assert "2 routing flips within noise from layer 1; samples [0, 1]" in wording.routing_inconclusive(
        [_flip(), _flip(sample=1)], 1, 4)
    assert wording.routing_was_forced("candidate", 1).startswith("the candidate ran with its router overruled at 1 "
                                                                 "token (")
    assert wording.routing_replayed(1, 1) == (" | 1 routing flip within noise, replayed with the reference's experts "
                                              "forced at its 1 near-tie token")
    assert "(and 1 more token);" in wording.routing_flip(_flip(), "noise", 2)
    assert wording.routing_flip(_flip(candidate=(0,), margin=float("inf")), "", 1).startswith(
        "the candidate takes 1 expert per token, the reference 2")


def test_query_heads_of_a_rank_agree():
    ranks = [{"rank": 0, "query_heads": [0, 1], "kv_heads": [0, 1]},
             {"rank": 1, "query_heads": [1, 4], "kv_heads": [1, 2]}]
    side = SimpleNamespace(meta={"parallel": {"ranks": ranks}})
    assert heads_note(side, (0,)) == "query head 0 is rank 0's (it holds query head 0 and KV head 0)"
    assert heads_note(side, (2, 3)) == "query heads 2,3 are rank 1's (it holds query heads 1..3 and KV head 1)"


def test_a_top_ids_break_is_named_once_and_ranks_its_ids_from_1():
    """The first top id (index 0) differs: rank 1, as the table's first column of top ids."""
    detail = wording.top_ids_differ(1, 0, 14, 91, -1.334, 2.009)
    assert detail == ("sample 1: rank 1 is id 14 in the candidate, id 91 in the reference (reference logits -1.334 "
                      "vs 2.009, beyond tolerance)")
    b = Break(stage="final", kind="top_ids", message=detail, tensor="topk_ids", sample=1, samples=(1,))
    line = wording.break_line(b)
    assert line == ("final top ids | sample 1 | rank 1 is id 14 in the candidate, id 91 in the reference "
                    "(reference logits -1.334 vs 2.009, beyond tolerance)")
    assert wording.break_site(b) == "final top ids"


def test_the_fixed_envelope_is_named_by_its_precision():
    assert wording.own_twin_rule("bfloat16", "bfloat16").endswith(
        "numerics: candidate vs reference within the fixed bfloat16 envelope")


@pytest.mark.slow
def test_a_candidate_that_is_its_own_twin_names_the_envelope_of_its_numerics():
    """reference against bf16: the candidate is the reference's own path in bfloat16, its numerics judged by the
    bfloat16 envelope, and the rule says which."""
    rep = run_lockstep("reference", "bf16").report
    assert rep.calibration.startswith("calibrated: the candidate is the reference's own path in bfloat16 (its "
                                      "twin)"), rep.calibration
    assert rep.calibration.endswith(f"within the fixed {rep.policy.name} envelope") and \
        rep.policy.name == "bfloat16", rep.calibration
