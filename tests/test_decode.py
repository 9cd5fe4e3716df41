"""Decode past the prefill (our engine): a response written token by token against the cache, compared with one
prefill of prompt + response by logical position; each row's phase, step and cache length; the response's
log-probs as RL frameworks log them; the decode faults caught at their step, layer and kind."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.schema import FORMAT_VERSION
from prefill_diff.engine.calls import plan_calls
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state
from prefill_diff.engine.decode import DECODE, PREFILL, forward_facts, forward_starts
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.native.settings import CacheConfig
from prefill_diff.engine.models.cache_layout import CacheLayout
from prefill_diff.verify.logprobs import compare_logprobs, log_softmax

from conftest import Capture

PROMPTS = ((5, 6, 7, 8, 9, 10, 11), (3, 4, 5), (20, 21, 22, 23, 24))
RESPONSES = ((31, 32, 33, 34), (35, 36, 37, 38), (39, 40, 41, 42))


def _toml(tmp_path, name, run: str = "", extra: str = "") -> str:
    ids = ", ".join(f"[{', '.join(map(str, p))}]" for p in PROMPTS)
    resp = ", ".join(f"[{', '.join(map(str, r))}]" for r in RESPONSES)
    path = tmp_path / f"{name}.toml"
    path.write_text(f"[run]\n{run}\n{extra}\n[inputs]\ntoken_ids = [{ids}]\nresponses = [{resp}]\n")
    return str(path)


# -- the engine: decode steps give what one prefill gives ---------------------------------------------------

@pytest.mark.parametrize("batching, layout", [("left", CacheLayout()), ("unbatched", CacheLayout()),
                                              ("packed", CacheLayout()), ("left", CacheLayout(kind="paged", page_size=3)),
                                              ("left", CacheLayout(dtype="int8")), ("right", CacheLayout(dtype="fp8_e4m3"))])
def test_decode_steps_compute_what_one_prefill_of_prompt_and_response_computes(batching, layout):
    """float64: each response token decoded alone against the cache gives the states, cache and logits one prefill
    of prompt + response gives, at every position (to float64 rounding; a quantised cache is read back by both, so
    the two agree there too)."""
    args = MODEL_PRESETS["synthetic"]
    eng = Engine(Snapshot("synthetic", args, synthetic_state(args, 0)), NumericalConfig(dtype="float64"))
    rows = [list(p + r) for p, r in zip(PROMPTS, RESPONSES)]
    calls = plan_calls(rows, [list(range(len(r))) for r in rows], [0, 1, 2], batching, 0)
    for call in calls:
        starts = {q: len(PROMPTS[s]) for q, s in enumerate(call.samples)}
        one, dec = Capture(), Capture()
        a = eng.prefill(call.ids, call.mask, call.positions, CacheConfig(layout), segments=call.segments,
                        recorder=one)
        b = eng.prefill(call.ids, call.mask, call.positions, CacheConfig(layout), segments=call.segments,
                        recorder=dec, decode_from=starts)
        torch.testing.assert_close(b.next_logits, a.next_logits, rtol=0, atol=1e-12)
        valid = call.mask.bool()
        for key, x in one.states.items():
            torch.testing.assert_close(dec.states[key][valid], x[valid], rtol=0, atol=1e-12)
        assert dec.caches.keys() == one.caches.keys()
        for key, (k, v, pos) in one.caches.items():
            k2, v2, pos2 = dec.caches[key]
            assert torch.equal(pos2, pos)
            torch.testing.assert_close(k2, k, rtol=0, atol=1e-12)


def test_each_cells_forward_is_said_phase_step_and_cache_length():
    """A left-padded batch: the prompts in one forward, then one column per step; a cell's cache length is its
    sequence's tokens once its forward wrote."""
    tok = torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]])
    seq = torch.tensor([[0, 0, 0, 0, 0, 0], [-1, -1, 1, 1, 1, 1]])
    starts = forward_starts(tok, seq, 6, 6, {0: 4, 1: 2})
    assert starts == [0, 4, 5]
    phase, step, cache_len = forward_facts(tok, seq, starts, {0: 4, 1: 2})
    assert phase.tolist() == [[PREFILL] * 4 + [DECODE] * 2, [PREFILL] * 4 + [DECODE] * 2]
    assert step.tolist() == [[-1, -1, -1, -1, 0, 1], [-1, -1, -1, -1, 0, 1]]
    assert cache_len.tolist() == [[4, 4, 4, 4, 5, 6], [0, 0, 2, 2, 3, 4]]
    assert forward_starts(tok, seq, 6, 2, {}) == [0, 2, 4]  # no decode: chunks alone


