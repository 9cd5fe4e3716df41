"""engine/native/faults.py: each §2.11 fault changes exactly what it claims and nothing else, checked on the
helpers against naive enumerations and through the engine against the same call without the fault."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import Capture, padded
from prefill_diff.engine.coords import CacheWrite, Cell
from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.native.attention import AttentionMask, get_kernel
from prefill_diff.engine.calls import Faults, SkippedKV
from prefill_diff.engine.native.faults import gathered_cell, padding_visible_mask, rewire_heads, skipped_kv_keep
from prefill_diff.engine.native.prefill import CacheConfig, Engine, NumericalConfig
from prefill_diff.engine.shared.errors import CacheInvariantError

STATES = ("layer_input", "attn_heads", "attn_update", "mid", "mlp_update", "layer_output")


def test_no_fault_by_default_and_faults_are_immutable():
    """Faults() switches nothing on, and a Faults cannot be altered after it is planned for a call."""
    f = Faults()
    assert not (f.unmasked_padding or f.masked_row_softmax or f.last_column)
    assert f.head_map is None and f.skip_kv is None and f.window_shift == 0 and f.router is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.last_column = True


# -- row 1: the gathered cell ---------------------------------------------------------------------------------

def test_gathered_cell_moves_only_the_column_and_only_under_row_1():
    """Row 1 moves the gathered cell to the last column of its row; without it (or under other faults) the cell
    stays."""
    for row in range(3):
        for col in range(6):
            for n in range(col + 1, 8):
                last = Cell(row=row, col=col)
                assert gathered_cell(last, n, Faults()) == last
                assert gathered_cell(last, n, Faults(last_column=True)) == Cell(row=row, col=n - 1)
                assert gathered_cell(last, n, Faults(head_map=(0, 1), window_shift=1)) == last  # other faults


# -- row 2: the skipped cache entry ---------------------------------------------------------------------------

def test_skipped_kv_keep_drops_exactly_the_named_token_of_the_named_layer_and_sequence():
    """Against an enumeration of every (skip, write): only a write of the skipped layer and sequence whose token
    range holds the token gets a mask, and it is False at that token alone."""
    writes = [CacheWrite(row=r, seq=s, a=a, e=e, tok0=t0)
              for r in range(2) for s in range(2) for a, e in [(0, 4), (2, 5), (3, 3)] for t0 in (0, 3)]
    assert skipped_kv_keep(None, 0, writes[0]) is None
    for layer in range(3):
        for skip in (SkippedKV(layer=lk, seq=sk, token=tk) for lk in range(3) for sk in range(2) for tk in range(8)):
            for w in writes:
                got = skipped_kv_keep(skip, layer, w)
                toks = [w.tok0 + i for i in range(w.e - w.a)]
                if skip.layer == layer and skip.seq == w.seq and skip.token in toks:
                    assert got.tolist() == [t != skip.token for t in toks], (skip, layer, w)
                else:
                    assert got is None, (skip, layer, w)


# -- row 4: the head map --------------------------------------------------------------------------------------

def naive_head(q, k, v, b, h, g):
    """Causal softmax attention of query head h over KV head g, one query at a time, float64."""
    S, D = q.shape[2], q.shape[3]
    out = torch.zeros(S, D, dtype=torch.float64)
    for i in range(S):
        s = [float(q[b, h, i] @ k[b, g, j]) / math.sqrt(D) for j in range(i + 1)]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        for j in range(i + 1):
            out[i] += e[j] / sum(e) * v[b, g, j]
    return out


def causal_mask(B, S):
    tok = torch.arange(S).expand(B, S)
    seq = torch.zeros(B, S, dtype=torch.long)
    return AttentionMask(tok, tok, seq, seq)


def test_rewire_heads_recomputes_the_rewired_heads_alone():
    """Query heads whose KV head differs from g(h) become attention over the KV head the map names (a naive
    loop); every other head stays bit-identical."""
    torch.manual_seed(0)
    B, H, Hkv, S, D = 2, 4, 2, 5, 8
    q, k, v = torch.randn(B, H, S, D, dtype=torch.float64), torch.randn(B, Hkv, S, D, dtype=torch.float64), \
        torch.randn(B, Hkv, S, D, dtype=torch.float64)
    kernel, mask = get_kernel("eager"), causal_mask(B, S)
    standard = [h * Hkv // H for h in range(H)]  # g(h) = ⌊h·H_kv/H_q⌋
    head_map = [1, 0, 1, 0]  # heads 0 and 3 read the other KV head
    out = kernel(q, k, v, mask)
    before = out.clone()
    rewire_heads(out, kernel, q, k, v, mask, head_map, standard)
    for h in range(H):
        if head_map[h] == standard[h]:
            assert torch.equal(out[:, h], before[:, h]), h
        else:
            for b in range(B):
                torch.testing.assert_close(out[b, h], naive_head(q, k, v, b, h, head_map[h]), rtol=0, atol=1e-12)
                assert not torch.allclose(out[b, h], before[b, h])


def test_rewire_heads_with_the_standard_map_does_nothing():
    """With the standard map no head is recomputed: the kernel is not called and the output is untouched."""
    calls = []

    def spy(*a):
        calls.append(a)
        return get_kernel("eager")(*a)
    q, k, v = torch.randn(1, 4, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out = torch.randn(1, 4, 3, 4)
    before = out.clone()
    standard = [0, 0, 1, 1]  # g(h) for 4 query heads over 2 KV heads
    rewire_heads(out, spy, q, k, v, causal_mask(1, 3), list(standard), standard)
    assert calls == [] and torch.equal(out, before)


# -- row 5: padding keys visible ------------------------------------------------------------------------------

def left_padded_cells(lengths):
    """q_tok, q_seq, row_seqs of a left-padded batch (one sequence per row; -1 under padding)."""
    n = max(lengths)
    q_tok = torch.full((len(lengths), n), -1)
    q_seq = torch.full((len(lengths), n), -1)
    for b, k in enumerate(lengths):
        q_tok[b, n - k:] = torch.arange(k)
        q_seq[b, n - k:] = b
    return q_tok, q_seq, [[b] for b in range(len(lengths))]


@pytest.mark.parametrize("sentinel", [True, False])
@pytest.mark.parametrize("c0", [0, 2])
def test_padding_visible_mask_shows_padding_keys_to_later_valid_queries_only(sentinel, c0):
    """Under row 5 a valid query at column i sees every key column j <= i of its row, padding included; a padding
    query sees only the sentinel key (or none without it). Against the correct mask, the only visibility added
    is (valid query, padding key to its left); none is removed."""
    q_tok, q_seq, row_seqs = left_padded_cells([6, 3, 1])
    q_tok, q_seq = q_tok[:, c0:], q_seq[:, c0:]
    B, S = q_tok.shape
    got = padding_visible_mask(q_tok, q_seq, row_seqs, c0, c0 + S, sentinel).visible
    want = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                want[b, i, j] = j <= i if q_tok[b, i] >= 0 else (sentinel and j == 0)
    assert torch.equal(got, want)
    correct = AttentionMask(q_tok, q_tok, q_seq, q_seq, sentinel).visible
    added = got & ~correct
    assert not (correct & ~got).any()
    for b, i, j in added.nonzero().tolist():
        assert q_tok[b, i] >= 0 and q_tok[b, j] < 0 and j < i
    assert added.any()


def test_padding_visible_mask_changes_nothing_in_a_packed_row_without_padding():
    """Row 5 on a packed row (no padding at all) should see what the correct mask sees."""
    q_tok = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    q_seq = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    got = padding_visible_mask(q_tok, q_seq, [[0, 1]], 0, 7, True).visible
    assert torch.equal(got, AttentionMask(q_tok, q_tok, q_seq, q_seq).visible)


# -- through the engine: each fault against the same call without it -----------------------------------------

@pytest.fixture(scope="module")
def engine():
    return Engine(load_snapshot(ModelSpec("synthetic")), NumericalConfig(dtype="float64"))


def run(engine, prompts, side, faults=Faults(), cache=CacheConfig()):
    ids, mask, pos = padded(prompts, side)
    cap = Capture()
    res = engine.prefill(ids, mask, pos, cache, recorder=cap, faults=faults)
    return res, cap, mask.bool()


PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]


def test_skip_kv_drops_one_cache_entry_and_changes_nothing_else(engine):
    """Row 2: layer 1 of sequence 1 lacks token 2 in its cache (keys, values and positions: that entry alone);
    every other cache entry, every state and the logits are bit-identical; the cache invariants report it."""
    skip = SkippedKV(layer=1, seq=1, token=2)
    base, bcap, _ = run(engine, PROMPTS, "left")
    res, cap, _ = run(engine, PROMPTS, "left", Faults(skip_kv=skip), CacheConfig(invariants="record"))
    assert set(cap.caches) == set(bcap.caches)
    for key, (k, v, p) in bcap.caches.items():
        if key == (skip.layer, skip.seq):
            keep = [t for t in range(k.shape[1]) if t != skip.token]
            k, v, p = k[:, keep], v[:, keep], p[keep]
        for got, want in zip(cap.caches[key], (k, v, p)):
            assert torch.equal(got, want), key
    assert cap.states.keys() == bcap.states.keys()
    for key, x in bcap.states.items():
        assert torch.equal(cap.states[key], x), key
    assert torch.equal(res.next_logits, base.next_logits)
    violations = res.cache_metadata["invariant_violations"]
    assert any("sequence 1" in v and "invariant 1" in v for v in violations), violations
    assert base.cache_metadata["invariant_violations"] == []
    with pytest.raises(CacheInvariantError):
        run(engine, PROMPTS, "left", Faults(skip_kv=skip))


def test_last_column_gathers_the_rectangle_last_column_for_short_right_padded_samples(engine):
    """Row 1: the short sample's logits are unembed(Norm(R_L)) at the rectangle's last column (computed here from
    its recorded layer output) instead of at its last token; the full-length sample and every state are
    unchanged."""
    base, bcap, _ = run(engine, PROMPTS, "right")
    res, cap, _ = run(engine, PROMPTS, "right", Faults(last_column=True))
    n = max(map(len, PROMPTS))
    assert base.gather_cells == [Cell(0, n - 1), Cell(1, len(PROMPTS[1]) - 1)]
    assert res.gather_cells == [Cell(0, n - 1), Cell(1, n - 1)]
    for key, x in bcap.states.items():
        assert torch.equal(cap.states[key], x), key
    assert torch.equal(res.next_logits[0], base.next_logits[0])
    last = bcap.states[(engine.args.n_layers - 1, "layer_output")][1, n - 1]
    with torch.no_grad():
        want = engine.model.unembed(engine.model.norm(last))
    torch.testing.assert_close(res.next_logits[1], want, rtol=0, atol=1e-12)
    assert not torch.allclose(res.next_logits[1], base.next_logits[1])
    assert cap.finals[1][2] == Cell(1, n - 1)


def test_masked_row_softmax_poisons_only_the_padding_rows_at_layer_0(engine):
    """Row 7: without the sentinel a padding query row enters softmax with no finite score; at layer 0 exactly
    the padding cells become non-finite and every valid cell is bit-identical; the unpadded row is unchanged at
    every layer."""
    _, bcap, valid = run(engine, PROMPTS, "left")
    _, cap, _ = run(engine, PROMPTS, "left", Faults(masked_row_softmax=True))
    for name in STATES:
        x, want = cap.states[(0, name)], bcap.states[(0, name)]
        if name != "layer_input":
            assert (~torch.isfinite(x).all(-1) == ~valid).all(), name
        assert torch.equal(x[valid], want[valid]), name
        for layer in range(engine.args.n_layers):
            assert torch.equal(cap.states[(layer, name)][0], bcap.states[(layer, name)][0]), (layer, name)


def test_unmasked_padding_changes_left_padded_short_rows_only(engine):
    """Row 5 through the engine: in a left-padded batch the short row's valid cells change from layer 0's
    attention on; the unpadded row is bit-identical everywhere; a right-padded batch (padding after every valid
    token) is bit-identical throughout."""
    base, bcap, valid = run(engine, PROMPTS, "left")
    res, cap, _ = run(engine, PROMPTS, "left", Faults(unmasked_padding=True))
    for key, x in bcap.states.items():
        assert torch.equal(cap.states[key][0], x[0]), key
    assert torch.equal(cap.states[(0, "layer_input")], bcap.states[(0, "layer_input")])
    assert not torch.allclose(cap.states[(0, "attn_update")][1][valid[1]], bcap.states[(0, "attn_update")][1][valid[1]])
    assert torch.equal(res.next_logits[0], base.next_logits[0])
    rbase, rcap, _ = run(engine, PROMPTS, "right")
    rres, rfault, _ = run(engine, PROMPTS, "right", Faults(unmasked_padding=True))
    for key, x in rcap.states.items():
        assert torch.equal(rfault.states[key], x), key
    assert torch.equal(rres.next_logits, rbase.next_logits)


def test_window_shift_widens_the_window_by_one_and_nothing_else():
    """window_shift=1 on a model whose every layer has a window W: tokens with index < W saw all their history
    already and stay bit-identical at every layer; tokens from W on change at layer 0. On a model without a
    window the fault changes nothing."""
    snap = load_snapshot(ModelSpec("synthetic:mistral"))
    W = snap.args.sliding_window
    eng = Engine(snap, NumericalConfig(dtype="float64"))
    prompt = [list(range(3, 3 + W + 4))]
    _, bcap, _ = run(eng, prompt, "left")
    _, cap, _ = run(eng, prompt, "left", Faults(window_shift=1))
    for key, x in bcap.states.items():
        assert torch.equal(cap.states[key][0, :W], x[0, :W]), key
    assert not torch.allclose(cap.states[(0, "attn_update")][0, W:], bcap.states[(0, "attn_update")][0, W:])
    plain = Engine(load_snapshot(ModelSpec("synthetic")), NumericalConfig(dtype="float64"))
    a, acap, _ = run(plain, prompt, "left")
    b, fcap, _ = run(plain, prompt, "left", Faults(window_shift=1))
    assert all(torch.equal(fcap.states[key], x) for key, x in acap.states.items())
    assert torch.equal(a.next_logits, b.next_logits)
