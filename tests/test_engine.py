"""The engine against an independent, naive per-(sample, head, query) implementation in float64."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import Capture, padded
from prefill_diff.engine.shared.errors import MaskError, PreconditionError
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native.prefill import CacheConfig, Engine, Faults, NumericalConfig, prefill
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.models.synthetic import synthetic_state


def naive_prefill(state, args, tokens, positions):
    """One sample, no batching, explicit loops; returns per-layer outputs, post-RoPE K, V and logits."""
    W = {k: v.double() for k, v in state.items()}
    n, d, H, Hkv, D = len(tokens), args.dim, args.n_heads, args.n_kv_heads, args.head_dim

    def rms(x, w):
        return w * (x / math.sqrt(float((x * x).mean()) + args.norm_eps))

    def rope(vec, p):  # rotate-half convention on one head vector
        out = vec.clone()
        half = D // 2
        for i in range(half):
            theta = p * args.rope_theta ** (-2 * i / D)
            c, s = math.cos(theta), math.sin(theta)
            out[i] = vec[i] * c - vec[i + half] * s
            out[i + half] = vec[i + half] * c + vec[i] * s
        return out

    x = torch.stack([W["tok_embeddings.weight"][t] for t in tokens])  # (n, d)
    layers, keys, values = [], [], []
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        h = torch.stack([rms(x[i], W[p + "attention_norm.weight"]) for i in range(n)])
        q = (h @ W[p + "attention.wq.weight"].T).view(n, H, D)
        k = (h @ W[p + "attention.wk.weight"].T).view(n, Hkv, D)
        v = (h @ W[p + "attention.wv.weight"].T).view(n, Hkv, D)
        qr = torch.stack([torch.stack([rope(q[i, hh], positions[i]) for hh in range(H)]) for i in range(n)])
        kr = torch.stack([torch.stack([rope(k[i, g], positions[i]) for g in range(Hkv)]) for i in range(n)])
        o = torch.zeros(n, H, D, dtype=torch.float64)
        for hh in range(H):
            g = hh * Hkv // H
            for i in range(n):
                scores = [float(qr[i, hh] @ kr[j, g]) / math.sqrt(D) for j in range(i + 1)]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                z = sum(e)
                for j in range(i + 1):
                    o[i, hh] += e[j] / z * v[j, g]
        attn = o.reshape(n, H * D) @ W[p + "attention.wo.weight"].T
        u = x + attn
        h2 = torch.stack([rms(u[i], W[p + "ffn_norm.weight"]) for i in range(n)])
        gate = h2 @ W[p + "feed_forward.w1.weight"].T
        up = h2 @ W[p + "feed_forward.w3.weight"].T
        mlp = (gate * torch.sigmoid(gate) * up) @ W[p + "feed_forward.w2.weight"].T
        x = u + mlp
        layers.append({"attn_update": attn, "mid": u, "mlp_update": mlp, "layer_output": x})
        keys.append(kr.transpose(0, 1))  # (Hkv, n, D)
        values.append(v.transpose(0, 1))
    final = rms(x[-1], W["norm.weight"])
    logits = W["output.weight"] @ final
    return layers, keys, values, logits


@pytest.fixture(scope="module")
def snap():
    return load_snapshot(ModelSpec("synthetic"))


@pytest.mark.parametrize("kernel", ["eager", "sdpa", "tiled"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_engine_matches_naive_loop_float64(snap, prompts, kernel, side):
    eng = Engine(snap, NumericalConfig(dtype="float64", kernel=kernel, block_size=4))
    ids, mask, pos = padded(prompts, side)
    cap = Capture()
    res = eng.prefill(ids, mask, pos, recorder=cap)
    n = ids.shape[1]
    for b, p in enumerate(prompts):
        layers, keys, values, logits = naive_prefill(snap.state, snap.args, p, list(range(len(p))))
        c0 = n - len(p) if side == "left" else 0
        cols = slice(c0, c0 + len(p))
        for layer, want in enumerate(layers):
            for name, t in want.items():
                got = cap.states[(layer, name)][b, cols]
                assert torch.allclose(got, t, atol=1e-6, rtol=0), (layer, name, (got - t).abs().max())
            k, v, positions = cap.caches[(layer, b)]
            assert torch.allclose(k, keys[layer], atol=1e-6, rtol=0)
            assert torch.allclose(v, values[layer], atol=1e-6, rtol=0)
            assert positions.tolist() == list(range(len(p)))
        assert torch.allclose(res.next_logits[b], logits, atol=1e-6, rtol=0)
        assert res.gather_cells[b] == (b, c0 + len(p) - 1)


def test_engine_matches_naive_loop_explicit_positions(snap):
    """RoPE reads the position descriptor, not the column: offset positions change K and the result."""
    p = [3, 4, 5, 6]
    positions = [10, 11, 12, 13]
    eng = Engine(snap, NumericalConfig(dtype="float64"))
    cap = Capture()
    res = eng.prefill(torch.tensor([p]), torch.ones(1, 4), torch.tensor([positions]), recorder=cap)
    _, keys, _, logits = naive_prefill(snap.state, snap.args, p, positions)
    assert torch.allclose(res.next_logits[0], logits, atol=1e-6, rtol=0)
    assert torch.allclose(cap.caches[(0, 0)][0], keys[0], atol=1e-6, rtol=0)
    assert cap.caches[(0, 0)][2].tolist() == positions


def test_batched_padding_does_not_change_results(snap, prompts):
    """Left, right and packed layouts give each sample the logits of its unbatched prefill."""
    eng = Engine(snap, NumericalConfig(dtype="float64"))
    alone = [eng.prefill(torch.tensor([p]), torch.ones(1, len(p)), torch.arange(len(p))[None]).next_logits[0]
             for p in prompts]
    for side in ("left", "right"):
        res = eng.prefill(*padded(prompts, side))
        for b in range(len(prompts)):
            assert torch.allclose(res.next_logits[b], alone[b], atol=1e-10)
    flat = torch.tensor([[t for p in prompts for t in p]])
    seg = torch.tensor([[i for i, p in enumerate(prompts) for _ in p]])
    pos = torch.tensor([[j for p in prompts for j in range(len(p))]])
    res = eng.prefill(flat, torch.ones_like(flat), pos, segments=seg)
    for b in range(len(prompts)):
        assert torch.allclose(res.next_logits[b], alone[b], atol=1e-10)


def test_padding_rows_are_finite(snap, prompts):
    cap = Capture()
    Engine(snap).prefill(*padded(prompts, "left"), recorder=cap)
    for (layer, name), x in cap.states.items():
        assert torch.isfinite(x).all(), (layer, name)


def test_masked_row_fault_puts_nan_in_padding_rows_only_at_layer_0(snap, prompts):
    cap = Capture()
    ids, mask, pos = padded(prompts, "left")
    Engine(snap).prefill(ids, mask, pos, CacheConfig(invariants="record"), recorder=cap,
                         faults=Faults(masked_row_softmax=True))
    a0 = cap.states[(0, "attn_update")]
    valid = mask.bool()
    assert torch.isfinite(a0[valid]).all()
    assert torch.isnan(a0[~valid]).all()
    assert torch.isnan(cap.states[(1, "attn_update")][valid]).any()  # the spread


def test_last_valid_gather_mixed_lengths(snap, prompts):
    """Right padding: the gather must not take the rectangle's last column (§2.6-§2.7)."""
    eng = Engine(snap)
    ids, mask, pos = padded(prompts, "right")
    good = eng.prefill(ids, mask, pos)
    assert [c for _, c in good.gather_cells] == [len(p) - 1 for p in prompts]
    bad = eng.prefill(ids, mask, pos, faults=Faults(last_column=True))
    assert [c for _, c in bad.gather_cells] == [ids.shape[1] - 1] * 3
    assert torch.equal(bad.next_logits[0], good.next_logits[0])  # the longest sample is unaffected
    assert not torch.allclose(bad.next_logits[1], good.next_logits[1])


