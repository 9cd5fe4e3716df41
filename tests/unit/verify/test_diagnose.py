"""verify/diagnose.py: the hint for a first break, matched to the §2.11 table by the break and the traces.

The traces are stand-ins holding only what the hints read (metadata, inputs, layer 0's cache, the final
gather columns); the breaks are built as the comparison builds them.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from prefill_diff.verify.breaks import Break
from prefill_diff.verify.diagnose import CONTRACT, diagnose
from prefill_diff.verify.final import FinalResult, Gathered
from prefill_diff.verify.tolerance import Policy, Tolerance

PAIRS = [(0, 0), (1, 1), (2, 2)]
ARGS = {"dim": 8, "n_layers": 4, "n_heads": 2, "n_kv_heads": 2, "head_dim": 4, "vocab_size": 16}


def side(*, dtype="float32", args=None, record=None, padded=(), positions=None, gather_col=None, n_cols=6,
         **meta):
    """A trace stand-in: ``padded`` samples hold a computed padding cell; ``positions`` layer 0's cache
    positions per sample."""
    computed = np.ones((3, n_cols), dtype=np.int64)
    valid = np.ones((3, n_cols), dtype=np.int64)
    for s in padded:
        valid[s, 0] = 0
    pos = positions or [list(range(5))] * 3
    T = max(map(len, pos))
    layer0 = SimpleNamespace(cache_lengths=np.array([len(p) for p in pos]),
                             cache_positions=np.array([p + [-1] * (T - len(p)) for p in pos]))
    m = {"model": {"args": {**ARGS, **(args or {})}}, "engine": {"dtype": dtype}, **meta}
    if record is not None:
        m["record"] = record
    token_index = np.where(valid == 1, np.cumsum(valid, 1) - 1, -1)
    rows = {"phase": np.zeros((3, n_cols), dtype=np.uint8), "step": np.full((3, n_cols), -1),  # prefill cells
            "cache_len": np.full((3, n_cols), -1)}
    return SimpleNamespace(meta=m, args=m["model"]["args"], rows=rows,
                           inputs={"computed": computed, "valid_mask": valid, "token_index": token_index},
                           layer=lambda i: layer0, n_cols=n_cols,
                           final={"gather_col": np.asarray(gather_col if gather_col is not None else [4, 4, 4])})


def brk(kind, stage="layer", layer=0, tensor="attn_update", **kw) -> Break:
    return Break(stage=stage, kind=kind, message=kind, layer=layer, tensor=tensor, **kw)


def hint(fb, ref=None, cand=None, final=None, policy=None, pairs=PAIRS):
    return diagnose(fb, pairs, final, ref or side(), cand or side(), policy)


def test_no_break_no_hint():
    assert hint(None) is None


def test_the_contract_is_cited_exactly_when_a_table_row_is():
    """A hint naming a §2.11 row ends with where the table is; one that names none does not."""
    cited = hint(brk("cache_length", layer=2, tensor="cache_lengths"))
    assert "§2.11 row 2" in cited and cited.endswith(" " + CONTRACT)
    plain = hint(brk("positions", tensor="positions"))
    assert "§2.11" not in plain and CONTRACT not in plain


def test_coverage_and_metadata_breaks():
    cov = hint(Break(stage="metadata", kind="coverage", message="m"))
    assert cov.startswith("The candidate did not prefill every request of the reference")
    meta = hint(Break(stage="metadata", kind="metadata", message="m"))
    assert meta == "The traces are not of the same model architecture or prompts, so no layer can be compared."


@pytest.mark.parametrize("layer,agree", [(0, ""), (1, " (layer 0 agrees)"), (3, " (layers 0..2 agree)")])
def test_a_cache_length_break_says_which_layers_agree(layer, agree):
    text = hint(brk("cache_length", layer=layer, tensor="cache_lengths"))
    assert text.startswith(f"The cache of layer {layer} holds a different number of tokens{agree}: ")
    assert "§2.11 row 2" in text


def test_cache_positions_restarting_after_a_reused_prefix_name_the_slot():
    """Sample 1 of the candidate reused 2 tokens and its positions restart at 0 at slot 2."""
    reuse = {"reuse": [{"sample": 1, "prefix_len": 2, "hit": True}]}
    restarted = [list(range(5)), [0, 1, 0, 1, 2], list(range(4))]
    cand = side(record=reuse, positions=restarted)
    text = hint(brk("cache_positions", tensor="cache_positions"), cand=cand)
    assert "restart at 0 at slot 2 of sample 1, right after the reused prefix" in text
    assert "§2.11 row 3" in text
    generic = "Cache positions differ from layer 0: the position descriptor"
    assert hint(brk("cache_positions", tensor="cache_positions"), cand=side(positions=restarted)).startswith(
        generic)  # no prefix was reused: not that fault
    assert hint(brk("cache_positions", tensor="cache_positions"), cand=side(record=reuse)).startswith(generic)
    assert hint(brk("cache_positions", layer=2, tensor="cache_positions"), cand=cand).startswith(
        "Cache positions differ from layer 2")


def test_positions_shape_and_rank_divergence_breaks_are_hinted_by_their_kind():
    assert hint(brk("positions", tensor="positions")).startswith("The position ids given to the model differ")
    assert hint(brk("shape", layer=3)) == ("Tensor shapes differ at layer 3: the two runs do not use the same "
                                           "model configuration?")
    for tensor, part in (("attn_update", "attention output projection"), ("mlp_update", "MLP down projection"),
                         ("mid", "layer")):
        text = hint(brk("rank_divergence", layer=1, tensor=tensor))
        assert f"hold different values of {tensor} at layer 1" in text and f"consistent with the {part}'s" in text


def test_non_finite_values_in_padding_and_in_valid_rows():
    pad = hint(brk("finite_mask", padding=True))
    assert pad.startswith("NaN/Inf first appear in padding rows") and "§2.11 row 7" in pad
    valid = hint(brk("finite_mask", tensor="mlp_update"))
    assert valid.startswith("Non-finite values appear in valid rows at mlp_update") and "§2.11" not in valid


def test_a_different_model_explains_a_value_break_before_numerics():
    """rope_theta differs: a layer-0 cache_keys break is where that difference first shows."""
    ref, cand = side(args={"rope_theta": 10000.0}), side(args={"rope_theta": 500000.0})
    text = hint(brk("value", tensor="cache_keys", max_abs_error=0.5), ref, cand)
    assert text.startswith("The two sides do not run the same model: rope_theta differs (reference 10000.0 vs "
                           "candidate 500000.0): consistent with the layer-0 cache_keys break")
    # a structural break is still hinted by its kind
    assert hint(brk("cache_length", layer=2, tensor="cache_lengths"), ref, cand).startswith("The cache of layer 2")


def _declared(name="float32", source="flag", calibration=None) -> Policy:
    t = Tolerance(1e-6, 1e-5)
    return Policy(name, {"residual": t}, calibration=calibration, sources={k: source for k in ("atol", "rtol")})


def test_a_declared_rule_finer_than_the_candidates_precision_is_named():
    """A declared float32 rule against a bfloat16 candidate: the break may be rounding alone."""
    fb = brk("value", max_abs_error=0.1)
    text = hint(fb, cand=side(dtype="bfloat16"), policy=_declared())
    assert text.startswith("The rule was declared (flag): a fixed float32 rule, but the candidate computes in "
                           "bfloat16") and "--twin-of bfloat16" in text
    drift = "First value difference at layer 0 attn_update"
    assert hint(fb, cand=side(dtype="float32"), policy=_declared()).startswith(drift)  # as fine as the rule
    assert hint(fb, cand=side(dtype="bfloat16"), policy=_declared(source="float32 default")).startswith(drift)
    assert hint(fb, cand=side(dtype="bfloat16"), policy=_declared(calibration={"factor": 4})).startswith(drift)
    assert hint(fb, cand=side(dtype="bfloat16"), policy=_declared("bfloat16")).startswith(drift)


def test_top_ids_break():
    text = hint(brk("top_ids", stage="final", layer=None, tensor="topk_ids"))
    assert text.startswith("Logits agree within tolerance but the top-ranked ids differ beyond it")


def _final(*gathers) -> FinalResult:
    return FinalResult(tensors=(), top_ids_ok=True, top_detail=None, first_break=None, gather=gathers)


def test_a_final_value_break_with_every_gather_right_suspects_the_head():
    fb = brk("value", stage="final", layer=None, tensor="logits")
    want = "All layers agree but the final logits do not: the final norm, the unembedding or its bias differs?"
    assert hint(fb, final=None) == want
    assert hint(fb, final=_final(Gathered(0, 4, 4, 4), Gathered(1, 2, 2, 2))) == want


def test_gathers_from_the_rectangles_last_column_are_the_last_column_fault():
    """Samples 1 and 2 (last valid tokens 2 and 3) were both read from column 5, the last of 6."""
    fb = brk("value", stage="final", layer=None, tensor="logits")
    final = _final(Gathered(0, 4, 4, 4), Gathered(1, 2, -1, 2), Gathered(2, 3, 5, 3))
    text = hint(fb, final=final, cand=side(gather_col=[4, 5, 5], n_cols=6))
    assert text.startswith("All layers agree, but the final logits of samples 1, 2 were not gathered at the last "
                           "valid token: ")
    assert ("sample 1 from stored column 5 (a padding cell; its last valid token is 2); "
            "sample 2 from stored column 5 (token 5; its last valid token is 3).") in text
    assert "Every one was read from column 5, the rectangle's last" in text and "§2.11 row 1" in text


def test_a_gather_at_another_column_is_not_called_the_last_column():
    fb = brk("value", stage="final", layer=None, tensor="logits")
    final = _final(Gathered(0, 4, 3, 4), Gathered(1, 2, 2, 2))
    text = hint(fb, final=final, cand=side(gather_col=[3, 2, 4], n_cols=6))
    assert "the final logits of sample 0 were not gathered" in text and "(token 3; its last valid token is 4)" in text
    assert "The gather did not use each sample's last valid token" in text and "rectangle's last" not in text


def test_a_cache_value_break_after_a_forced_reuse_is_snapshot_identity():
    forced = {"reuse": [{"sample": 0, "prefix_len": 2, "hit": True, "forced": True, "reason": "adapter differs"}]}
    text = hint(brk("value", layer=1, tensor="cache_values", max_abs_error=0.2), cand=side(record=forced))
    assert text.startswith("Cache values of the reused prefix differ at layer 1, and the candidate forced a prefix "
                           "reuse that the metadata check refused (adapter differs)") and "§2.11 row 6" in text
    unforced = {"reuse": [{"sample": 0, "prefix_len": 2, "hit": True}]}
    assert hint(brk("value", layer=1, tensor="cache_values", max_abs_error=0.2),
                cand=side(record=unforced)).startswith("First value difference at layer 1 cache_values")


def test_some_query_heads_at_layer_0_are_a_head_to_kv_head_mapping():
    text = hint(brk("value", heads=(1,), max_abs_error=0.3))
    assert text.startswith("At layer 0 only query head 1 of 2 differs while K/V agree") and "§2.11 row 4" in text
    every = hint(brk("value", heads=(0, 1), max_abs_error=0.3))
    assert every.startswith("First value difference at layer 0 attn_update")  # every head: no mapping error
    later = hint(brk("value", layer=1, heads=(1,), max_abs_error=0.3))
    assert later.startswith("First value difference at layer 1")


def test_query_heads_of_one_tensor_parallel_rank_name_that_rank():
    ranks = [{"rank": 0, "query_heads": [0, 2], "kv_heads": [0, 1]},
             {"rank": 1, "query_heads": [2, 4], "kv_heads": [1, 2]}]
    cand = side(args={"n_heads": 4}, parallel={"ranks": ranks})
    cand.ranks = [object(), object()]
    text = hint(brk("value", heads=(2,), max_abs_error=0.3), ref=side(args={"n_heads": 4}), cand=cand)
    assert ("At layer 0 only query head 2 of 4 differs while the cached K/V agree, and query head 2 is rank "
            "1's (it holds query heads 2..3 and KV head 1)") in text


def test_only_padded_samples_differing_at_layer_0_is_padding_seen():
    cand = side(padded=(1, 2))
    text = hint(brk("value", samples=(1, 2), max_abs_error=0.3), cand=cand)
    assert text.startswith("At layer 0 only padded samples [1, 2] differ; unpadded samples agree") and \
        "§2.11 row 5" in text
    drift = "First value difference at layer 0 attn_update"
    assert hint(brk("value", samples=(0, 1), max_abs_error=0.3), cand=cand).startswith(drift)  # 0 is unpadded
    assert hint(brk("value", samples=(0, 1, 2), max_abs_error=0.3), cand=side(padded=(0, 1, 2))).startswith(drift)


def test_a_value_break_elsewhere_is_drift_or_a_jump():
    text = hint(brk("value", layer=2, tensor="mlp_update", max_abs_error=0.0123))
    assert text.startswith("First value difference at layer 2 mlp_update (max_abs=0.012); ")
    assert hint(brk("value", layer=2, tensor="mlp_update")) is None  # no error to quote


# -- hints that read what agreed in the break's layer (its LayerResult) ------------------------------------------

class _Tensor(SimpleNamespace):
    """A TensorResult stand-in: within tolerance or not (its truth), its level, and per sample its first token out
    of tolerance."""

    def __bool__(self):
        return self.ok


def _tensor(name, ok=True, level="full", first=None):
    return _Tensor(tensor=name, level=level, ok=ok, bad_positions=first or {})


def _layer(i, *tensors, routing=None):
    ts = {t.tensor: t for t in tensors}
    return SimpleNamespace(layer=i, routing=routing, tensor=ts.get)


def _attention_layer(i, first, kv_level="full"):
    return _layer(i, _tensor("cache_keys", level=kv_level), _tensor("cache_values", level=kv_level),
                  _tensor("attn_update", ok=False, first=first))


WINDOWED = {"sliding_window": 4, "layer_types": ["full", "sliding", "full", "full"]}


@pytest.mark.parametrize("first,how", [({0: 4, 2: 6}, "one key too wide: queries past the window attend to W+1 keys"),
                                       ({1: 3}, "one key too narrow: queries attend to W-1 keys instead of W from "
                                                "token W-1 on")])
def test_a_sliding_window_layer_first_differing_where_the_window_cuts_is_the_window(first, how):
    ref = side(args=WINDOWED)
    fb = brk("value", layer=1, heads=(0, 1), max_abs_error=0.3)
    text = diagnose(fb, PAIRS, None, ref, side(), None, [_attention_layer(0, {}), _attention_layer(1, first)])
    t = min(first.values())
    assert text.startswith(f"Layer 1 is a sliding-window layer (W=4) and its attention output first differs at token "
                           f"{t} (tokens 0..{t - 1} agree) while its cached keys and values agree: consistent with the "
                           "sliding window applied off by one, " + how), text


def test_the_window_is_not_blamed_without_its_evidence():
    """A full layer, a difference before the window cuts, or keys and values not compared: no window hint."""
    fb = brk("value", layer=1, heads=(0,), max_abs_error=0.3)
    for args, lr in (({}, _attention_layer(1, {0: 4})), (WINDOWED, _attention_layer(1, {0: 2})),
                     (WINDOWED, _attention_layer(1, {0: 4}, kv_level="none"))):
        text = diagnose(fb, PAIRS, None, side(args=args), side(), None, [lr])
        assert text.startswith("First value difference at layer 1 attn_update"), text


def test_every_query_head_over_agreeing_keys_and_values_is_attention_itself():
    fb = brk("value", layer=2, heads=(0, 1), max_abs_error=0.3)
    text = diagnose(fb, PAIRS, None, side(), side(), None, [_attention_layer(2, {0: 1})])
    assert text.startswith("At layer 2 every query head's attention output differs (2 of 2) while the layer's "
                           "cached keys and values agree"), text
    for lr in (_attention_layer(2, {0: 1}, kv_level="none"), _attention_layer(1, {0: 1})):  # K/V unknown
        assert diagnose(fb, PAIRS, None, side(), side(), None, [lr]).startswith("First value difference at layer 2")
    some = brk("value", layer=2, heads=(1,), max_abs_error=0.3)
    assert diagnose(some, PAIRS, None, side(), side(), None, [_attention_layer(2, {0: 1})]).startswith(
        "First value difference at layer 2")


def test_a_routing_break_is_a_decision_and_says_whether_the_router_input_agreed():
    fb = brk("routing", layer=1, tensor="routing", sample=2, position=5, max_abs_error=0.84, bound=1e-3)
    agreed = diagnose(fb, PAIRS, None, side(), side(), None, [_layer(1, _tensor("mid"))])
    assert agreed.startswith("A routing decision differs at layer 1, not numeric drift: the candidate sent token 5 "
                             "of sample 2 to other experts although the reference's router margin there (its k-th "
                             "minus its (k+1)-th router logit) is 0.84, more than the 0.001 that noise can overturn. "
                             "The router's input (mid) agrees within tolerance"), agreed
    moved = diagnose(fb, PAIRS, None, side(), side(), None, [_layer(1, _tensor("mid", ok=False))])
    assert "The router's input (mid) differs beyond tolerance too" in moved
    topk = diagnose(brk("routing", layer=0, tensor="routing", max_abs_error=float("inf"), bound=0.0), PAIRS, None,
                    side(), side())
    assert topk.startswith("At layer 0 the two sides take a different number of experts per token")
