"""engine/calls.py: call planning for every batching mode, Placement's mapping of a call's (row, column) and
sequences onto trace (sample, column), and routing replay's coordinates, against independent enumerations."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.engine.calls import Placement, call_routing, forced_list, plan_calls
from prefill_diff.engine.coords import TraceRun
from prefill_diff.engine import contract
from prefill_diff.engine.calls import Faults
from prefill_diff.engine.shared.errors import PreconditionError

PAD = 0
MODES = ("unbatched", "left", "right", "packed")


def requests(lengths, first_id=3):
    """Rows of distinct ids and positions that start at an offset per sample (as after a reused prefix)."""
    rows, positions, at = [], [], first_id
    for i, k in enumerate(lengths):
        rows.append(list(range(at, at + k)))
        positions.append(list(range(2 * i, 2 * i + k)))
        at += k
    return rows, positions


def expected_rect(rows, positions, side):
    """ids, mask, positions of a padded rectangle, written cell by cell."""
    n = max(map(len, rows))
    ids, mask, pos = [], [], []
    for r, p in zip(rows, positions):
        pad = n - len(r)
        if side == "left":
            ids.append([PAD] * pad + r), mask.append([0] * pad + [1] * len(r)), pos.append([0] * pad + p)
        else:
            ids.append(r + [PAD] * pad), mask.append([1] * len(r) + [0] * pad), pos.append(p + [0] * pad)
    return ids, mask, pos


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_is_one_rectangle_written_cell_by_cell(side):
    """left/right: one call; each row is its sample padded on that side with pad_id, the mask 1 on its tokens,
    positions as given (0 under padding); one run per row spans the whole row (padding stays visible)."""
    rows, positions = requests([3, 5, 1])
    samples = [4, 7, 9]
    (call,) = plan_calls(rows, positions, samples, side, PAD)
    ids, mask, pos = expected_rect(rows, positions, side)
    assert call.ids.tolist() == ids and call.mask.tolist() == mask and call.positions.tolist() == pos
    assert call.segments is None and call.samples == samples and call.history == {}
    assert call.runs == [TraceRun(row=b, c0=0, c1=5, sample=s, t0=0) for b, s in enumerate(samples)]
    assert call.faults == Faults()


def test_unbatched_makes_one_unpadded_call_per_sample():
    """unbatched: one call per sample, in order, each a single unpadded row, its own run, its own history as
    sequence 0 (absent where the sample has none)."""
    rows, positions = requests([3, 5, 2])
    samples = [0, 1, 2]
    hist = {1: "prefix-of-1"}
    calls = plan_calls(rows, positions, samples, "unbatched", PAD, hist)
    assert len(calls) == 3
    for call, r, p, s in zip(calls, rows, positions, samples):
        assert call.ids.tolist() == [r] and call.mask.tolist() == [[1] * len(r)] and call.positions.tolist() == [p]
        assert call.samples == [s] and call.segments is None
        assert call.runs == [TraceRun(row=0, c0=0, c1=len(r), sample=s, t0=0)]
        assert call.history == ({0: hist[s]} if s in hist else {})


def test_packed_concatenates_samples_with_segments_and_cumulative_runs():
    """packed: one row, the samples end to end with no padding, segment i under sample i's tokens, run i over
    columns [sum of earlier lengths, + its length) (cu_seqlens)."""
    rows, positions = requests([3, 5, 1, 4])
    samples = [0, 1, 2, 3]
    (call,) = plan_calls(rows, positions, samples, "packed", PAD)
    flat, flat_pos, segs, runs, at = [], [], [], [], 0
    for i, (r, p) in enumerate(zip(rows, positions)):
        flat += r
        flat_pos += p
        segs += [i] * len(r)
        runs.append(TraceRun(row=0, c0=at, c1=at + len(r), sample=samples[i], t0=0))
        at += len(r)
    assert call.ids.tolist() == [flat] and call.positions.tolist() == [flat_pos]
    assert call.segments.tolist() == [segs] and call.mask.tolist() == [[1] * at]
    assert call.runs == runs


@pytest.mark.parametrize("mode", ["left", "right", "packed"])
def test_batched_history_is_keyed_by_sequence_index(mode):
    """In one batched call a reused prefix is keyed by the sample's sequence index within the call, not by the
    sample number; samples without one have none."""
    rows, positions = requests([2, 3, 4])
    (call,) = plan_calls(rows, positions, [5, 6, 8], mode, PAD, {6: "h6", 8: "h8"})
    assert call.history == {1: "h6", 2: "h8"}


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=5), st.sampled_from(MODES))
def test_every_sample_lands_once_in_the_trace_with_its_tokens_in_order(lengths, mode):
    """Through the runs, each sample's trace columns hold exactly its tokens and positions in order (its valid
    cells, read by trace column), every sample is covered by exactly one run, and every call cell a run maps
    lies inside the call's rectangle."""
    rows, positions = requests(lengths)
    samples = list(range(len(rows)))
    calls = plan_calls(rows, positions, samples, mode, PAD)
    seen = {}
    for call in calls:
        B, n = call.ids.shape
        for r, c0, c1, s, t0 in call.runs:
            assert 0 <= r < B and 0 <= c0 < c1 <= n
            assert s not in seen
            cells = {t0 + c - c0: (int(call.ids[r, c]), int(call.positions[r, c]))
                     for c in range(c0, c1) if call.mask[r, c]}
            seen[s] = [cells[t] for t in sorted(cells)]
    assert sorted(seen) == samples
    for s in samples:
        assert seen[s] == list(zip(rows[s], positions[s]))