def test_seed_2_8_shapes():
    """The §2.8 ledger: B=1, n=12, d=8, L=2, H_q=2, H_kv=1, d_h=4, |V|=20; 192 cached scalars."""
    from prefill_diff.engine.config import Inputs, load_side
    from prefill_diff.engine.native.ledger import ledger
    from prefill_diff.engine.prepared import default_token_ids, prepare
    side = load_side("reference", ModelSpec("seed-2.8"), Inputs(token_ids=default_token_ids(20, (12,))))
    (lg,) = ledger(prepare(side))
    rows = dict(lg.rows)
    assert rows["layer-input residual R_l"] == (1, 12, 8)
    assert rows["query Q"] == (1, 2, 12, 4)
    assert rows["key K"] == (1, 1, 12, 4) and rows["value V"] == (1, 1, 12, 4)
    assert rows["scores S (materialised)"] == (1, 2, 12, 12)
    assert rows["attention output (before concat)"] == (1, 2, 12, 4)
    assert rows["layer-output residual R_l+1"] == (1, 12, 8)
    assert lg.cache_scalars == 192
    assert lg.finals == [(0, 11, (8,), (20,))]


def test_cache_lengths_and_positions_after_prefill(snap, prompts):
    res = Engine(snap).prefill(*padded(prompts, "left"))
    for layer in range(snap.args.n_layers):
        for b, p in enumerate(prompts):
            assert res.kv_cache.length(layer, b) == len(p)
            assert res.kv_cache.positions(layer, b).tolist() == list(range(len(p)))
    assert res.valid_lengths.tolist() == [len(p) for p in prompts]
    assert res.cache_metadata["invariant_violations"] == []
    assert res.cache_metadata["weights_digest"] == snap.weights_digest


