"""engine/contract.py: each §2.1 precondition is refused with its rule name, naming a genuine offending
cell, exactly when a naive cell-by-cell check finds a violation, and accepted otherwise."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import Capture, examples
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state
from prefill_diff.engine import contract
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.skeleton import build
from prefill_diff.engine.shared.errors import PreconditionError

ARGS = MODEL_PRESETS["seed-2.8"]  # vocab_size 20: small enough to draw ids on both sides of it


def refused(rule, fn, *args):
    """The PreconditionError ``fn`` raises, after checking it names ``rule`` in its type, attribute and text."""
    with pytest.raises(PreconditionError) as e:
        fn(*args)
    assert e.value.rule == rule
    assert str(e.value).startswith(f"precondition {rule}: ")
    return str(e.value)


# -- (1) ids inside the vocabulary ----------------------------------------------------------------------------

@settings(max_examples=examples(80), deadline=None)
@given(st.data())
def test_ids_refused_exactly_when_a_valid_cell_is_outside_the_vocabulary(data):
    """(1) against a naive scan: refused iff a valid cell holds an id outside [0, V), naming the first such cell."""
    B, n, V = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 8))
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(-3, V + 2), min_size=n, max_size=n),
                                          min_size=B, max_size=B)))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=B,
                                            max_size=B)))
    bad = [(b, i) for b in range(B) for i in range(n) if valid[b, i] and not 0 <= int(ids[b, i]) < V]
    if not bad:
        assert contract.check_ids(ids, valid, V) is None
        return
    msg = refused("2.1(1)", contract.check_ids, ids, valid, V)
    b, i = bad[0]  # the first in row-major order
    assert f"sample {b}, position {i}: id {int(ids[b, i])}, vocab_size={V}" in msg


def test_ids_under_padding_are_not_checked():
    """(1) looks at valid cells only: any value under padding is accepted."""
    ids = torch.tensor([[-7, 1000, 3]])
    assert contract.check_ids(ids, torch.tensor([[False, False, True]]), 4) is None
    refused("2.1(1)", contract.check_ids, ids, torch.tensor([[False, True, True]]), 4)


def test_non_integer_ids_are_refused_as_precondition_1():
    """(1) a fractional id is no id of the vocabulary: refused as 2.1(1)."""
    with pytest.raises(PreconditionError, match=r"2\.1\(1\)"):
        contract.check_ids(torch.tensor([[1.0, 2.5]]), torch.tensor([[True, True]]), 10)


# -- (2) the validity mask ------------------------------------------------------------------------------------

def test_mask_accepted_returns_it_as_bool():
    """(2) a 0/1 mask as int, float or bool is accepted and returned as G, bool."""
    for mask in (torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
                 torch.tensor([[False, True, True], [True, True, True]])):
        got = contract.check_mask(torch.zeros(2, 3, dtype=torch.long), mask)
        assert got.dtype == torch.bool
        assert got.tolist() == [[x != 0 for x in row] for row in mask.tolist()]


@pytest.mark.parametrize("ids_shape,mask,words", [
    ((3,), torch.ones(3), "input_ids must be [B, n] (got shape [3])"),
    ((1, 2, 3), torch.ones(1, 2, 3), "input_ids must be [B, n] (got shape [1, 2, 3])"),
    ((2, 3), torch.ones(2, 2), "got mask [2, 2], ids [2, 3]"),
    ((2, 3), torch.ones(3, 2), "got mask [3, 2], ids [2, 3]"),
])
def test_mask_and_ids_of_the_wrong_shape_are_refused(ids_shape, mask, words):
    """(2) ids that are not [B, n], or a mask of another shape, are refused with both shapes."""
    assert words in refused("2.1(2)", contract.check_mask, torch.zeros(ids_shape, dtype=torch.long), mask)


@pytest.mark.parametrize("value", [2, -1, 0.5, float("nan")])
def test_mask_values_other_than_0_and_1_are_refused_at_the_first_such_cell(value):
    """(2) a mask value other than 0 or 1 (NaN included) is refused, naming its cell."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    mask[1, 2] = value
    mask_int = mask.long() if float(value).is_integer() else mask
    msg = refused("2.1(2)", contract.check_mask, torch.zeros(2, 3, dtype=torch.long), mask_int)
    assert "sample 1, position 2" in msg


