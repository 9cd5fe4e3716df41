"""engine/native/lora.py: seeded adapters against independent draws, LoRALinear and apply_adapter against the merged
weight W + scale·B·A computed by hand, and the digest that tells adapters apart."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import Capture
from prefill_diff.engine.models.digest import digest_tensors
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state
from prefill_diff.engine.models.adapter import Adapter, seeded_adapter
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native.lora import ATTN_PROJ, LoRALinear, apply_adapter
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.skeleton import build

ARGS = MODEL_PRESETS["synthetic"]


def test_seeded_adapter_is_the_documented_draws_in_order():
    """For every layer and projection wq, wk, wv, wo in turn: A (rank, fan_in) ~ N(0,1)/√fan_in, then
    B (fan_out, rank) ~ N(0,1)·0.5/√rank, from one generator seeded with ``seed``; fan sizes from the model."""
    rank, seed = 3, 11
    ad = seeded_adapter(ARGS, "x", rank=rank, seed=seed, scale=0.5)
    q, kv = ARGS.n_heads * ARGS.head_dim, ARGS.n_kv_heads * ARGS.head_dim
    fans = [("wq", ARGS.dim, q), ("wk", ARGS.dim, kv), ("wv", ARGS.dim, kv), ("wo", q, ARGS.dim)]
    g = torch.Generator().manual_seed(seed)
    want = {}
    for i in range(ARGS.n_layers):
        for w, fan_in, fan_out in fans:
            want[f"layers.{i}.{w}.A"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            want[f"layers.{i}.{w}.B"] = torch.randn(fan_out, rank, generator=g) * 0.5 / rank ** 0.5
    assert ad.tensors.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(ad.tensors[name], t), name
    assert (ad.id, ad.rank, ad.scale) == ("x", rank, 0.5)


def test_digest_and_identity_tell_adapters_apart():
    """The digest is the tensors' digest with rank and scale appended: the same draws agree, and another seed,
    rank or scale gives another digest; identity() carries id, digest and rank; a given digest is kept."""
    ad = seeded_adapter(ARGS, "a", rank=2, seed=1, scale=1.0)
    assert ad.digest == digest_tensors(ad.tensors) + "|rank=2|scale=1.0"
    assert seeded_adapter(ARGS, "other-name", rank=2, seed=1, scale=1.0).digest == ad.digest
    others = [seeded_adapter(ARGS, "a", rank=2, seed=2), seeded_adapter(ARGS, "a", rank=3, seed=1),
              seeded_adapter(ARGS, "a", rank=2, seed=1, scale=0.5)]
    assert len({ad.digest, *(o.digest for o in others)}) == 4
    assert ad.identity() == {"id": "a", "digest": ad.digest, "rank": 2}
    assert Adapter("b", 2, 1.0, ad.tensors, digest="given").digest == "given"
    snap = Snapshot("synthetic", ARGS, synthetic_state(ARGS, 0))
    idents = [snap.identity(), snap.with_adapter(ad).identity(), snap.with_adapter(others[2]).identity()]
    assert len({i["adapter"] and i["adapter"]["digest"] for i in idents}) == 3  # a cache built under one is told apart


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_equals_the_merged_weight(bias):
    """LoRALinear(x) = x·(W + scale·B·A)ᵀ + b, with ΔW = scale·B·A formed here by explicit sums, float64."""
    torch.manual_seed(0)
    base = nn.Linear(6, 5, bias=bias).double()
    A, B, scale = torch.randn(2, 6, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64), 0.75
    dW = torch.zeros(5, 6, dtype=torch.float64)
    for o in range(5):
        for i in range(6):
            dW[o, i] = scale * sum(B[o, r] * A[r, i] for r in range(2))
    x = torch.randn(4, 6, dtype=torch.float64)
    want = x @ (base.weight.detach() + dW).T + (base.bias.detach() if bias else 0)
    torch.testing.assert_close(LoRALinear(base, A, B, scale)(x), want, rtol=0, atol=1e-12)
    assert torch.equal(LoRALinear(base, A, B, 0.0)(x), base(x))  # scale 0: the base layer exactly


def test_apply_adapter_wraps_the_attention_projections_only():
    """Every layer's wq, wk, wv, wo becomes a LoRALinear around the original module with that layer's A and B in
    the model's dtype; nothing else in the model changes."""
    ad = seeded_adapter(ARGS, "x", rank=2)
    model, _ = build(Snapshot("synthetic", ARGS, synthetic_state(ARGS, 0)), "float64")
    before = {name: m for name, m in model.named_modules()}
    apply_adapter(model, ad, torch.float64)
    after = dict(model.named_modules())
    for i in range(ARGS.n_layers):
        for w in ATTN_PROJ:
            name = f"layers.{i}.attention.{w}"
            m = after[name]
            assert isinstance(m, LoRALinear) and m.base is before[name] and m.scale == ad.scale
            for part in "AB":
                t = getattr(m, part)
                assert t.dtype == torch.float64 and torch.equal(t, ad.tensors[f"layers.{i}.{w}.{part}"].double())
    untouched = {n for n in before if not any(f".attention.{w}" in n for w in ATTN_PROJ)}
    assert all(after[n] is before[n] for n in untouched)


@pytest.mark.parametrize("preset", ["synthetic", "synthetic:qwen2"])
def test_engine_with_an_adapter_equals_the_model_with_merged_weights(preset):
    """Through the engine (float64): every recorded state and the logits equal those of an adapter-free snapshot
    whose attention weights are W + scale·B·A, merged here; the adapter changes the result."""
    args = MODEL_PRESETS[preset]
    state = synthetic_state(args, 0)
    ad = seeded_adapter(args, "x", rank=4, seed=3, scale=0.5)
    merged = dict(state)
    for i in range(args.n_layers):
        for w in ATTN_PROJ:
            A, B = ad.tensors[f"layers.{i}.{w}.A"].double(), ad.tensors[f"layers.{i}.{w}.B"].double()
            name = f"layers.{i}.attention.{w}.weight"
            merged[name] = state[name].double() + ad.scale * torch.einsum("or,ri->oi", B, A)
    ids, mask, pos = torch.tensor([[5, 17, 3, 40, 8, 71]]), torch.ones(1, 6), torch.arange(6)[None]
    snap = Snapshot(preset, args, state)
    runs = []
    for s in (snap.with_adapter(ad), Snapshot(preset, args, merged), snap):
        cap = Capture()
        res = Engine(s, NumericalConfig(dtype="float64")).prefill(ids, mask, pos, recorder=cap)
        runs.append((res, cap))
    (lora, lcap), (ref, rcap), (plain, _) = runs
    for key, x in rcap.states.items():
        torch.testing.assert_close(lcap.states[key], x, rtol=0, atol=1e-10, msg=str(key))
    for key, kv in rcap.caches.items():
        for got, want in zip(lcap.caches[key], kv):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lora.next_logits, ref.next_logits, rtol=0, atol=1e-10)
    assert not torch.allclose(lora.next_logits, plain.next_logits, rtol=0, atol=1e-6)


def test_an_adapter_for_another_model_is_refused_when_applied():
    """An adapter drawn for a model with fewer layers lacks this model's later layers: applying it fails on the
    first missing tensor instead of leaving those layers unadapted."""
    small = seeded_adapter(ARGS.replace(n_layers=2), "x")
    model, _ = build(Snapshot("synthetic", ARGS, synthetic_state(ARGS, 0)))
    with pytest.raises(KeyError, match="layers.2.wq.A"):
        apply_adapter(model, small, torch.float32)