@pytest.mark.parametrize("mode", ["left", "right", "unbatched"])
def test_padded_rows_and_positions_of_different_lengths_are_refused(mode):
    """A sample whose positions do not match its tokens cannot be written into a padded rectangle."""
    with pytest.raises(RuntimeError):
        plan_calls([[3, 4, 5], [6, 7]], [[0, 1], [0, 1]], [0, 1], mode, PAD)


def test_packed_rows_and_positions_of_different_lengths_are_refused_before_layer_0():
    """A packed row is never silently misaligned: its positions come out in another shape than its ids, which
    §2.1(3) refuses."""
    (packed,) = plan_calls([[3, 4, 5], [6, 7]], [[0, 1], [0, 1]], [0, 1], "packed", PAD)
    assert packed.positions.shape != packed.ids.shape
    valid = contract.check_mask(packed.ids, packed.mask)
    with pytest.raises(PreconditionError, match="positions must have the shape of input_ids") as e:
        contract.check_positions(packed.positions, valid, packed.segments, 100)
    assert e.value.rule == "2.1(3)"


# -- Placement ------------------------------------------------------------------------------------------------

class TraceLog:
    """A TraceRecorder that keeps every call in trace coordinates, cell by cell."""

    def __init__(self):
        self.inputs_, self.states, self.routing_, self.caches, self.finals = {}, {}, {}, {}, {}
        self.steps_, self.response_ = {}, {}

    def inputs(self, sample, col, ids, valid, positions, token_index):
        for j in range(len(ids)):
            key = (sample, col + j)
            assert key not in self.inputs_
            self.inputs_[key] = (int(ids[j]), int(valid[j]), int(positions[j]), int(token_index[j]))

    def state(self, layer, name, sample, col, x):
        for j in range(x.shape[0]):
            key = (layer, name, sample, col + j)
            assert key not in self.states, key  # no cell written twice
            self.states[key] = x[j].clone()

    def routing(self, layer, sample, col, ids, weights, margin, scale, logits=None):
        for j in range(ids.shape[0]):
            self.routing_[(layer, sample, col + j)] = (ids[j].tolist(), weights[j].tolist(), float(margin[j]),
                                                       float(scale[j]), None if logits is None else logits[j].tolist())

    def cache(self, layer, sample, keys, values, positions):
        self.caches[(layer, sample)] = (keys, values, positions)

    def final(self, sample, norm_last, logits, column, token_index):
        self.finals[sample] = (norm_last, logits, column, token_index)

    def steps(self, sample, col, phase, step, cache_len):
        self.steps_[(sample, col)] = (phase.tolist(), step.tolist(), cache_len.tolist())

    def response_logits(self, sample, token_index, logits):
        self.response_[sample] = (token_index, logits)


