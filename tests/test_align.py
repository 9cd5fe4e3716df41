"""verify/align.py: samples matched by token ids, cells by token index, coverage and near misses in words."""
from __future__ import annotations

import numpy as np
import pytest

from prefill_diff.dumps.reader import TraceError
from prefill_diff.verify.align import Alignment, NearMiss, as_slice, match_samples, near_misses, same_layout
from prefill_diff.verify.wording import near_miss

ARGS = {"dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "vocab_size": 50}


class FakeTrace:
    """What the alignment reads of a trace: samples, their cells (left-padded to a common width), inputs."""

    def __init__(self, samples, args=ARGS, n_layers=2, name="t", positions=None, width=None):
        self.samples = [tuple(s) for s in samples]
        self.n_samples, self.n_layers, self.args, self.name = len(self.samples), n_layers, dict(args), name
        self.width = width or max(map(len, self.samples))
        pos = np.zeros((self.n_samples, self.width), dtype=np.int64)
        for s, toks in enumerate(self.samples):
            pos[s, self.width - len(toks):] = np.arange(len(toks))
        if positions is not None:
            for (s, col), v in positions.items():
                pos[s, col] = v
        self.inputs = {"positions": pos}

    def cells(self, s):
        n = len(self.samples[s])
        return np.arange(self.width - n, self.width), np.arange(n)

    def pad_cols(self, s):
        return np.arange(self.width - len(self.samples[s]))


def test_samples_are_matched_by_token_ids_not_by_index():
    ref = FakeTrace([(1, 2, 3), (4, 5), (6, 7, 8, 9)])
    cand = FakeTrace([(6, 7, 8, 9), (1, 2, 3), (4, 5)])
    pairs, ref_only, cand_only = match_samples(ref, cand)
    assert [tuple(p) for p in pairs] == [(0, 1), (1, 2), (2, 0)] and ref_only == [] and cand_only == []
    assert pairs[0].ref == 0 and pairs[0].cand == 1


def test_repeated_prompts_are_matched_once_each_in_order():
    ref = FakeTrace([(1, 2), (1, 2), (3,)])
    cand = FakeTrace([(1, 2), (3,)])
    pairs, ref_only, cand_only = match_samples(ref, cand)
    assert [tuple(p) for p in pairs] == [(0, 0), (2, 1)] and ref_only == [1] and cand_only == []


def test_cells_are_aligned_by_token_index_across_paddings():
    ref = FakeTrace([(1, 2, 3), (4, 5)], width=3)
    cand = FakeTrace([(4, 5), (1, 2, 3)], width=6)  # wider padding, other order
    a = Alignment(ref, cand)
    cells = a.cells[1]  # reference sample 1 (4, 5): columns 1..2 in the reference, 4..5 in the candidate
    assert cells.ref_cols == slice(1, 3) and cells.cand_cols == slice(4, 6)
    assert cells.tokens.tolist() == [0, 1] and cells.ref_pad.tolist() == [0] and cells.cand_pad.tolist() == [0, 1, 2, 3]
    assert a.notes == []


def test_as_slice_only_for_contiguous_ascending_indices():
    assert as_slice(np.array([3, 4, 5])) == slice(3, 6)
    assert as_slice(np.array([7])) == slice(7, 8)
    gap = as_slice(np.array([1, 3, 4]))
    assert isinstance(gap, np.ndarray) and gap.tolist() == [1, 3, 4]


def test_a_dropped_and_a_retokenised_sample_are_a_coverage_break_with_the_near_miss():
    ref = FakeTrace([(1, 2, 3), (4, 5, 6, 7), (8, 9)])
    cand = FakeTrace([(1, 2, 3), (1, 8, 9)])  # sample 1 dropped, sample 2 with an extra leading token 1
    b, notes = Alignment(ref, cand).structure_break(allow_subset=False)
    assert (b.stage, b.kind, b.sample, b.samples) == ("metadata", "coverage", 1, (1, 2))
    assert b.message.startswith("2 of 3 reference samples have no counterpart in the candidate (not compared): "
                                "samples [1, 2]")
    assert "candidate sample 1 equals reference sample 2 with one extra leading token 1" in b.message
    assert b.message.endswith("; pass --allow-subset to compare against a subset on purpose")
    assert notes == ["candidate sample 1 has no counterpart in the reference (not compared)"]


def test_allow_subset_turns_the_coverage_break_into_a_note():
    ref = FakeTrace([(1, 2, 3), (4, 5, 6, 7)])
    cand = FakeTrace([(1, 2, 3), (9,)])
    b, notes = Alignment(ref, cand).structure_break(allow_subset=True)
    assert b is None
    assert notes == ["candidate sample 1 has no counterpart in the reference (not compared)",
                     "1 of 2 reference samples skipped (--allow-subset): sample 1 has no counterpart in the "
                     "candidate"]


@pytest.mark.parametrize("ref_toks,cand_toks,words", [
    ((5, 6, 7), (5, 6, 7, 9), "candidate sample 0 equals reference sample 0 with one extra trailing token 9"),
    ((5, 6, 7), (6, 7), "candidate sample 0 equals reference sample 0 without its leading token 5"),
    ((5, 6, 7), (5, 6), "candidate sample 0 equals reference sample 0 without its trailing token 7"),
    ((5, 6, 7, 8, 9), (5, 6, 1, 9), "reference sample 0 (5 tokens) and candidate sample 0 (4 tokens) share a "
                                    "prefix of 2 tokens and a suffix of 1 token"),
])
def test_near_misses_are_worded_by_their_shape(ref_toks, cand_toks, words):
    ref, cand = FakeTrace([ref_toks]), FakeTrace([cand_toks])
    misses = near_misses(ref, cand, [0], [0])
    assert [near_miss(m) for m in misses] == [words]
    b, _ = Alignment(ref, cand).structure_break(allow_subset=False)  # no sample in common: not comparable at all
    assert b.kind == "metadata" and b.message == ("traces are not comparable: no sample has the same token ids "
                                                  f"(reference 1 sample, candidate 1 sample); {words}")


def test_a_sample_sharing_no_end_with_any_candidate_has_no_near_miss():
    misses = near_misses(FakeTrace([(1, 2, 3)]), FakeTrace([(4, 5, 6), (7, 8)]), [0], [0, 1])
    assert misses == []


def test_the_closest_candidate_sample_is_named():
    ref, cand = FakeTrace([(1, 2, 3, 4)]), FakeTrace([(1, 9, 9, 9), (1, 2, 3, 5)])
    assert near_misses(ref, cand, [0], [0, 1]) == [NearMiss(0, 1, (1, 2, 3, 4), (1, 2, 3, 5), 3, 0)]


def test_other_architectures_are_not_comparable():
    ref = FakeTrace([(1, 2)])
    cand = FakeTrace([(1, 2)], args={**ARGS, "n_kv_heads": 2}, n_layers=3)
    b, _ = Alignment(ref, cand).structure_break(allow_subset=False)
    assert (b.stage, b.kind) == ("metadata", "metadata")
    assert b.message == "traces are not comparable: architectures differ (n_kv_heads 1 vs 2; layers stored 2 vs 3)"


def test_position_ids_are_compared_by_token_and_break_at_layer_0():
    ref = FakeTrace([(1, 2, 3), (4, 5)], width=3)
    assert Alignment(ref, FakeTrace([(4, 5), (1, 2, 3)], width=4)).positions_break() is None
    cand = FakeTrace([(4, 5), (1, 2, 3)], width=4, positions={(1, 3): 7})  # token 2 of reference sample 0
    b = Alignment(ref, cand).positions_break()
    assert (b.kind, b.layer, b.tensor, b.sample, b.position, b.samples) == ("positions", 0, "positions", 0, 2, (0,))
    assert b.message == ("sample 0: token 2 was given position id 7 in the candidate, 2 in the reference "
                         "(1 of 3 computed tokens differs)")


def test_a_golden_or_twin_must_have_the_references_layout():
    ref = FakeTrace([(1, 2, 3), (4, 5)], name="ref.h5")
    same_layout(ref, FakeTrace([(1, 2, 3), (4, 5)]))
    with pytest.raises(TraceError, match="its samples' token ids differ"):
        same_layout(ref, FakeTrace([(1, 2, 3), (4, 6)], name="twin.h5"))
    with pytest.raises(TraceError, match="sample 0 is laid out in other cells"):
        same_layout(ref, FakeTrace([(1, 2, 3), (4, 5)], width=5, name="twin.h5"))
