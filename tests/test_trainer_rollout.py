"""Trainer vs rollout, bit for bit, end to end through the CLI: transformers in bfloat16 (the trainer's forward)
against vLLM in bfloat16, prefill and teacher-forced decode, at the op level: --exact names the first op whose bits
part and why; --replay-ops separates the ops that differ themselves from those that only inherit."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # vLLM runs in its own process (tens of seconds each)

GEMMS = ("q", "k", "v", "o_proj", "gate", "up", "down")


def _json(res) -> dict:
    return json.loads(res.output)


def test_transformers_against_vllm_in_bfloat16_parts_first_at_layer_0_rotary_or_fused_norm(run_cli):
    res = run_cli("run", "transformers-bf16", "vllm-bf16", "--exact", "--level", "ops", "--json", "-", "-q")
    rep = _json(res)
    assert res.exit_code == 1 and rep["verdict"] == "fail"
    fb, first = rep["first_break"], rep["exact"]["first"]
    assert fb["kind"] == "bits" and fb["layer"] == 0
    assert fb["tensor"] in ("q_rope", "k_rope", "attn_residual", "mlp_norm")
    assert 0.5 < first["share_equal"] < 1.0 and first["dtype"] == "bfloat16" and first["max_ulp"] >= 1
    before = [t for t in rep["exact"]["layers"][0]["tensors"]][:[t["tensor"] for t in
                                                                 rep["exact"]["layers"][0]["tensors"]].index(fb["tensor"])]
    assert {t["tensor"] for t in before} >= {"layer_input", "attn_norm", "q", "k", "v"}
    assert all(t["share_equal"] == 1.0 for t in before)  # everything before the first parting op is bitwise equal
    assert "rotary" in rep["diagnosis"] or "add+RMSNorm" in rep["diagnosis"]


def test_replaying_vllms_decode_ops_on_the_trainers_inputs_clears_every_gemm(run_cli):
    res = run_cli("run", "transformers-bf16", "vllm-decode-bf16", "--replay-ops", "--response-ids", "31,32,33,34",
                  "--json", "-", "-q")
    rep = _json(res)
    assert res.exit_code == 1 and rep["replay"]["engine"] == "vllm"
    layers = rep["replay"]["layers"]
    assert len(layers) == 4
    for layer in layers:
        ops = {o["op"]: o for o in layer["ops"]}
        assert all(ops[g]["replayed"]["share_equal"] == 1.0 and ops[g]["verdict"] != "differs itself"
                   for g in GEMMS), layer
        for name in ("q_rope", "k_rope"):  # vLLM rotates in float32 and rounds once
            assert ops[name]["verdict"] == "differs itself" and ops[name]["cause"]
            assert 0.5 < ops[name]["replayed"]["share_equal"] < 1.0
    assert "attn_core" in rep["replay"]["not_replayed"]  # vLLM's attention backend runs only inside a step
    # the response's decode rows are judged bit for bit too, and its logits
    assert any(t["tensor"] == "response_logits" for t in rep["exact"]["final"])
    assert rep["logprobs"] is not None and rep["logprobs"]["tokens"] == 12