@pytest.fixture
def packed_call():
    rows, positions = requests([3, 5, 2])
    (call,) = plan_calls(rows, positions, [0, 1, 2], "packed", PAD)
    return call


def _packed_trace_cells(call):
    """(sample, trace column) -> packed column, for every token: sample i's token j sits at column c0_i + j."""
    out, at = {}, 0
    for s in call.samples:
        k = int((call.segments[0] == s).sum())
        for j in range(k):
            out[(s, j)] = at + j
        at += k
    return out


def test_placement_inputs_write_each_run_at_its_trace_columns(packed_call):
    """inputs: each packed sample's ids, validity, positions and token indices land at its own trace columns from 0."""
    call = packed_call
    log = TraceLog()
    tok = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]])
    Placement(log, call.runs, call.samples).inputs(call.ids, call.mask, call.positions, tok, call.segments)
    want = {(s, t): (int(call.ids[0, c]), 1, int(call.positions[0, c]), int(tok[0, c]))
            for (s, t), c in _packed_trace_cells(call).items()}
    assert log.inputs_ == want


@pytest.mark.parametrize("chunk", [1, 3, 4, 10])
def test_placement_state_reassembles_chunks_onto_trace_cells(packed_call, chunk):
    """States recorded chunk by chunk (col_start = the chunk's first column) land at the same trace cells as the
    whole call would, each exactly once, whatever the chunk size."""
    call = packed_call
    n = call.ids.shape[1]
    x = torch.randn(1, n, 6)
    log = TraceLog()
    place = Placement(log, call.runs, call.samples)
    for c0 in range(0, n, chunk):
        place.state(2, "mid", x[:, c0:c0 + chunk], c0)
    cells = _packed_trace_cells(call)
    assert set(log.states) == {(2, "mid", s, t) for s, t in cells}
    for (s, t), c in cells.items():
        assert torch.equal(log.states[(2, "mid", s, t)], x[0, c])


def test_placement_state_beyond_every_run_writes_nothing():
    """A chunk whose columns lie outside every run (here: a call's runs narrowed to the first columns) is
    dropped, not written at a wrong trace column."""
    log = TraceLog()
    place = Placement(log, [TraceRun(row=0, c0=0, c1=2, sample=0, t0=0)], [0])
    place.state(0, "mid", torch.randn(1, 3, 4), 5)
    assert log.states == {}


def test_placement_offsets_a_run_that_starts_inside_its_sample():
    """A run whose cells hold its sample from trace column t0 on (not 0) is written from there: call column c
    lands at trace column t0 + c - c0, for states, inputs and the gathered column alike."""
    run = TraceRun(row=1, c0=2, c1=6, sample=4, t0=3)
    log = TraceLog()
    place = Placement(log, [run], [4])
    x = torch.randn(2, 8, 3)
    place.state(0, "mid", x[:, :5], 0)
    place.state(0, "mid", x[:, 5:], 5)
    assert sorted(log.states) == [(0, "mid", 4, t) for t in range(3, 7)]
    for c in range(2, 6):
        assert torch.equal(log.states[(0, "mid", 4, 3 + c - 2)], x[1, c])
    ids = torch.arange(16).view(2, 8)
    place.inputs(ids, torch.ones(2, 8), ids + 100, ids + 200, torch.zeros(2, 8))
    assert log.inputs_ == {(4, 3 + c - 2): (int(ids[1, c]), 1, int(ids[1, c]) + 100, int(ids[1, c]) + 200)
                           for c in range(2, 6)}
    place.final(0, torch.zeros(3), torch.zeros(5), (1, 5), 9)
    assert log.finals[4][2] == 3 + 5 - 2