# -- the tool, end to end ------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset_run", ['decode = true\nbatching = "left"',
                                        pytest.param("decode = true", marks=pytest.mark.slow),
                                        pytest.param('decode = true\nbatching = "left"\n[run.native]\ncache_kind = '
                                                     '"paged"\npage_size = 4', marks=pytest.mark.slow),
                                        pytest.param('decode = true\n[cache]\ndtype = "float64"',
                                                     marks=pytest.mark.slow)])
def test_a_decode_run_passes_against_one_prefill_at_every_response_position(preset_run, run_cli, tmp_path):
    ref = _toml(tmp_path, "ref")
    cand = _toml(tmp_path, "cand", preset_run)
    res = run_cli("run", ref, cand, "--out", tmp_path, "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["final"]["tensors"]["response_logits"]["compared"] == sum(map(len, RESPONSES)) * 96
    lp = rep["logprobs"]
    assert lp["tokens"] == sum(map(len, RESPONSES)) and lp["max_abs_dlogp"] < 1e-4 and lp["k3_kl"] < 1e-8
    phases = rep["layers"][0]["tensors"]["layer_output"]["max_abs_by_phase"]  # the rows grouped by phase
    assert set(phases) == {"prefill", "decode"} and phases["decode"] < 1e-4
    assert "max abs by phase (prompt rows, decoded response rows): layer 0 prompt" in res.output
    with Trace(tmp_path / "cand.h5") as t, Trace(tmp_path / "ref.h5") as r:
        assert t.version == FORMAT_VERSION and (r.rows["phase"] == PREFILL).all()
        for s, (p, resp) in enumerate(zip(PROMPTS, RESPONSES)):
            tok = t.inputs["token_index"][s]
            dec = tok >= len(p)
            assert (t.rows["phase"][s][dec] == DECODE).all() and (t.rows["phase"][s][~dec] == PREFILL).all()
            assert t.rows["step"][s][dec].tolist() == list(range(len(resp)))
            assert t.rows["cache_len"][s][dec].tolist() == [len(p) + i + 1 for i in range(len(resp))]
            assert t.response["token_index"][s].tolist() == list(range(len(p) - 1, len(p) + len(resp) - 1))


@pytest.mark.parametrize("fault, where", [("decode-position", ("layer", 0, "cache_positions")),
                                          ("decode-stale-cache", ("layer", 0, "value")),
                                          ("decode-mask", ("layer", 0, "value"))])
def test_each_decode_fault_is_caught_at_a_decode_step_its_layer_and_kind(fault, where, run_cli, tmp_path):
    ref = _toml(tmp_path, "ref")
    cand = _toml(tmp_path, "cand", 'decode = true\nbatching = "left"', f'[fault]\nname = "{fault}"')
    res = run_cli("run", ref, cand, "--json", tmp_path / "r.json")
    fb = json.loads((tmp_path / "r.json").read_text())["first_break"]
    assert res.exit_code == 1 and (fb["stage"], fb["layer"], fb["kind"]) == where, res.output
    assert fb["decode_step"] is not None and f"(decode step {fb['decode_step']})" in res.output
    if fault != "decode-position":  # the prompt's rows agree, the response's do not
        phases = json.loads((tmp_path / "r.json").read_text())["layers"][0]["tensors"]["attn_update"]
        assert phases["max_abs_by_phase"]["prefill"] < 1e-4 < phases["max_abs_by_phase"]["decode"]
    assert json.loads((tmp_path / "r.json").read_text())["diagnosis"].startswith(
        f"The break's position was computed by the candidate in decode step {fb['decode_step']}")
    tok = PROMPTS[fb["sample"]] + RESPONSES[fb["sample"]]
    assert fb["position"] - len(PROMPTS[fb["sample"]]) == fb["decode_step"] and fb["position"] < len(tok)


@pytest.mark.slow
def test_unmasked_padding_in_decode_only_breaks_the_padded_samples_decode_rows(run_cli, tmp_path):
    """decode-mask: the prompt rows (one forward) agree; the break is a padded sample's decode step, and the
    longest sample (no padding) is never named."""
    res = run_cli("run", "reference", "fault:decode-mask", "--response-ids", "31,32,33,34", "--json",
                  tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    fb = rep["first_break"]
    assert res.exit_code == 1 and (fb["layer"], fb["tensor"]) == (0, "attn_update") and fb["decode_step"] is not None
    assert 0 not in fb["samples"] and set(fb["samples"]) <= {1, 2}, fb
    res = run_cli("run", "reference", "fault:decode-mask", "--response-ids", "31,32,33,34", "--json",
                  tmp_path / "u.json", "--tokens", "5,6,7", "--tokens", "8,9,10")  # equal lengths: no padding
    assert res.exit_code == 0 and "INCONCLUSIVE" in res.output and "left-padded batch of unequal lengths" in res.output


def test_a_decode_fault_without_decode_cannot_show(run_cli, tmp_path):
    cand = _toml(tmp_path, "cand", "", '[fault]\nname = "decode-position"')
    res = run_cli("run", _toml(tmp_path, "ref"), cand)
    assert res.exit_code == 0 and "INCONCLUSIVE" in res.output and "decode = false" in res.output


@pytest.mark.slow
def test_a_response_the_sides_hold_differently_is_a_coverage_break_not_a_pass(run_cli, tmp_path):
    """Samples are matched by their token ids, prompt and response: a response the candidate holds otherwise
    leaves the reference's sample without a counterpart."""
    ref = _toml(tmp_path, "ref")
    cand = tmp_path / "cand.toml"
    cand.write_text(open(_toml(tmp_path, "cand", "decode = true")).read().replace("[39, 40, 41, 42]", "[39, 40, 41, 43]"))
    res = run_cli("run", ref, cand)  # run says so before either side runs
    assert res.exit_code == 2 and "reference sample [2] of 3 have no counterpart" in res.output
    assert run_cli("record", ref, "-o", tmp_path / "ref.h5").exit_code == 0
    assert run_cli("record", cand, "-o", tmp_path / "cand.h5").exit_code == 0
    res = run_cli("compare", tmp_path / "ref.h5", tmp_path / "cand.h5", "--json", tmp_path / "r.json")
    fb = json.loads((tmp_path / "r.json").read_text())["first_break"]
    assert res.exit_code == 1 and fb["kind"] == "coverage" and fb["samples"] == [2], res.output


def test_decode_needs_a_response_and_an_engine_that_decodes(run_cli):
    res = run_cli("run", "reference", "decode")
    assert res.exit_code == 2 and "decode = true writes a response token by token: give one" in res.output
    res = run_cli("run", "reference", "vllm", "--response-ids", "3,4",
                  env={"PREFILL_DIFF_VLLM_PYTHON": "/never-started"})  # refused before its interpreter is looked at
    assert res.exit_code == 2 and "the vllm engine records a response only by writing it in its own decode steps" \
        in res.output
    res = run_cli("run", "reference", "tp2", "--response-ids", "3,4")
    assert res.exit_code == 2 and "with tp > 1 is not supported" in res.output
    res = run_cli("run", "reference", "decode", "--response-ids", "3,,4")
    assert res.exit_code == 2 and "--response-ids '3,,4': id 1 is empty" in res.output


def test_the_log_prob_figures_reach_json_junit_and_markdown(run_cli, tmp_path):
    res = run_cli("run", "reference", "fault:decode-stale-cache", "--response-ids", "31,32,33",
                  "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml", "--markdown", tmp_path / "r.md")
    assert res.exit_code == 1
    lp = json.loads((tmp_path / "r.json").read_text())["logprobs"]
    assert lp["tokens"] == 9 and lp["max_abs_dlogp"] > 1e-3 and len(lp["largest"]) == 5
    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "r.xml").iter("property")}
    assert float(props["logprobs_max_abs_dlogp"]) == lp["max_abs_dlogp"] and props["logprobs_tokens"] == "9"
    md = (tmp_path / "r.md").read_text()
    assert "response log-probs (9 tokens): mean \\|dlogp\\|" in md
    assert "response log-probs (9 tokens)" in res.output


