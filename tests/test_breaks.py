"""verify/breaks.py: the one check order, the first break it picks, and breaks built from results."""
from __future__ import annotations

import pytest

from prefill_diff.verify.breaks import (ORDER, Break, Checks, cache_break, first_break, numerics_break, shape_break,
                                        tensor_break, value_break)
from prefill_diff.verify.calibrate import CalibResult
from prefill_diff.verify.results import CacheResult, Finite, Needed, TensorResult
from prefill_diff.verify.tolerance import Tolerance
from prefill_diff.verify.wording import break_line

TOL = Tolerance(1e-3, 1e-2, 0.0, 0.0)


def _value(tensor="attn_update", **kw) -> TensorResult:
    """A full-level result with 3 of 64 values out of tolerance at sample 1, position 4, channel 2."""
    base = dict(tensor=tensor, level="full", tol=TOL, compared=64, max_abs=0.5, max_rel=2.0, n_bad=3,
                worst=(1, 4, 2), worst_bound=1.2e-3, max_row_rel=0.25, bad_samples=(1,), bad_positions={1: 4},
                needed=Needed(atol=0.49, rtol=1.5, ntol=0.0, row_rtol=0.25))
    return TensorResult(**{**base, **kw})


def _b(kind, tensor="mid", **kw) -> Break:
    return Break(stage="layer", kind=kind, message=kind, layer=3, tensor=tensor, **kw)


def test_the_order_runs_from_structure_to_values():
    assert ORDER == ("shape", "rank_divergence", "finite_mask", "cache_length", "cache_positions", "numerics",
                     "positions", "routing", "value", "top_ids")  # a wrong expert is the cause of the MLP's values


def test_shape_is_picked_over_value_at_the_same_layer_whatever_the_filing_order():
    checks = Checks()
    checks.add("value", _b("value", "attn_update"))
    checks.add("finite_mask", None)
    checks.add("shape", _b("shape", "mlp_update"))
    assert (checks.first().kind, checks.first().tensor) == ("shape", "mlp_update")
    assert first_break({"value": _b("value"), "cache_length": _b("cache_length")}).kind == "cache_length"
    assert first_break({"value": None, "top_ids": None}) is None


def test_within_one_step_the_first_filed_wins():
    checks = Checks()
    for tensor in ("layer_input", "attn_update", "mid"):
        checks.add("value", _b("value", tensor))
    assert checks.first().tensor == "layer_input"


def test_a_deferred_check_runs_only_when_no_earlier_step_broke():
    calls = []

    def costly():
        calls.append(1)
        return _b("rank_divergence")

    checks = Checks()
    checks.add("rank_divergence", costly)
    checks.add("shape", _b("shape"))
    assert checks.first().kind == "shape" and calls == []
    checks = Checks()
    checks.add("value", _b("value"))
    checks.add("rank_divergence", costly)
    assert checks.first().kind == "rank_divergence" and calls == [1]
    checks = Checks()
    checks.add("positions", lambda: None)  # looked for, found nothing: the next step's break
    checks.add("value", _b("value"))
    assert checks.first().kind == "value"


def test_an_unknown_step_is_refused():
    with pytest.raises(ValueError, match="check step must be one of shape, rank_divergence"):
        Checks().add("values", _b("value"))


def test_a_tensors_own_break_is_shape_then_finite_then_value():
    shaped = _value(shape_detail="mid width 64 vs 32", finite=Finite(cand_only=2))
    b = tensor_break("layer", 3, shaped)
    assert (b.kind, b.message, b.tensor) == ("shape", "mid width 64 vs 32", "attn_update")
    nan = _value(finite=Finite(ref_only=2, both=1))
    b = tensor_break("layer", 3, nan)
    assert (b.kind, b.sample, b.position, b.padding) == ("finite_mask", 1, 4, False)
    assert b.message == ("non-finite values in valid rows of attn_update: 0 valid values finite only in the "
                         "candidate, 2 finite only in the reference, 1 non-finite in both")
    assert tensor_break("layer", 3, _value(n_bad=0)) is None


def test_nan_on_both_sides_passes_only_with_equal_nan():
    assert not Finite(both=3) and Finite(both=3, equal_nan=True)
    assert not Finite(pad_ref=1, pad_cand=2, equal_nan=True)


def test_padding_only_non_finite_values_are_a_padding_break():
    t = _value(n_bad=0, finite=Finite(pad_ref=0, pad_cand=5))
    b = tensor_break("layer", 0, t)
    assert (b.kind, b.padding, b.position) == ("finite_mask", True, None)
    assert b.message.startswith("5 non-finite values in padding rows of attn_update in the candidate only")


def test_a_value_break_carries_the_numbers_and_the_minimum_passing_tolerance():
    b = value_break("layer", 3, _value(), heads=(0, 1), kv_read=(0,))
    assert (b.sample, b.position, b.channel, b.max_abs_error, b.bound, b.heads, b.kv_heads) == \
        (1, 4, 2, 0.5, 1.2e-3, (0, 1), (0,))
    assert "3 of 64 values of attn_update out of tolerance" in b.message
    assert "would pass with atol>=0.49, rtol>=1.5, ntol>=0 or row_rtol>=0.25" in b.message
    assert break_line(b) == ("layer 3 attn_update | sample 1 pos 4 | max_abs=5.0e-01 > tol=1.2e-03 | query heads 0,1 "
                             "(reading KV heads 0)")
    sampled = value_break("layer", 3, _value(level="sampled"))
    assert sampled.message.endswith(" [sampled level]")