@pytest.mark.parametrize("with_logits", [False, True])
def test_placement_routing_maps_cells_like_states(packed_call, with_logits):
    """routing: each cell's experts, weights, margin, scale (and logits when given) land at the state's trace cell."""
    call = packed_call
    n, k, E = call.ids.shape[1], 2, 4
    ids = torch.randint(0, E, (1, n, k))
    weights, margin, scale = torch.rand(1, n, k), torch.rand(1, n), torch.rand(1, n)
    logits = torch.randn(1, n, E) if with_logits else None
    log = TraceLog()
    place = Placement(log, call.runs, call.samples)
    for c0 in range(0, n, 4):
        sl = slice(c0, c0 + 4)
        place.routing(1, ids[:, sl], weights[:, sl], margin[:, sl], scale[:, sl],
                      None if logits is None else logits[:, sl], c0)
    cells = _packed_trace_cells(call)
    assert set(log.routing_) == {(1, s, t) for s, t in cells}
    for (s, t), c in cells.items():
        got = log.routing_[(1, s, t)]
        assert got[:4] == (ids[0, c].tolist(), weights[0, c].tolist(), float(margin[0, c]), float(scale[0, c]))
        assert got[4] == (None if logits is None else logits[0, c].tolist())


def test_placement_cache_and_final_name_the_sample_and_its_trace_column():
    """cache and final take a call's sequence index; the trace gets the sample (here samples 5, 2 in that order)
    and, for final, the gathered column in trace coordinates: a packed column minus its run's start."""
    runs = [TraceRun(row=0, c0=0, c1=3, sample=5, t0=0), TraceRun(row=0, c0=3, c1=7, sample=2, t0=0)]
    log = TraceLog()
    place = Placement(log, runs, [5, 2])
    k, v, p = torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.arange(4)
    place.cache(1, 1, k, v, p)
    assert list(log.caches) == [(1, 2)] and log.caches[(1, 2)][0] is k
    h, z = torch.randn(6), torch.randn(10)
    place.final(1, h, z, (0, 6), 3)
    place.final(0, h, z, (0, 2), 2)
    assert log.finals[2][2:] == (6 - 3, 3) and log.finals[5][2:] == (2, 2)
    assert log.finals[2][0] is h and log.finals[2][1] is z


def test_placement_final_keeps_a_padded_column():
    """In a padded rectangle (t0 = c0 = 0) the trace column is the call column, padding included: the last
    column fault's gathered cell is reported where it was read."""
    rows, positions = requests([2, 4])
    (call,) = plan_calls(rows, positions, [0, 1], "right", PAD)
    log = TraceLog()
    place = Placement(log, call.runs, call.samples)
    place.final(0, torch.zeros(3), torch.zeros(5), (0, 3), 1)
    assert log.finals[0][2] == 3


# -- routing replay's coordinates -----------------------------------------------------------------------------

FORCED = {0: {(0, 1): (2, 3), (2, 0): (1, 0), (3, 4): (0, 2)}, 2: {(2, 5): (3, 1)}, 3: {(1, 0): (0, 1)}}


def test_call_routing_renames_samples_to_sequences_and_drops_other_samples():
    """{layer: {(sample, token): experts}} becomes {layer: {(sequence, token): experts}} for the call's samples;
    cells of samples the call does not hold are left out (every layer kept)."""
    samples = [2, 0]  # sample 2 is the call's sequence 0
    got = call_routing(FORCED, samples)
    want = {}
    for layer, cells in FORCED.items():
        want[layer] = {}
        for (s, t), ids in cells.items():
            for q, sample in enumerate(samples):
                if sample == s:
                    want[layer][(q, t)] = ids
    assert got == want
    assert got[3] == {}  # sample 1 is not in this call
    assert call_routing({}, samples) == {}


def test_forced_list_is_sorted_by_layer_sample_and_token():
    """The forced cells are listed by layer, then sample, then token, experts as lists."""
    got = forced_list(FORCED)
    cells = [(layer, s, t, ids) for layer, c in FORCED.items() for (s, t), ids in c.items()]
    cells.sort(key=lambda x: (x[0], x[1], x[2]))
    assert got == [{"layer": layer, "sample": s, "token": t, "experts": list(ids)} for layer, s, t, ids in cells]
    assert all(isinstance(d["experts"], list) for d in got)