def test_a_sample_without_valid_tokens_is_refused():
    """(2) a sample whose mask is all 0 is refused, naming it."""
    msg = refused("2.1(2)", contract.check_mask, torch.zeros(3, 2, dtype=torch.long),
                  torch.tensor([[1, 1], [1, 0], [0, 0]]))
    assert "sample 2 has none" in msg


def naive_holes(valid, seq):
    """(sample, column) of every invalid or foreign cell lying between two valid cells of one sequence."""
    out = set()
    B, n = valid.shape
    for b in range(B):
        for s in set(seq[b][valid[b]].tolist()):
            cols = [c for c in range(n) if valid[b, c] and seq[b, c] == s]
            out |= {(b, c) for c in range(cols[0], cols[-1] + 1) if c not in cols}
    return out


@settings(max_examples=examples(80), deadline=None)
@given(st.data())
def test_contiguity_refused_exactly_when_a_prompt_has_a_hole(data):
    """Against a naive scan: refused iff some sequence's valid cells are not one run, and the position named is
    such a hole."""
    B, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 7))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=B,
                                            max_size=B)))
    seq = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 2), min_size=n, max_size=n), min_size=B,
                                          max_size=B)))
    holes = naive_holes(valid, seq)
    if not holes:
        assert contract.check_contiguous(valid, seq) is None
        return
    msg = refused("2.1(2)", contract.check_contiguous, valid, seq)
    assert any(f"sample {b}: a padding position {c} lies inside the prompt" in msg for b, c in holes), (msg, holes)


def test_contiguity_of_padded_and_packed_rows():
    """Left/right padding and packed sequences are single runs; a padding cell inside a prompt is not."""
    rows = torch.arange(2)[:, None].expand(2, 4)
    assert contract.check_contiguous(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]).bool(), rows) is None
    assert contract.check_contiguous(torch.ones(1, 5, dtype=torch.bool), torch.tensor([[0, 0, 1, 1, 1]])) is None
    msg = refused("2.1(2)", contract.check_contiguous, torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]]).bool(), rows)
    assert "sample 1: a padding position 1" in msg


# -- (3) positions --------------------------------------------------------------------------------------------

def test_positions_accepted_when_increasing_per_sequence():
    """Gaps are allowed, a packed row restarts per sequence, and padding cells hold anything."""
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    seq = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1]])
    pos = torch.tensor([[-5, 3, 7, 8], [0, 1, 0, 1]])
    assert contract.check_positions(pos, valid, seq, 9) is None


@settings(max_examples=examples(80), deadline=None)
@given(st.data())
def test_positions_refused_exactly_when_out_of_range_or_not_increasing(data):
    """Against a naive scan: a valid cell outside [0, max_position) is named with its value; otherwise a valid
    cell not above the previous valid cell of its sequence is named with both values."""
    B, n, P = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    pos = torch.tensor(data.draw(st.lists(st.lists(st.integers(-2, P + 1), min_size=n, max_size=n), min_size=B,
                                          max_size=B)))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=B,
                                            max_size=B)))
    seq = torch.arange(B)[:, None].expand(B, n)
    out_of_range = [(b, i) for b in range(B) for i in range(n) if valid[b, i] and not 0 <= int(pos[b, i]) < P]
    down = []
    for b in range(B):
        cells = [i for i in range(n) if valid[b, i]]
        down += [(b, j, k) for j, k in zip(cells, cells[1:]) if pos[b, k] <= pos[b, j]]
    if out_of_range:
        b, i = out_of_range[0]
        msg = refused("2.1(3)", contract.check_positions, pos, valid, seq, P)
        assert f"sample {b}, position {i}: {int(pos[b, i])}, max_position={P}" in msg
    elif down:
        msg = refused("2.1(3)", contract.check_positions, pos, valid, seq, P)
        assert any(f"sample {b}, position {k}: {int(pos[b, k])} after {int(pos[b, j])}" in msg for b, j, k in down)
    else:
        assert contract.check_positions(pos, valid, seq, P) is None