# -- the figures, against a hand computation ------------------------------------------------------------------

class _Side:
    def __init__(self, samples, token_index, logits):
        self.samples, self.response = samples, {"token_index": np.array(token_index), "logits": np.array(logits)}


def test_log_prob_figures_are_the_rl_frameworks_quantities():
    rng = np.random.default_rng(0)
    samples = [np.array([1, 2, 3, 0, 4])]
    zr = rng.normal(size=(1, 3, 5)).astype(np.float32)
    zc = zr + rng.normal(scale=0.1, size=zr.shape).astype(np.float32)
    ref, cand = _Side(samples, [[1, 2, 3]], zr), _Side(samples, [[1, 2, 3]], zc)
    got = compare_logprobs(ref, cand, [(0, 0)])
    nxt = [3, 0, 4]  # the tokens after token indices 1, 2, 3
    lr = np.array([log_softmax(zr[0, i])[nxt[i]] for i in range(3)], dtype=np.float64)
    lc = np.array([log_softmax(zc[0, i])[nxt[i]] for i in range(3)], dtype=np.float64)
    d = lc - lr
    assert got.tokens == 3
    assert math.isclose(got.mean_abs_dlogp, np.abs(d).mean()) and math.isclose(got.max_abs_dlogp, np.abs(d).max())
    assert math.isclose(got.mean_abs_dp, np.abs(np.exp(lc) - np.exp(lr)).mean())
    assert math.isclose(got.k3_kl, np.mean(np.exp(-d) - 1 + d)) and got.k3_kl > 0
    assert math.isclose(got.pearson_p, np.corrcoef(np.exp(lr), np.exp(lc))[0, 1])
    assert math.isclose(got.log_ppl_diff, np.mean(-lc) - np.mean(-lr))
    assert got.largest[0]["position"] == [2, 3, 4][int(np.argmax(np.abs(d)))]
    same = compare_logprobs(ref, _Side(samples, [[1, 2, 3]], zr), [(0, 0)])
    assert same.max_abs_dlogp == 0 and same.k3_kl == 0 and same.log_ppl_diff == 0
    assert compare_logprobs(ref, _Side(samples, [[-1, -1, -1]], zr), [(0, 0)]) is None
    torch.testing.assert_close(torch.tensor(log_softmax(zr[0])), torch.log_softmax(torch.tensor(zr[0]), -1))