def test_a_value_break_says_the_share_out_and_both_values_at_the_worst_element():
    """As torch.testing.assert_close: mismatched elements in %, the worst element's full index and both values."""
    b = value_break("layer", 3, _value(worst_values=(0.125, -0.375)))
    assert (b.reference_value, b.candidate_value) == (0.125, -0.375)
    assert b.message.startswith("3 of 64 values of attn_update out of tolerance (4.7%); worst element (sample 1, "
                                "pos 4, channel 2): reference 0.125, candidate -0.375, tolerance there 1.2e-03; ")
    # values that agree to 4 digits are given with the digits that tell them apart
    close = value_break("layer", 3, _value(worst_values=(1.2345678, 1.2345999)))
    assert "reference 1.23457, candidate 1.2346," in close.message


def test_shares_are_never_rounded_to_none_or_all():
    from prefill_diff.verify.wording import share
    assert [share(*x) for x in ((1664, 1664), (1, 3), (0, 10), (1, 10 ** 6), (9999, 10 ** 4), (0, 0))] == \
        ["100.0%", "33.3%", "0.0%", "0.0001%", ">99.9%", "0%"]


def test_a_stats_level_value_break_has_no_element_error():
    t = _value(level="stats", worst=(1, None, None), worst_bound=None)
    b = value_break("layer", 2, t)
    assert b.max_rel_error is None and b.bound is None and b.position is None
    assert "[stats level: no element, row or relative error is recorded]" in b.message
    assert break_line(b) == ("layer 2 attn_update | sample 1 | statistic error=5.0e-01 (stats level: min, max, "
                             "mean, rms; no values)")


def test_a_calibrated_value_break_is_check_1_with_the_noise_ratio():
    k = CalibResult(4.0, 6e-8, rows=10, bad_rows=2, max_ratio=9.5, cand_error=0.02, noise=0.002, allowed=0.008,
                    min_factor=9.6, worst=(0, 3), bad_samples=(0,), groups=(1,))
    b = value_break("layer", 1, _value(tensor="cache_keys", calib=k), noise_of="bfloat16")
    assert (b.check, b.noise_ratio, b.noise_factor, b.noise_of, b.kv_heads, b.atol) == \
        ("change", 9.5, 4.0, "bfloat16", (1,), None)
    assert b.message.startswith("row error 9.5x the measured bfloat16 noise (allowed 4x): 2 of 10 rows")
    # per row: the share of rows out, the worst row's (sample, position), the candidate's and the twin's errors there
    assert ("2 of 10 rows of cache_keys out (20.0%); at the worst row (sample 0, pos 3) the candidate is 0.02 of the "
            "row norm from the float64 golden, the twin 0.002") in b.message
    assert value_break("layer", 1, _value(calib=CalibResult(4.0, 6e-8, rows=10))) is None  # check 1 holds


def test_cache_lengths_break_before_positions():
    both = CacheResult(lengths_ok=False, positions_ok=False, detail="d", sample=2, position=5, samples=(2,))
    step, b = cache_break(4, both)
    assert (step, b.kind, b.tensor, b.sample, b.position) == ("cache_length", "cache_length", "cache_lengths", 2, 5)
    step, b = cache_break(4, CacheResult(positions_ok=False, detail="d", sample=0, position=1))
    assert (step, b.kind) == ("cache_positions", "cache_positions")
    assert cache_break(4, CacheResult())[1] is None and CacheResult() and not both


def test_a_twin_break_is_worded_as_the_precisions_own():
    b = numerics_break(shape_break("layer", 2, _value(shape_detail="x")), "bfloat16", "bfloat16")
    assert b.check == "numerics" and b.kind == "shape"
    assert b.message == ("the bfloat16 numerics themselves break here (check 2): the twin, the reference's own path "
                         "in bfloat16, differs from the reference beyond the fixed bfloat16 envelope: x")
    assert numerics_break(None, "bfloat16", "bfloat16") is None


def test_break_json_keeps_its_keys_in_order():
    d = _b("value", "cache_values", heads=(1,), kv_heads=(0,), samples=(2, 3)).as_dict()
    assert list(d) == ["stage", "kind", "message", "layer", "tensor", "sample", "position", "channel",
                       "max_abs_error", "max_rel_error", "atol", "rtol", "ntol", "bound", "padding", "heads",
                       "samples", "kv_heads", "check", "noise_ratio", "noise_factor", "noise_of", "reference_value",
                       "candidate_value", "sublayer"]
    assert (d["heads"], d["kv_heads"], d["samples"], d["sublayer"]) == ([1], [0], [2, 3], "attention")


def test_breaks_are_built_by_keyword_only():
    with pytest.raises(TypeError):
        Break("layer", "value", "m")  # noqa: the 14 positional arguments of earlier versions are gone


def test_a_later_break_cites_the_first_wherever_it_is():
    from prefill_diff.verify.wording import after_first_break
    cov = Break(stage="metadata", kind="coverage", message="1 of 3 reference samples have no counterpart")
    assert after_first_break(cov, "layer 1 mid | x") == "after the first break at the metadata stage (coverage): " \
                                                      "layer 1 mid | x"
    assert after_first_break(_b("cache_length"), "y").startswith("after the first break at layer 3 cache length: ")