@pytest.mark.parametrize("pos,words", [
    (torch.tensor([[0.0, 1.0]]), "positions must be integers (got dtype torch.float32)"),
    (torch.tensor([[False, True]]), "positions must be integers (got dtype torch.bool)"),
    (torch.tensor([[0, 1, 2]]), "got [1, 3], ids [1, 2]"),
])
def test_positions_of_another_dtype_or_shape_are_refused(pos, words):
    """(3) floating or bool positions, or positions of another shape than the ids, are refused."""
    assert words in refused("2.1(3)", contract.check_positions, pos, torch.ones(1, 2, dtype=torch.bool),
                            torch.zeros(1, 2, dtype=torch.long), 10)


# -- (4) vocabulary sizes, (5) inference mode -----------------------------------------------------------------

def built(args=ARGS):
    model, _ = build(Snapshot("seed-2.8", args, synthetic_state(args, 0)))
    return model


def test_vocab_sizes_accepted_when_they_agree():
    """(4) embedding and output rows equal vocab_size; a tokenizer as large or smaller (or none) fits."""
    model = built()
    V = ARGS.vocab_size
    for tok in (None, V, V - 5):
        assert contract.check_vocab(model, tok) is None


def test_vocab_sizes_refused_when_embedding_output_or_tokenizer_disagree():
    """(4) a larger tokenizer, or an embedding or output of other rows than vocab_size, is refused with the sizes."""
    V, d = ARGS.vocab_size, ARGS.dim
    model = built()
    msg = refused("2.1(4)", contract.check_vocab, model, V + 1)
    assert f"tokenizer size={V + 1}, vocab_size={V}" in msg
    model.tok_embeddings = nn.Embedding(V + 3, d)
    assert f"embedding rows={V + 3}, output rows={V}" in refused("2.1(4)", contract.check_vocab, model, None)
    model = built()
    model.output = nn.Linear(d, V - 1, bias=False)
    assert f"embedding rows={V}, output rows={V - 1}" in refused("2.1(4)", contract.check_vocab, model, None)


def test_inference_mode_refused_only_for_unseeded_dropout_in_training():
    """(5) refused only in training mode with dropout > 0 and no seed; eval, a seed or no dropout pass."""
    model = built(ARGS.replace(dropout=0.25))
    for training, seed in ((False, None), (False, 3), (True, 3)):
        model.train(training)
        assert contract.check_inference_mode(model, seed) is None
    model.train(True)
    assert "dropout=0.25 and no dropout_seed" in refused("2.1(5)", contract.check_inference_mode, model, None)
    no_dropout = built()
    no_dropout.train(True)
    assert contract.check_inference_mode(no_dropout, None) is None


def test_a_refused_request_leaves_no_trace():
    """Each of (1)-(3) refuses a call before layer 0: the recorder is given nothing, not even the inputs."""
    eng = Engine(Snapshot("seed-2.8", ARGS, synthetic_state(ARGS, 0)), NumericalConfig())
    ok_ids, ok_mask, ok_pos = torch.tensor([[1, 2, 3]]), torch.ones(1, 3), torch.arange(3)[None]
    cases = [("2.1(1)", (torch.tensor([[1, 2, ARGS.vocab_size]]), ok_mask, ok_pos)),
             ("2.1(2)", (ok_ids, torch.tensor([[1, 0, 1]]), ok_pos)),
             ("2.1(3)", (ok_ids, ok_mask, torch.tensor([[0, 2, 1]])))]
    for rule, call in cases:
        cap = Capture()
        with pytest.raises(PreconditionError) as e:
            eng.prefill(*call, recorder=cap)
        assert e.value.rule == rule
        assert cap.inputs_ is None and cap.states == {} and cap.caches == {} and cap.finals == {}
    cap = Capture()
    eng.prefill(ok_ids, ok_mask, ok_pos, recorder=cap)
    assert cap.inputs_ is not None and cap.finals
