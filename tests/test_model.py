"""Transformer.forward, the layer template, against an independent loop over the layers (float64)."""
from __future__ import annotations

import math

import torch

from conftest import Capture
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.skeleton import build
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state

TOKENS = [5, 17, 3, 40, 8, 71, 2]
STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")


def naive_layers(state: dict, args, tokens: list[int]) -> list[dict]:
    """Every layer's five states for one sequence at positions 0.., with explicit loops over heads and queries."""
    W = {k: v.double() for k, v in state.items()}
    n, H, Hkv, D = len(tokens), args.n_heads, args.n_kv_heads, args.head_dim

    def rms(x, w):  # x: (n, dim)
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.norm_eps)

    def rope(x, p):  # x: (D,), rotate-half pairs (i, i + D/2)
        out, half = x.clone(), D // 2
        for i in range(half):
            theta = p * args.rope_theta ** (-2 * i / D)
            out[i] = x[i] * math.cos(theta) - x[i + half] * math.sin(theta)
            out[i + half] = x[i + half] * math.cos(theta) + x[i] * math.sin(theta)
        return out

    x = W["tok_embeddings.weight"][torch.tensor(tokens)]
    layers = []
    for layer in range(args.n_layers):
        w = lambda name: W[f"layers.{layer}.{name}.weight"]
        h = rms(x, w("attention_norm"))
        q = (h @ w("attention.wq").T).view(n, H, D)
        k = (h @ w("attention.wk").T).view(n, Hkv, D)
        v = (h @ w("attention.wv").T).view(n, Hkv, D)
        o = torch.zeros(n, H, D, dtype=torch.float64)
        for head in range(H):
            g = head * Hkv // H  # the KV head query head `head` reads
            for i in range(n):
                scores = torch.tensor([float(rope(q[i, head], i) @ rope(k[j, g], j)) / math.sqrt(D)
                                       for j in range(i + 1)], dtype=torch.float64)
                p = torch.softmax(scores, 0)
                o[i, head] = sum(p[j] * v[j, g] for j in range(i + 1))
        a = o.reshape(n, H * D) @ w("attention.wo").T
        u = x + a
        h2 = rms(u, w("ffn_norm"))
        m = (torch.nn.functional.silu(h2 @ w("feed_forward.w1").T) * (h2 @ w("feed_forward.w3").T)) @ w("feed_forward.w2").T
        layers.append({"layer_input": x, "attn_update": a, "mid": u, "mlp_update": m, "layer_output": u + m})
        x = u + m
    return layers


class NaiveStep:
    """What the model calls, done the plain way: RoPE tables, causal attention with g(h), recording."""

    def __init__(self, n: int, args):
        inv = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
        freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv  # (n, D/2)
        emb = torch.cat((freqs, freqs), -1)
        self.rope = emb.cos()[None, None], emb.sin()[None, None]  # (1, 1, n, D)
        self.states, self.calls = {}, []

    def rope_of(self, layer):
        return self.rope

    def attend(self, layer, q, k, v, k_pre):  # q (1, H, n, D); k, v (1, H_kv, n, D)
        H, n, D = q.shape[1], q.shape[2], q.shape[3]
        g = [h * k.shape[1] // H for h in range(H)]
        s = torch.einsum("hid,hjd->hij", q[0], k[0, g]) / math.sqrt(D)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hij,hjd->hid", torch.softmax(s, -1), v[0, g])[None]

    def record(self, layer, name, x):
        self.calls.append((layer, name))
        self.states[(layer, name)] = x[0].detach().clone()

    def op_of(self, layer):
        return None

    def op(self, layer, name, x, heads_first=False):
        pass


def model_and_state():
    args = MODEL_PRESETS["synthetic"]
    state = synthetic_state(args, 0)
    model, _ = build(Snapshot("synthetic", args, state), "float64")
    return args, state, model


def test_forward_matches_a_naive_loop_over_the_layers():
    args, state, model = model_and_state()
    step = NaiveStep(len(TOKENS), args)
    with torch.no_grad():
        out = model(torch.tensor([TOKENS]), step)  # Transformer.forward
    naive = naive_layers(state, args, TOKENS)
    for layer, want in enumerate(naive):
        for name in STATES:
            torch.testing.assert_close(step.states[(layer, name)], want[name], rtol=1e-10, atol=1e-10,
                                       msg=f"layer {layer} {name}")
    torch.testing.assert_close(out[0], naive[-1]["layer_output"], rtol=1e-10, atol=1e-10)
    assert not torch.equal(naive[0]["layer_output"], naive[1]["layer_output"])  # the layers differ


def test_forward_equals_what_the_engine_prefill_records():
    """The engine runs the same template: its recorded states equal forward's, and its logits unembed
    Norm(R_L) at the last token."""
    args, state, model = model_and_state()
    step = NaiveStep(len(TOKENS), args)
    with torch.no_grad():
        out = model(torch.tensor([TOKENS]), step)
        z = model.unembed(model.norm(out[0, -1]))
    rec = Capture()
    n = len(TOKENS)
    res = Engine(Snapshot("synthetic", args, state), NumericalConfig(dtype="float64")).prefill(
        torch.tensor([TOKENS]), torch.ones(1, n), torch.arange(n)[None], recorder=rec)
    for layer in range(args.n_layers):
        for name in STATES:
            torch.testing.assert_close(rec.states[(layer, name)][0], step.states[(layer, name)], rtol=1e-12,
                                       atol=1e-12, msg=f"layer {layer} {name}")
    torch.testing.assert_close(res.next_logits[0], z, rtol=1e-12, atol=1e-12)


def test_layer_by_layer_runs_only_the_layers_asked_for():
    args, _, model = model_and_state()
    step = NaiveStep(len(TOKENS), args)
    with torch.no_grad():
        layers = model.layer_by_layer(torch.tensor([TOKENS]), step)
        first, x = next(layers)
    assert first == 0
    assert {layer for layer, _ in step.calls} == {0}  # layer 1 has not run
    torch.testing.assert_close(x[0], step.states[(0, "layer_output")], rtol=0, atol=0)
    assert [name for _, name in step.calls] == ["layer_input", "attn_heads", "attn_update", "mid", "mlp_update",
                                               "layer_output"]