def test_skip_kv_breaks_invariant_1(snap, prompts):
    from prefill_diff.engine.shared.errors import CacheInvariantError
    ids, mask, pos = padded(prompts, "left")
    with pytest.raises(CacheInvariantError, match="invariant 1"):
        Engine(snap).prefill(ids, mask, pos, faults=Faults(skip_kv=(1, 0, 3)))
    res = Engine(snap).prefill(ids, mask, pos, CacheConfig(invariants="record"), faults=Faults(skip_kv=(1, 0, 3)))
    assert res.kv_cache.length(1, 0) == len(prompts[0]) - 1
    assert any("invariant 1" in v for v in res.cache_metadata["invariant_violations"])


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_cache_invariants_2_3_and_5_can_fail(snap, prompts, kind):
    """Tampering after a chunked prefill (attention read through the cache) breaks each invariant by name."""
    from prefill_diff.engine.native.kv_cache import CacheLayout, check_invariants
    ids, mask, pos = padded(prompts, "left")
    eng = Engine(snap)
    res = eng.prefill(ids, mask, pos, CacheConfig(CacheLayout(kind=kind, page_size=4), chunk_size=4))
    cache = res.kv_cache
    assert {(layer, s) for layer, s, _ in cache.reads} == {(l, s) for l in range(snap.args.n_layers)
                                                          for s in range(len(prompts))}
    ident = eng.identity(cache.layout)
    expected = [torch.arange(len(p)) for p in prompts]

    def violations(identity=ident, n_seqs=None):
        saved, cache.n_seqs = cache.n_seqs, n_seqs or cache.n_seqs
        try:
            return " ".join(check_invariants(cache, snap.args.n_kv_heads, snap.args.head_dim,
                                             expected[:cache.n_seqs], identity))
        finally:
            cache.n_seqs = saved

    assert violations() == ""
    assert "invariant 2 (batch matches)" in violations(n_seqs=2)
    assert "invariant 5" in violations({**ident, "precision": "bfloat16"})
    rope = cache.metadata.pop("rope")
    assert "does not record rope" in violations()
    cache.metadata["rope"] = rope
    # a slot that attention read now maps to another position: swap sequence 0's first two slots
    if kind == "contiguous":
        chunk = cache.store.chunks[(0, 0)][0]
        p = chunk.positions
        cache.store.chunks[(0, 0)][0] = chunk._replace(positions=p[[1, 0, *range(2, p.shape[0])]])
    else:
        table = cache.store.tables[0]
        table[0], table[1] = table[1], table[0]
    assert "invariant 3 (stable slot mapping): layer 0 sequence 0" in violations()


