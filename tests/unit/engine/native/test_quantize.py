"""engine/native/quantize.py: int8 weight-only quantisation against a per-channel round/scale written here, the
layers it replaces (every linear but a router), and the digest that identifies the quantised weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from prefill_diff.engine.models.digest import digest_tensors
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native import skeleton
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.quantize import WeightOnlyInt8Linear, quantize_int8
from prefill_diff.engine.shared.errors import ConfigError

# docs/contract.md: "Under weight_quant = int8 the router and the shared expert's gate stay in the activation dtype"
ROUTER_NAMES = {"gate", "shared_expert_gate"}


def hand_quantize(w: torch.Tensor):
    """Per output row, in float32 as specified: s = max|w| / 127 (1e-12 floor before the division), q = round(w / s)
    clipped to [-127, 127]; written with numpy, one row at a time."""
    w = w.detach().float().numpy()
    q = np.zeros(w.shape, dtype=np.int8)
    s = np.zeros(w.shape[0], dtype=np.float32)
    for r in range(w.shape[0]):
        s[r] = np.float32(max(np.abs(w[r]).max(), np.float32(1e-12))) / np.float32(127.0)
        q[r] = np.clip(np.round(w[r] / s[r]), -127, 127).astype(np.int8)
    return torch.from_numpy(q), torch.from_numpy(s)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_and_scales_equal_a_per_channel_round_and_scale(bias):
    """int8 weights and scales equal the hand quantisation; each row's maximum is ±127 and every weight is within
    half a step of its dequantised value."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 10, bias=bias)
    lin.weight.data[3] *= 50.0  # rows of very different ranges: one scale each
    q = WeightOnlyInt8Linear(lin)
    want_q, want_s = hand_quantize(lin.weight)
    assert q.weight.dtype == torch.int8 and torch.equal(q.weight, want_q)
    assert q.scales.dtype == lin.weight.dtype and torch.equal(q.scales, want_s)
    assert (q.bias is None) == (not bias) and (q.bias is None or q.bias is lin.bias)
    w = lin.weight.detach()
    assert (q.weight.abs().amax(1) == 127).all()  # each row's largest weight is ±127 exactly
    assert ((q.weight.float() * q.scales[:, None] - w).abs() <= q.scales[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bias", [False, True])
def test_forward_is_x_times_the_dequantised_weight(bias):
    """y = x·(q·s)ᵀ + b, computed here in float64 from the hand-quantised weight, in the input's dtype."""
    torch.manual_seed(1)
    lin = nn.Linear(16, 8, bias=bias).double()
    q = WeightOnlyInt8Linear(lin)
    hq, hs = hand_quantize(lin.weight)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    want = x @ (hq.double() * hs.double()[:, None]).T
    if bias:
        want = want + lin.bias.detach()
    y = q(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    assert not torch.allclose(y, lin(x), rtol=0, atol=1e-12)  # it is the quantised weight that ran


def test_an_all_zero_row_quantises_to_zeros_without_nan():
    """An all-zero row gets a positive floor scale, zero int8 weights and zero outputs, no NaN."""
    lin = nn.Linear(4, 3, bias=False)
    lin.weight.data[1] = 0.0
    q = WeightOnlyInt8Linear(lin)
    assert q.weight[1].tolist() == [0, 0, 0, 0] and torch.isfinite(q.scales).all() and q.scales[1] > 0
    y = q(torch.randn(2, 4))
    assert torch.isfinite(y).all() and y[:, 1].tolist() == [0.0, 0.0]


# -- quantize_int8 on a built model ---------------------------------------------------------------------------

def build(preset, dtype="float32"):
    args = MODEL_PRESETS[preset]
    snap = Snapshot(preset, args, synthetic_state(args, 0))
    model, _ = skeleton.build(snap, dtype)
    return snap, model


@pytest.mark.parametrize("preset", ["synthetic", "synthetic:qwen2-moe"])
def test_every_linear_but_a_router_is_replaced_and_the_digest_covers_exactly_those(preset):
    """Listed before quantising: each nn.Linear not named gate/shared_expert_gate becomes WeightOnlyInt8Linear
    holding the hand-quantised weight; routers stay nn.Linear with their weights untouched; the returned digest
    is that of the hand-quantised weights and float32 scales under the modules' names."""
    _, model = build(preset)
    linears = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    routers = {name for name in linears if name.rsplit(".", 1)[-1] in ROUTER_NAMES}
    assert bool(routers) == (preset != "synthetic")
    if preset == "synthetic:qwen2-moe":  # both kinds present: each layer's router and shared-expert gate
        assert {n.rsplit(".", 1)[-1] for n in routers} == ROUTER_NAMES
    digest = quantize_int8(model)
    mods = dict(model.named_modules())
    want = {}
    for name, w in linears.items():
        if name in routers:
            assert type(mods[name]) is nn.Linear and torch.equal(mods[name].weight, w)
            continue
        assert isinstance(mods[name], WeightOnlyInt8Linear), name
        hq, hs = hand_quantize(w)
        assert torch.equal(mods[name].weight, hq), name
        want[name + ".weight"], want[name + ".scales"] = hq, hs
    assert not any(type(m) is nn.Linear for name, m in mods.items() if name not in routers)
    assert digest == digest_tensors(want)


def test_digest_follows_the_quantised_weights_not_the_master_weights():
    """A change that moves one int8 value changes the digest; one that rounds to the same int8 values and scales
    (a non-maximal weight nudged well inside its rounding interval) leaves it as it was."""
    _, a = build("seed-2.8")
    _, b = build("seed-2.8")
    _, c = build("seed-2.8")
    w = a.layers[0].attention.wq.weight.detach()
    hq, hs = hand_quantize(w)
    row = 0
    col = int(w[row].abs().argmin())  # never the row's maximum
    frac = float(w[row, col] / hs[row]) - float(hq[row, col])  # where it sits in its rounding interval
    with torch.no_grad():
        b.layers[0].attention.wq.weight[row, col] += float(hs[row]) * (0.4 - frac)  # still rounds to hq, far from .5
        c.layers[0].attention.wq.weight[row, col] += float(hs[row]) * (1.0 - frac)  # the next int8 value
    assert torch.equal(hand_quantize(b.layers[0].attention.wq.weight)[0], hq)
    assert not torch.equal(hand_quantize(c.layers[0].attention.wq.weight)[0], hq)
    da, db, dc = quantize_int8(a), quantize_int8(b), quantize_int8(c)
    assert da == db
    assert dc != da


def test_int8_engine_equals_the_model_with_dequantised_weights():
    """Engine(weight_quant=int8) in float64 computes what an unquantised engine computes on master weights
    replaced by q·s (the hand quantisation), and the digest it reports is the hand-quantised weights'."""
    args = MODEL_PRESETS["synthetic"]
    state = synthetic_state(args, 0)
    deq, want = dict(state), {}
    for name, w in state.items():
        if name.endswith(".weight") and w.dim() == 2 and name != "tok_embeddings.weight":
            hq, hs = hand_quantize(w)
            deq[name] = hq.double() * hs.double()[:, None]
            want[name], want[name[:-len("weight")] + "scales"] = hq, hs
    ids, mask, pos = torch.tensor([[5, 17, 3, 40, 8]]), torch.ones(1, 5), torch.arange(5)[None]
    q = Engine(Snapshot("synthetic", args, state), NumericalConfig(dtype="float64", weight_quant="int8"))
    ref = Engine(Snapshot("synthetic", args, deq), NumericalConfig(dtype="float64"))
    plain = Engine(Snapshot("synthetic", args, state), NumericalConfig(dtype="float64"))
    zq, zr, zp = (e.prefill(ids, mask, pos).next_logits for e in (q, ref, plain))
    torch.testing.assert_close(zq, zr, rtol=0, atol=1e-10)
    assert not torch.allclose(zq, zp, rtol=0, atol=1e-6)
    assert q.quantized_digest == digest_tensors(want)
    assert plain.quantized_digest is None


def test_an_unknown_weight_quantisation_is_refused():
    """A weight_quant other than none or int8 is refused when the model is built."""
    snap, _ = build("seed-2.8")
    with pytest.raises(ConfigError, match="weight_quant must be 'none' or 'int8' \\(got 'int4'\\)"):
        skeleton.build(snap, "float32", "int4")