# -- a stranger's response record and rows ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d = tmp_path_factory.mktemp("decoded")
    res = CliRunner().invoke(cli, ["run", _toml(d, "ref"), _toml(d, "cand", "decode = true"), "--out", str(d)])
    assert res.exit_code == 0, res.output
    return d


@pytest.mark.parametrize("edit, named", [
    (lambda r: r["samples"][0].update(response=r["samples"][0]["response"] + 1),
     "meta.record.response.samples[0] must have prompt + response = sample 0's length"),
    (lambda r: r["samples"][1].update(sample=9), "meta.record.response.samples[1].sample must name one of the 3"),
    (lambda r: r.update(chosen_by="nobody"), "meta.record.response.chosen_by must be one of"),
])
def test_a_stranger_s_response_record_that_does_not_add_up_is_refused(decoded, edit, named, run_cli, tmp_path):
    import shutil
    import h5py
    bad = tmp_path / "cand.h5"
    shutil.copy(decoded / "cand.h5", bad)
    with h5py.File(bad, "a") as f:
        meta = json.loads(f.attrs["meta"])
        edit(meta["record"]["response"])
        del f.attrs["meta"]
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode("utf-8"))
    res = run_cli("compare", decoded / "ref.h5", bad)
    assert res.exit_code == 2 and named in res.output, res.output


def test_a_response_row_out_of_its_sample_is_refused(decoded, run_cli, tmp_path):
    import shutil
    import h5py
    bad = tmp_path / "cand.h5"
    shutil.copy(decoded / "cand.h5", bad)
    with h5py.File(bad, "a") as f:
        f["response/token_index"][0, 0] = 99
    res = run_cli("compare", decoded / "ref.h5", bad)
    assert res.exit_code == 2 and "/response/token_index" in res.output, res.output


