"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the MoE MLP against a naive loop and transformers, every
execution path, routing recorded (trace format 1.2) and compared, flips explained and replayed or blamed, and the
router faults localised."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.jobs import run, run_lockstep
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.dumps.schema import FORMAT_VERSION
from prefill_diff.engine.shared.errors import ConfigError, ModelLoadError
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.native.model import MoE
from prefill_diff.engine.native.skeleton import build
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.verify.report import compare_traces

FAMILIES = ["synthetic:mixtral", "synthetic:qwen2-moe", "synthetic:qwen3-moe"]
FLOAT32_PATHS = ["batched-left", "batched-right", "packed", "prefix-reuse", "chunked", "paged", "rotate-on-read",
                 "sdpa", "tiled", "transformers", "transformers-sdpa", "compiled"]
PRECISION_PATHS = ["bf16", "fp16", "w8", "kv-int8"]


def _naive_moe(moe: MoE, x: torch.Tensor, renorm: bool, f32_weights: bool) -> torch.Tensor:
    """Token by token: softmax over the router logits, the top k, each expert's SwiGLU, weighted and summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(moe.gate(x[t]).float(), dim=-1)
        w, ids = torch.sort(p, descending=True)
        w, ids = w[:moe.k], ids[:moe.k]
        if renorm:
            w = w / w.sum()
        for e, we in sorted(zip(ids.tolist(), w)):
            ex = moe.experts[e]
            y = ex.w2(torch.nn.functional.silu(ex.w1(x[t])) * ex.w3(x[t]))
            out[t] += (y * (we if f32_weights else we.to(x.dtype))).to(x.dtype)
        if hasattr(moe, "shared_expert"):
            sh = moe.shared_expert
            out[t] += torch.sigmoid(moe.shared_expert_gate(x[t])) * sh.w2(
                torch.nn.functional.silu(sh.w1(x[t])) * sh.w3(x[t]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_moe_mlp_equals_a_naive_loop(family):
    args = MODEL_PRESETS[family]
    torch.manual_seed(0)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=args.dim ** -0.5)
    x = torch.randn(2, 9, args.dim)
    got = moe(x)
    want = _naive_moe(moe, x.reshape(-1, args.dim), args.norm_topk_prob, args.moe_weight_dtype == "float32")
    torch.testing.assert_close(got.reshape(-1, args.dim), want, rtol=1e-5, atol=1e-5)
    ids, weights, margin, scale, logits = moe.last_routing
    assert ids.shape == (2, 9, args.n_active_experts) and logits.shape == (2, 9, args.n_experts)
    top2 = torch.topk(logits.float(), args.n_active_experts + 1, dim=-1).values
    torch.testing.assert_close(margin, top2[..., -2] - top2[..., -1])
    if args.norm_topk_prob:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(2, 9))


@pytest.mark.slow
@pytest.mark.parametrize("path", FLOAT32_PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_moe_family_passes_each_float32_path_with_routing_compared(family, path):
    rep = run_lockstep("reference", path, model=ModelSpec(family)).report
    assert rep.verdict == "pass", rep.verdict_line()
    s = rep.routing_summary()
    moe_layers = sum(MODEL_PRESETS[family].moe(i) for i in range(4))
    assert s is not None and s["tokens_compared"] >= moe_layers * (70 + 45 + 9) - 3 * 70, s
    assert len(rep.layers) == 4 and not rep.skipped, rep.skipped


@pytest.mark.slow
@pytest.mark.parametrize("path", PRECISION_PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_moe_family_passes_each_precision_path(family, path):
    """Below float32 routing flips happen on these random routers; each is within noise and replayed."""
    rep = run("reference", path, model=ModelSpec(family)).report
    assert rep.verdict == "pass", rep.verdict_line()
    assert not rep.unreplayed and rep.routing_summary()["blamed"] == 0


@pytest.mark.parametrize("family,preset,words", [
    ("qwen3-moe", "tp2", "a mixture of experts (qwen3_moe) is not sharded"),
    ("mixtral", "llama.cpp", "a mixture of experts (mixtral; the GGUF writer emits dense")])
def test_what_an_engine_cannot_run_of_moe_is_refused_in_one_line(run_cli, family, preset, words, monkeypatch):
    res = run_cli("run", "reference", preset, "--model", f"synthetic:{family}")
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output


# -- the router faults -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault,where", [("fault:router-norm-topk", (0, "mlp_update", "value")),
                                         ("fault:router-topk-off-by-one", (0, "routing", "routing")),
                                         ("fault:shared-gate-dropped", (0, "mlp_update", "value"))])
def test_router_bugs_fail_where_they_should(family, fault, where):
    rep = run_lockstep("reference", fault, model=ModelSpec(family)).report
    if fault == "fault:shared-gate-dropped" and family != "synthetic:qwen2-moe":
        assert rep.first_break is None and any("no shared expert" in i for i in rep.inconclusive), rep.inconclusive
        return
    fb = rep.first_break
    assert (fb.layer, fb.tensor, fb.kind) == where, rep.verdict_line()
    if fb.kind == "routing":
        assert fb.max_abs_error > fb.bound and "routing flip: experts" in fb.message
        assert rep.routing_summary()["blamed"] > 0


def test_router_faults_cannot_show_on_a_dense_model():
    rep = run_lockstep("reference", "fault:router-topk-off-by-one", model=ModelSpec("synthetic")).report
    assert rep.first_break is None and any("no mixture of experts" in i for i in rep.inconclusive)


# -- near ties (tests/conftest.py: near_tie): flips explained, replayed or not compared ----------------------

@pytest.mark.parametrize("cand", ["bf16", "fp16"])
def test_near_ties_flip_within_noise_are_replayed_and_pass(near_tie, cand):
    rep = run("reference", cand, model=ModelSpec(near_tie)).report
    assert rep.verdict == "pass", rep.verdict_line()
    assert len(rep.replayed) >= 1, "the near-tie model must flip: a test with zero flips proves nothing"
    assert "replayed with the reference's experts forced" in rep.verdict_line()
    assert rep.routing_summary()["flips"] == 0  # the judged run took the reference's experts there


@pytest.mark.parametrize("cand", ["batched-left", "packed", "prefix-reuse"])
@pytest.mark.parametrize("how", [run, run_lockstep])
def test_flips_batching_causes_on_exact_ties_are_replayed_and_pass(batch_tie, cand, how):
    """Float32 paths flip too where the router ties: padding, packing or a prefix prefilled on its own rounds
    layer 0's router input differently, the reference's margin there is rounding alone, and the replayed run
    passes. A reused prefix's own prefill is forced too: its tokens have no cells in the candidate's trace, and a
    flip there would show only as a different cache (a false FAIL at layer 1's keys before it was)."""
    rep = how("reference", cand, model=ModelSpec(batch_tie)).report
    assert rep.verdict == "pass", rep.verdict_line()
    summary = rep.routing_summary()
    if cand != "prefix-reuse":  # a 4-token prefix prefilled alone may round exactly as the whole prompt does (it
        # did with transformers 5.25's initial weights, and whether it does changes with them): its replay of the
        # ties is what is checked below, flips or not
        assert summary["replayed_flips"] >= 1, "the exact-tie model must flip under batching: zero flips prove nothing"
    assert summary["replayed"], "the ties within noise must be replayed: no replay proves nothing"
    assert {c["layer"] for c in summary["replayed"]} >= {0} and summary["flips"] == 0 and not summary["blamed"]
    assert rep.calibration.startswith("fixed float32 rule")  # not a looser, calibrated envelope
    if cand == "prefix-reuse":  # positions 0..3 come from the prefix cache: forced in the prefix's own prefill
        assert {c["position"] for c in summary["replayed"] if c["layer"] == 0} >= {0, 1, 2, 3}


def test_a_failure_with_unforced_hidden_ties_asks_for_a_replay_and_only_once():
    """A flip inside a reused prefix's own prefill is unseen: a failing report with near ties at tokens the
    candidate's trace has no cell for asks for a replay until they are forced; a passing one never does."""
    from types import SimpleNamespace

    from prefill_diff.verify.routing import NearTie, RoutingResult, forced_routing, replay_cells, wants_replay
    tie = NearTie(layer=0, sample=0, cand_sample=0, position=2, reference=(1,))
    layers = [SimpleNamespace(routing=RoutingResult(layer=0, compared=5, hidden_ties=(tie,))),
              SimpleNamespace(routing=None)]
    failing = SimpleNamespace(unreplayed=(), verdict="fail", layers=layers)
    assert wants_replay(failing, {})
    forced = forced_routing(replay_cells(failing))
    assert forced == {0: {(0, 2): (1,)}} and not wants_replay(failing, forced)
    assert not wants_replay(SimpleNamespace(unreplayed=(), verdict="pass", layers=layers), {})


def test_without_replay_the_reached_samples_are_not_compared_and_the_verdict_is_inconclusive(near_tie, tmp_path,
                                                                                              run_cli):
    """compare on two recorded traces cannot rerun the candidate: INCONCLUSIVE (exit 1), never PASS."""
    r, c = tmp_path / "r.h5", tmp_path / "c.h5"
    assert run_cli("record", "reference", "-o", str(r), "--model", near_tie).exit_code == 0
    assert run_cli("record", "bf16", "-o", str(c), "--model", near_tie).exit_code == 0
    res = run_cli("compare", str(r), str(c), "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 1 and rep["verdict"] == "inconclusive", rep["verdict_line"]
    assert rep["verdict_line"].startswith("INCONCLUSIVE") and rep["routing"]["explained"] >= 1
    assert rep["routing"]["not_compared_samples"] and any("not compared from layer" in s
                                                          for s in rep["checks_not_done"])
    flips = [f for lr in rep["layers"] for f in (lr.get("routing") or {}).get("flips", [])]
    assert flips and all(f["explained"] and f["margin"] <= f["bound"] for f in flips)


def test_a_wrong_expert_after_a_near_tie_is_still_blamed(near_tie):
    """Replay forces only the flips noise explains: the off-by-one router still breaks as routing."""
    rep = run_lockstep("reference", "fault:router-topk-off-by-one", model=ModelSpec(near_tie)).report
    assert rep.first_break is not None and rep.first_break.kind == "routing", rep.verdict_line()


# -- the trace: format 1.2 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return record_side(prepare_side("batched-left", ModelSpec("synthetic:qwen3-moe")), d / "t.h5")


def test_routing_is_recorded_for_the_moe_layers_only(moe_trace):
    args = MODEL_PRESETS["synthetic:qwen3-moe"]
    with Trace(moe_trace) as t:
        assert t.version == FORMAT_VERSION
        for i in range(args.n_layers):
            lv = t.layer(i)
            if not args.moe(i):
                assert lv.routing("ids") is None
                continue
            ids = lv.routing("ids")[()]
            w = lv.routing("weights")[()]
            for s in range(t.n_samples):
                cols, _ = t.cells(s)
                assert ((ids[s, cols] >= 0) & (ids[s, cols] < args.n_experts)).all()
                np.testing.assert_allclose(w[s, cols].sum(-1), 1.0, rtol=1e-6)  # norm_topk_prob
                assert (lv.routing("margin")[s][cols] >= 0).all()
                assert lv.routing("logits").shape[2] == args.n_experts


@pytest.mark.parametrize("edit,words", [
    (lambda f: f["layers/000/routing/ids"].__setitem__((0, 0, 0), 9), "ids at the valid cells must be experts in"),
    (lambda f: f["layers/000/routing/ids"].__setitem__((0, 0, 0), -1), "ids at the valid cells must be experts in"),
    (lambda f: f["layers/000/routing/ids"].__setitem__((0, 0), [2, 2]), "names one expert twice"),
    (lambda f: f["layers/000/routing/margin"].__setitem__((0, 0), -1.0), "margins (>= 0)"),
    (lambda f: f["layers/000/routing/scale"].__setitem__((0, 0), np.nan), "margins (>= 0)"),
    (lambda f: f.move("layers/000/routing", "layers/003/routing"), "layer 3 is dense"),
    (lambda f: f["layers/001/routing"].__delitem__("margin"), "missing required dataset /layers/001/routing/margin"),
])
def test_the_reader_refuses_bad_routing(moe_trace, tmp_path, edit, words):
    import shutil
    bad = tmp_path / "bad.h5"
    shutil.copy(moe_trace, bad)
    with h5py.File(bad, "r+") as f:
        edit(f)
    with pytest.raises(TraceError) as e:
        Trace(bad).__enter__()
    assert words in str(e.value), str(e.value)


def test_older_traces_still_read_and_a_dense_model_writes_no_routing(tmp_path):
    from pathlib import Path
    with Trace(Path(__file__).parent / "data" / "trace-v1.0.h5") as t:
        assert t.layer(0).routing("ids") is None
    p = record_side(prepare_side("reference", ModelSpec("synthetic")), tmp_path / "d.h5")
    with h5py.File(p) as f:
        assert "routing" not in f["layers/000"]


# -- checkpoints saved by transformers ------------------------------------------------------------------

def _checkpoint(kind, tmp_path):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    common = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    cfg = {"mixtral": lambda: MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common),
           "qwen2_moe": lambda: Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                               shared_expert_intermediate_size=96, mlp_only_layers=[1], **common),
           "qwen3_moe": lambda: Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                               norm_topk_prob=True, decoder_sparse_step=1, **common)}[kind]()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.normal_(0, 0.3)
    d = tmp_path / kind
    model.save_pretrained(d, safe_serialization=True)
    return d, model


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_transformers_checkpoints_agree_with_our_engine(kind, tmp_path, run_cli):
    d, model = _checkpoint(kind, tmp_path)
    res = run_cli("run", "reference", "transformers", "--model", f"hf:{d}", "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 3 and rep["routing"]["tokens_compared"] > 0 and not rep["checks_not_done"]
    from prefill_diff.engine.native.prefill import Engine
    from prefill_diff.engine.models.sources import load_snapshot
    ids = torch.tensor([[5, 17, 33, 250, 7, 9, 11, 12]])
    ours = Engine(load_snapshot(ModelSpec(f"hf:{d}"))).prefill(ids, torch.ones_like(ids), torch.arange(8)[None])
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0, -1]
    assert float((ours.next_logits[0].float() - theirs).abs().max()) < 1e-4