def test_gqa_head_map_matters_only_with_two_kv_heads(snap):
    p = torch.tensor([[1, 2, 3, 4, 5]])
    ones, pos = torch.ones(1, 5), torch.arange(5)[None]
    good = Engine(snap).prefill(p, ones, pos)
    wrong = Engine(snap).prefill(p, ones, pos, faults=Faults(head_map=(1, 0, 1, 1)))
    assert not torch.allclose(good.next_logits, wrong.next_logits)
    seed = load_snapshot(ModelSpec("seed-2.8"))
    a = Engine(seed).prefill(p, ones, pos)
    b = Engine(seed).prefill(p, ones, pos, faults=Faults(head_map=(0, 0)))
    assert torch.equal(a.next_logits, b.next_logits)


# -- preconditions (§2.1), each with its own error -----------------------------------------------

def test_precondition_1_id_outside_vocab(snap):
    with pytest.raises(PreconditionError, match=r"2\.1\(1\).*sample 0, position 2: id 96, vocab_size=96"):
        prefill(torch.tensor([[1, 2, 96]]), torch.ones(1, 3), torch.arange(3)[None], snap)


def test_precondition_1_ignores_padding_ids(snap):
    res = prefill(torch.tensor([[-1, 2, 3]]), torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1]]), snap)
    assert torch.isfinite(res.next_logits).all()


@pytest.mark.parametrize("mask,match", [
    ([[1, 2, 1]], r"only 0 and 1 \(sample 0, position 1: 2\)"),
    ([[0, 0, 0]], "at least one valid token"),
    ([[1, 0, 1]], "padding position 1 lies inside the prompt"),
])
def test_precondition_2_mask(snap, mask, match):
    with pytest.raises(PreconditionError, match=match):
        prefill(torch.tensor([[1, 2, 3]]), torch.tensor(mask), torch.tensor([[0, 1, 2]]), snap)


def test_precondition_2_mask_shape(snap):
    with pytest.raises(PreconditionError, match="shape of input_ids"):
        prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 2), torch.tensor([[0, 1, 2]]), snap)


@pytest.mark.parametrize("pos,match", [
    ([[0, -1, 2]], "sample 0, position 1: -1"),
    ([[0, 2, 1]], "must increase along a prompt"),
    ([[0, 1, 9000]], "max_position"),
])
def test_precondition_3_positions(snap, pos, match):
    with pytest.raises(PreconditionError, match=match):
        prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 3), torch.tensor(pos), snap)


def test_precondition_4_vocab_sizes():
    args = MODEL_PRESETS["synthetic"].replace(tokenizer_vocab_size=200)
    snap = Snapshot("synthetic", args, synthetic_state(args, 0))
    with pytest.raises(PreconditionError, match=r"2\.1\(4\).*tokenizer size=200, vocab_size=96"):
        prefill(torch.tensor([[1, 2]]), torch.ones(1, 2), torch.arange(2)[None], snap)


def test_precondition_5_dropout():
    args = MODEL_PRESETS["synthetic"].replace(dropout=0.1)
    snap = Snapshot("synthetic", args, synthetic_state(args, 0))
    with pytest.raises(PreconditionError, match=r"2\.1\(5\).*dropout=0.1"):
        prefill(torch.tensor([[1, 2]]), torch.ones(1, 2), torch.arange(2)[None], snap,
                NumericalConfig(training=True))
    ok = prefill(torch.tensor([[1, 2]]), torch.ones(1, 2), torch.arange(2)[None], snap,
                 NumericalConfig(training=True, dropout_seed=3))
    again = prefill(torch.tensor([[1, 2]]), torch.ones(1, 2), torch.arange(2)[None], snap,
                    NumericalConfig(training=True, dropout_seed=3))
    assert torch.equal(ok.next_logits, again.next_logits)  # recorded RNG state: reproducible


def test_valid_row_without_visible_key_is_refused_when_mask_is_built():
    from prefill_diff.engine.native.attention import AttentionMask
    q_tok = torch.tensor([[0, 1, 2]])
    k_tok = torch.tensor([[-1, -1, -1]])  # no key is visible to anyone
    seq = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(MaskError, match=r"row 0, column 0, token 0 has none"):
        AttentionMask(q_tok, k_tok, seq, seq).visible