def test_response_logits_that_differ_fail_at_the_final_stage(decoded, run_cli, tmp_path):
    """A PASS is a claim: a candidate whose response logits differ (and nothing else) fails, naming them."""
    import shutil
    import h5py
    bad = tmp_path / "cand.h5"
    shutil.copy(decoded / "cand.h5", bad)
    with h5py.File(bad, "a") as f:
        f["response/logits"][1, 2, 7] += 0.5
    res = run_cli("compare", decoded / "ref.h5", bad, "--json", tmp_path / "r.json")
    fb = json.loads((tmp_path / "r.json").read_text())["first_break"]
    assert res.exit_code == 1 and (fb["stage"], fb["tensor"], fb["sample"]) == ("final", "response_logits", 1)
    assert fb["position"] == len(PROMPTS[1]) + 1 and fb["decode_step"] == 1, res.output


@pytest.mark.slow
# -- every engine that decodes, on the families ----------------------------------------------------------------

@pytest.mark.parametrize("model", ["synthetic", "synthetic:qwen3", "synthetic:qwen3-moe"])
@pytest.mark.parametrize("preset", ["decode", "transformers-decode"])
def test_each_engines_decode_passes_against_one_prefill_on_the_families(preset, model, run_cli, tmp_path):
    """float32, ten response tokens after each built-in prompt; a mixture of experts' routing is compared at every
    token, decode steps included."""
    res = run_cli("run", "reference", preset, "--model", model, "--response-ids", "31,32,33,34,35,36,37,38,39,40",
                  "--json", tmp_path / "r.json", "--out", tmp_path)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["logprobs"]["tokens"] == 30 and rep["logprobs"]["max_abs_dlogp"] < 1e-4
    with Trace(tmp_path / "cand.h5") as t:
        assert (t.rows["step"] >= 0).sum() == 30 and t.meta["engine"]["name"] == rep["candidate"]["engine"]["name"]
    if model.endswith("moe"):
        assert rep["routing"]["tokens_compared"] == 3 * sum(rep["reference"]["prefill"]["samples"][s]["tokens"]
                                                             for s in range(3)) and rep["routing"]["flips"] == 0


@pytest.mark.slow
def test_a_bfloat16_decode_is_judged_calibrated_against_a_prefill_twin(run_cli, tmp_path):
    """The golden and the twin prefill prompt + response (no decode in them: decode is what is tested)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "decode"\n[run]\ndtype = "bfloat16"\n')
    res = run_cli("run", "reference", cfg, "--response-ids", "31,32,33,34", "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["rule"].startswith("calibrated"), res.output
    assert 1e-4 < rep["logprobs"]["max_abs_dlogp"] < 0.1


@pytest.mark.slow
def test_response_tokens_are_the_candidates_greedy_choice_replayed_by_the_reference(run_cli, tmp_path):
    res = run_cli("run", "reference", "decode", "--response-tokens", "5", "--json", tmp_path / "r.json",
                  "--out", tmp_path)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["logprobs"]["chosen_by"] == "candidate" and rep["logprobs"]["tokens"] == 15
    assert "chosen by the candidate" in res.output
    with Trace(tmp_path / "ref.h5") as r, Trace(tmp_path / "cand.h5") as c:
        assert r.meta["record"]["response"]["chosen_by"] == "candidate" and r.samples == c.samples
        for s in range(3):  # greedy: each response token is the argmax of the logits before it
            p = r.meta["record"]["response"]["samples"][s]["prompt"]
            ti, z = c.response["token_index"][s], c.response["logits"][s]
            assert [int(c.samples[s][t + 1]) for t in ti] == z.argmax(-1).tolist() and ti[0] == p - 1
    res = run_cli("run", "reference", "llama.cpp", "--response-tokens", "2")
    assert res.exit_code == 2 and "--response-tokens: the llama.cpp engine does not choose tokens" in res.output
    res = run_cli("run", "reference", "decode", "--response-tokens", "2", "--response", "x")
    assert res.exit_code == 2 and "give one of --response, --response-ids and --response-tokens" in res.output