@pytest.mark.parametrize("field,value,words", [
    ("sliding_window", 16, "a sliding window with experts is not implemented"),
    ("mlp_only_layers", [7], "a list of layer indices below 3"),
    ("num_experts_per_tok", 0, "a positive integer")])
def test_moe_config_fields_are_checked(field, value, words, tmp_path):
    from prefill_diff.engine.models.sources import load_snapshot
    d, _ = _checkpoint("qwen2_moe" if field == "mlp_only_layers" else "mixtral", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    snap = load_snapshot(ModelSpec(f"hf:{d}"))
    assert snap.foreign is not None and words in snap.foreign, snap.foreign
    with pytest.raises(ModelLoadError, match="supported"):
        build(snap)


def test_an_unreplayed_flip_fails_the_junit_gate_and_says_why(near_tie, tmp_path, run_cli):
    from junitparser import JUnitXml
    r, c = tmp_path / "r.h5", tmp_path / "c.h5"
    assert run_cli("record", "reference", "-o", str(r), "--model", near_tie).exit_code == 0
    assert run_cli("record", "bf16", "-o", str(c), "--model", near_tie).exit_code == 0
    res = run_cli("compare", str(r), str(c), "--junit", str(tmp_path / "j.xml"))
    assert res.exit_code == 1
    xml = JUnitXml.fromfile(str(tmp_path / "j.xml"))
    failed = [case.name for suite in xml for case in suite if case.result and
              any(getattr(x, "type", None) == "inconclusive" for x in case.result)]
    assert failed == ["routing"], failed
    from prefill_diff.dumps.reader import Trace as T
    from prefill_diff.verify.formats.github import workflow_error
    with T(r) as a, T(c) as b:
        rep = compare_traces(a, b)
    line = workflow_error(rep)
    assert line is not None and "routing flips not replayed" in line and "not compared from layer" in line


def test_a_replayed_trace_says_its_router_was_overruled(near_tie, tmp_path):
    out = run("reference", "bf16", model=ModelSpec(near_tie), out_dir=str(tmp_path / "kept"))
    assert out.report.verdict == "pass" and out.report.replayed and "replay" in str(out.cand_path)
    with Trace(out.ref_path) as a, Trace(out.cand_path) as b:
        assert b.meta["record"]["routing_forced"]
        rep = compare_traces(a, b)
    assert any("router overruled" in n for n in rep.notes), rep.notes


def test_a_foreign_mixture_of_experts_runs_on_transformers_without_routing(tmp_path, run_cli):
    """OLMoE's router is not one our engine implements: its states are recorded, routing is not (no crash)."""
    from transformers import AutoModelForCausalLM, OlmoeConfig
    torch.manual_seed(0)
    cfg = OlmoeConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "olmoe", safe_serialization=True)
    res = run_cli("run", "transformers", "transformers-sdpa", "--model", f"hf:{tmp_path / 'olmoe'}", "--json", "-")
    rep = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 0 and rep["verdict"] == "pass" and rep["routing"] is None, rep["verdict_line"]
