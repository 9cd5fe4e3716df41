"""The hint a fault's first break gets names that fault's kind of cause: a routing decision (not drift), the
sliding window's bound, attention's own scores or softmax, the experts' weighting (verify/diagnose.py)."""
from __future__ import annotations

import pytest

from prefill_diff.jobs import run_lockstep
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.native import prefill
from prefill_diff.verify.report import compare_traces

DRIFT = "numeric drift of the candidate's precision or kernel"


def test_a_router_taking_other_ranks_is_a_routing_decision_not_drift():
    rep = run_lockstep("reference", "fault:router-topk-off-by-one", model=ModelSpec("synthetic:mixtral")).report
    fb = rep.first_break
    assert (fb.layer, fb.kind) == (0, "routing"), rep.verdict_line()
    hint = rep.diagnosis
    assert hint.startswith("A routing decision differs at layer 0, not numeric drift: the candidate sent token "
                           f"{fb.position} of sample {fb.sample} to other experts although the reference's router "
                           f"margin there (its k-th minus its (k+1)-th router logit) is {fb.max_abs_error:.3g}, more "
                           f"than the {fb.bound:.3g} that noise can overturn."), hint
    assert "The router's input (mid) agrees within tolerance" in hint
    assert DRIFT not in hint and "max_abs" not in hint and "atol" not in hint


@pytest.mark.parametrize("model,layer", [("synthetic:qwen2-window", 1), ("synthetic:mistral", 0)])
def test_a_window_off_by_one_is_named(model, layer):
    """Window 8: token 8 is the first whose window leaves out an earlier token; with W+1 keys it sees token 0."""
    rep = run_lockstep("reference", "fault:window-off-by-one", model=ModelSpec(model)).report
    fb = rep.first_break
    assert (fb.layer, fb.tensor) == (layer, "attn_update"), rep.verdict_line()
    assert rep.diagnosis == (
        f"Layer {layer} is a sliding-window layer (W=8) and its attention output first differs at token 8 (tokens "
        "0..7 agree) while its cached keys and values agree: consistent with the sliding window applied off by one, "
        "one key too wide: queries past the window attend to W+1 keys instead of W (token W is the first whose "
        "window leaves out an earlier token)."), rep.diagnosis


def test_every_query_head_differing_over_agreeing_keys_and_values_is_attention_itself(tmp_path, monkeypatch):
    """The candidate's attention kernel scales its scores by 1.25 (queries scaled inside the kernel: the keys and
    values it caches are untouched), as a wrong score scale or soft-cap would."""
    ref = record_side(prepare_side("reference"), tmp_path / "ref.h5")
    real = prefill.get_kernel

    def scaled(*args, **kw):
        kernel = real(*args, **kw)
        return lambda q, k, v, mask, shapes=None: kernel(q * 1.25, k, v, mask, shapes)

    monkeypatch.setattr(prefill, "get_kernel", scaled)
    cand = record_side(prepare_side("reference"), tmp_path / "cand.h5")
    with Trace(ref) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
    fb = rep.first_break
    assert (fb.layer, fb.tensor, fb.heads) == (0, "attn_update", (0, 1, 2, 3)), rep.verdict_line()
    assert rep.diagnosis.startswith(
        "At layer 0 every query head's attention output differs (4 of 4) while the layer's cached keys and values "
        "agree: the difference enters inside attention, after K and V, and is common to every head — consistent "
        "with the attention scores (their scale or soft-cap), the mask or the softmax computed differently"), \
        rep.diagnosis


def test_experts_weighted_differently_over_the_same_experts_is_named():
    rep = run_lockstep("reference", "fault:router-norm-topk", model=ModelSpec("synthetic:mixtral")).report
    fb = rep.first_break
    assert (fb.layer, fb.tensor) == (0, "mlp_update"), rep.verdict_line()
    compared = rep.layers[0].routing.compared
    assert rep.diagnosis.startswith(
        f"At layer 0 the MLP update differs while its input (mid) agrees and every token compared ({compared} "
        "tokens) chose the same experts on both sides: the experts' outputs are weighted or computed differently "
        "— the top-k weights (renormalised or not: norm_topk_prob)"), rep.diagnosis
    assert DRIFT not in rep.diagnosis
