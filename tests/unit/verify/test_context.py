"""verify/context.py: what every comparer gets. The Context's views of its policy and calibration, the golden's
and twin's datasets (refused when they are not full), each aligned pair's rows read from the right sample of
the right trace, and the KV heads that query heads read."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from prefill_diff.dumps.reader import TraceError
from prefill_diff.verify.align import Alignment
from prefill_diff.verify.calibrate import CalibAcc, Calibration
from prefill_diff.verify import context as context_module
from prefill_diff.verify.context import Context, Rows
from prefill_diff.dumps.schema import TOL_KINDS
from prefill_diff.verify.tolerance import Policy, Tolerance

from ._traces import DIM, SAMPLES, context, make_spec, policy, record


def _permuted(spec, order):
    """The same samples batched in another order: sample j of the result is sample order[j] of spec."""
    out = spec.copy()
    out.samples = [spec.samples[o] for o in order]
    out.pad = [spec.pad[o] for o in order]
    out.start = [spec.start[o] for o in order]
    out.states = {k: [v[o] for o in order] for k, v in spec.copy().states.items()}
    out.caches = {k: [v[o] for o in order] for k, v in spec.copy().caches.items()}
    out.finals = [spec.copy().finals[o] for o in order]
    return out


def _calib(golden_spec, twin_spec=None, level="full", twin_level="full", **kw):
    g = record(golden_spec, level, name="golden")
    t = None if twin_spec is None else record(twin_spec, twin_level, name="twin")
    return Calibration(golden=g, twin=t, **kw)


def _pair():
    ref = make_spec()
    return record(ref, name="ref"), record(ref, name="cand")


# -- the policy and calibration, as the comparers read them ----------------------------------------------------

def test_without_calibration_values_are_judged_by_the_policys_tolerance_of_each_kind():
    kinds = {k: Tolerance(1e-3 * (i + 1), 1e-4 * (i + 1)) for i, k in enumerate(TOL_KINDS)}
    ref, cand = _pair()
    ctx = context(ref, cand, Policy("p", kinds, equal_nan=True))
    assert ctx.calib is None and ctx.noise_of is None and ctx.calib_acc(2) is None
    assert ctx.equal_nan is True
    assert ctx.value_tol("mid", 0) == kinds["residual"] == ctx.value_tol("layer_output")
    assert ctx.value_tol("attn_update", 3) == kinds["attn_update"]
    assert ctx.value_tol("cache_keys", 0) == kinds["cache_keys"]
    assert ctx.value_tol("logits") == kinds["logits"]
    assert ctx.calib_datasets(0, "mid") == (None, None)
    assert context(ref, cand, policy()).equal_nan is False


def test_with_calibration_values_are_only_measured_and_the_calibration_is_handed_on():
    """The calibrated rule judges; the tolerance only gathers metrics (an infinite atol, rtol 0)."""
    spec = make_spec()
    ref, cand = _pair()
    ctx = context(ref, cand, calib=_calib(spec, factor=8.0, floor=1e-3, label="bfloat16"))
    for name in ("mid", "attn_update", "cache_values", "logits"):
        t = ctx.value_tol(name, 0)
        assert t.atol == float("inf") and t.rtol == 0.0 and t.ntol == 0.0
    assert ctx.noise_of == "bfloat16"
    acc = ctx.calib_acc(2)
    assert isinstance(acc, CalibAcc) and (acc.factor, acc.floor, acc.n_heads) == (8.0, 1e-3, 2)
    assert ctx.calib_acc().n_heads is None


def test_each_context_has_its_own_notes_and_skipped_checks():
    ref, cand = _pair()
    a, b = context(ref, cand), context(ref, cand)
    a.notes.append("x")
    a.skipped.add("y")
    assert b.notes == [] and b.skipped == set()


# -- calib_datasets -------------------------------------------------------------------------------------------

def test_calib_datasets_are_the_golden_and_twin_tensors_of_the_layer():
    g_spec, t_spec = make_spec(n_layers=2, seed=1), make_spec(n_layers=2, seed=2)
    ref, cand = _pair()
    ctx = context(ref, cand, calib=_calib(g_spec, t_spec))
    gd, td = ctx.calib_datasets(1, "mlp_update")
    for ds, spec in ((gd, g_spec), (td, t_spec)):
        for s in range(len(SAMPLES)):
            want = spec.states[(1, "mlp_update")][s]
            assert np.array_equal(ds[s][:len(want)], want)
    gk, tk = ctx.calib_datasets(0, "cache_keys")
    for ds, spec in ((gk, g_spec), (tk, t_spec)):
        for s, x in enumerate(SAMPLES):
            assert np.array_equal(ds[s][:, :len(x)], spec.caches[0][s][0])


def test_without_a_twin_only_the_golden_is_given():
    g_spec = make_spec(seed=3)
    ref, cand = _pair()
    gd, td = context(ref, cand, calib=_calib(g_spec)).calib_datasets(0, "cache_values")
    assert td is None
    assert np.array_equal(gd[1][:, :len(SAMPLES[1])], g_spec.caches[0][1][1])


@pytest.mark.parametrize("name", ["mid", "cache_keys"])
def test_a_golden_that_is_not_full_is_refused_naming_it(name):
    spec = make_spec()
    ref, cand = _pair()
    ctx = context(ref, cand, calib=_calib(spec, spec, level="stats"))
    with pytest.raises(TraceError) as e:
        ctx.calib_datasets(0, name)
    assert str(e.value) == (f"golden: layer 0 has no full {name} (a calibrated comparison needs full golden and twin "
                            "traces)")


def test_a_twin_that_is_not_full_is_refused_naming_it():
    spec = make_spec()
    ref, cand = _pair()
    ctx = context(ref, cand, calib=_calib(spec, spec, twin_level="stats"))
    with pytest.raises(TraceError, match=r"^twin: layer 0 has no full layer_output "):
        ctx.calib_datasets(0, "layer_output")


# -- rows -----------------------------------------------------------------------------------------------------

@pytest.fixture(params=["calling thread", "read ahead"])
def read_mode(request, monkeypatch):
    """Rows read on the calling thread (small steps) and read ahead on the reader thread."""
    if request.param == "read ahead":
        home = sys.modules[context_module.read_ahead.__module__]  # wherever dumps keeps read_ahead
        monkeypatch.setattr(home, "AHEAD_MIN_BYTES", 0)
    return request.param


def _copies(rows_iter):
    return [Rows(*(x.copy() if isinstance(x, np.ndarray) else x for x in r)) for r in rows_iter]


def test_rows_are_each_pairs_own_rows_of_each_trace(read_mode):
    """The candidate batches the samples in another order with other padding: each Rows holds the reference's
    sample rs, the candidate's sample cs (its own values, not the reference's) and the golden's and twin's
    sample rs."""
    ref_spec = make_spec(pad=[0, 2, 1], seed=1)
    cand_spec = _permuted(make_spec(pad=[0, 2, 1], seed=2), [2, 0, 1]).relayout([1, 0, 3])
    g_spec, t_spec = make_spec(pad=[0, 2, 1], seed=3), make_spec(pad=[0, 2, 1], seed=4)
    ref, cand = record(ref_spec, name="ref"), record(cand_spec, name="cand")
    ctx = context(ref, cand, calib=_calib(g_spec, t_spec))
    assert [tuple(p) for p in ctx.pairs] == [(0, 1), (1, 2), (2, 0)]
    gd, td = ctx.calib_datasets(0, "mid")
    got = _copies(ctx.rows(ref.layer(0).state("mid"), cand.layer(0).state("mid"), gd, td))
    assert [(r.rs, r.cs) for r in got] == [(0, 1), (1, 2), (2, 0)]
    for r in got:
        n = len(ref_spec.samples[r.rs])
        for x, spec, s in ((r.ref, ref_spec, r.rs), (r.cand, cand_spec, r.cs), (r.golden, g_spec, r.rs),
                           (r.twin, t_spec, r.rs)):
            assert x.shape == (ref.n_cols if x is not r.cand else cand.n_cols, DIM)
            for t in range(n):
                assert np.array_equal(x[spec.pad[s] + t], spec.row("mid", s, t)), (r.rs, t)


def test_rows_without_golden_or_twin_leave_them_none(read_mode):
    ref_spec = make_spec()
    ref, cand = record(ref_spec, name="ref"), record(ref_spec, name="cand")
    ctx = context(ref, cand, calib=_calib(make_spec(seed=5)))
    gd, td = ctx.calib_datasets(0, "layer_input")
    assert td is None
    got = _copies(ctx.rows(ref.layer(0).state("layer_input"), cand.layer(0).state("layer_input"), gd))
    assert [r.twin for r in got] == [None] * 3 and all(r.golden is not None for r in got)
    got = _copies(ctx.rows(ref.layer(0).state("layer_input"), cand.layer(0).state("layer_input")))
    assert [(r.golden, r.twin) for r in got] == [(None, None)] * 3
    assert all(np.array_equal(r.ref, r.cand) for r in got)


def test_no_common_sample_gives_no_rows():
    ref = record(make_spec(samples=[[1, 2, 3]]), name="ref")
    cand = record(make_spec(samples=[[1, 2, 4]]), name="cand")
    ctx = context(ref, cand)
    assert ctx.pairs == []
    assert list(ctx.rows(ref.layer(0).state("mid"), cand.layer(0).state("mid"))) == []


# -- kv_heads_read ---------------------------------------------------------------------------------------------

def _with_args(**args):
    side = SimpleNamespace(args=args)
    return Context(side, side, policy(), align=SimpleNamespace(pairs=[]))


@pytest.mark.parametrize("hq,hkv,heads,want", [
    (8, 2, (0, 3), (0,)),          # 0·2//8 = 0, 3·2//8 = 0
    (8, 2, (7, 0, 4), (0, 1)),     # 14//8 = 1, 0, 8//8 = 1
    (6, 4, (1, 2, 5), (0, 1, 3)),  # 4//6 = 0, 8//6 = 1, 20//6 = 3
    (4, 4, (3, 1), (1, 3)),        # one KV head per query head
    (4, 1, (0, 1, 2, 3), (0,)),    # multi-query attention
])
def test_kv_heads_read_are_floor_of_h_times_kv_over_q(hq, hkv, heads, want):
    assert _with_args(n_heads=hq, n_kv_heads=hkv).kv_heads_read(heads) == want


@pytest.mark.parametrize("args,heads", [
    ({"n_heads": 8, "n_kv_heads": 2}, ()),
    ({"n_heads": 8, "n_kv_heads": 2}, None),
    ({"n_kv_heads": 2}, (1,)),
    ({"n_heads": 8}, (1,)),
    ({"n_heads": 0, "n_kv_heads": 2}, (1,)),
    ({"n_heads": 8.0, "n_kv_heads": 2}, (1,)),
    ({"n_heads": 8, "n_kv_heads": "2"}, (1,)),
])
def test_kv_heads_read_is_unknown_without_heads_or_usable_head_counts(args, heads):
    assert _with_args(**args).kv_heads_read(heads) is None


def test_kv_heads_read_uses_the_reference_model():
    ctx = Context(SimpleNamespace(args={"n_heads": 4, "n_kv_heads": 2}), SimpleNamespace(args={"n_heads": 4,
                  "n_kv_heads": 4}), policy(), align=SimpleNamespace(pairs=[]))
    assert ctx.kv_heads_read((3,)) == (1,)  # 3·2//4, not 3·4//4


def test_pairs_are_the_alignments():
    ref_spec = make_spec()
    ref, cand = record(ref_spec, name="ref"), record(_permuted(ref_spec, [1, 2, 0]), name="cand")
    align = Alignment(ref, cand)
    ctx = Context(ref, cand, policy(), align)
    assert ctx.pairs is align.pairs and [tuple(p) for p in ctx.pairs] == [(0, 2), (1, 0), (2, 1)]
