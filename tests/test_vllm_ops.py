"""vLLM's op-level states (--level ops: engine/foreign/vllm_ops.py's hooks) and its op replay (vllm_engine.replay_ops),
each against an independent computation: our engine's own forward and transformers', recorded at --level ops.

Needs vLLM's environment, as tests/test_vllm.py does (CI: a failure, never a skip). Every vLLM run is module-scoped
and shared by the tests that read it.
"""
from __future__ import annotations

import numpy as np
import pytest

from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.schema import OP, OP_NAMES
from prefill_diff.engine.shared.op_replay import ReplayInput, ReplaySample

from test_vllm import vllm_python  # noqa: F401  (the fixture: vLLM's environment, or a skip / CI failure)

pytestmark = pytest.mark.slow  # vLLM in its own environment and process

RESPONSE = "31,32,33,34"  # after each built-in prompt: vLLM writes it in four decode steps of its own
GEMMS = ("q", "k", "v", "o_proj", "gate", "up", "down")


@pytest.fixture(scope="module")
def traces(vllm_python, tmp_path_factory):  # noqa: F811
    """{model: (our engine's trace, vLLM's trace)} in float32 at --level ops: the built-in Llama decoded by vLLM
    (a response after each prompt, our engine prefilling prompt + response at once), and a Qwen3 (QK-norm)."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d, out = tmp_path_factory.mktemp("vllm-ops"), {}
    for model, ref, cand, extra in (("synthetic", "reference", "vllm-decode", ["--response-ids", RESPONSE]),
                                    ("synthetic:qwen3", "reference", "vllm", [])):
        paths = []
        for preset in (ref, cand):
            path = d / f"{model.replace(':', '-')}-{preset}.h5"
            res = CliRunner().invoke(cli, ["record", preset, "--model", model, "-o", str(path), "--level", "ops",
                                           *extra], catch_exceptions=False)
            assert res.exit_code == 0, res.output
            paths.append(path)
        out[model] = tuple(paths)
    return out


def _pairs(ref: Trace, cand: Trace, layer: int, name: str):
    """Each sample's (ours, vLLM's) rows of op ``name``, by token index."""
    a, b = ref.layer(layer).op(name), cand.layer(layer).op(name)
    for s in range(ref.n_samples):
        (rc, rt), (cc, ct) = ref.cells(s), cand.cells(s)
        assert np.array_equal(rt, ct), s  # every token computed by both, in order
        yield np.asarray(a[s])[rc], np.asarray(b[s])[cc]


@pytest.mark.parametrize("model", ["synthetic", "synthetic:qwen3"])
def test_vllm_records_every_op_and_each_equals_ours_to_float32_tolerance(model, traces):
    """Every op the model computes is recorded (decode steps included on the built-in model), in float32, and
    equals our engine's to float32 tolerance: the fused qkv_proj split into q, k, v and gate_up_proj into gate, up
    included (a wrong split would put one projection's rows under another's name)."""
    with Trace(traces[model][0]) as ref, Trace(traces[model][1]) as cand:
        absent = set(ref.ops["absent"])
        assert cand.ops["recorded"] == [n for n in OP_NAMES if n not in absent], cand.ops
        assert set(cand.ops["absent"]) == absent == (set() if model.endswith("qwen3") else {"q_norm", "k_norm"})
        assert cand.ops["how"]["mlp_norm"].startswith("vLLM's fused add+RMSNorm")
        if model == "synthetic":  # four decode rows per sample beside the prompt's
            assert all((cand.rows["phase"][s][cand.cells(s)[0]] == 1).sum() == 4 for s in range(cand.n_samples))
        for layer in range(ref.n_layers):
            for name in cand.ops["recorded"]:
                assert cand.layer(layer).op(name).attrs["source_dtype"] in ("float32", b"float32")
                for ours, theirs in _pairs(ref, cand, layer, name):
                    assert ours.shape == theirs.shape and np.isfinite(theirs).all(), (layer, name)
                    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=2e-5 * max(1.0, np.abs(ours).max()),
                                               err_msg=f"layer {layer} {name}")


def test_vllm_records_its_shared_rotary_module_per_layer(traces):
    """vLLM runs one rotary_emb module for every layer: layer 0's and layer 1's q_rope differ, and each is ours."""
    with Trace(traces["synthetic"][0]) as ref, Trace(traces["synthetic"][1]) as cand:
        for name in ("q_rope", "k_rope"):
            (o0, t0), = list(_pairs(ref, cand, 0, name))[:1]
            (o1, t1), = list(_pairs(ref, cand, 1, name))[:1]
            assert np.abs(t0 - t1).max() > 0.1 * np.abs(t0).max(), name
            np.testing.assert_allclose(t0, o0, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(t1, o1, rtol=1e-4, atol=1e-5)


# -- replay ------------------------------------------------------------------------------------------------

def replay_input(ref: Trace) -> ReplayInput:
    """The reference's recorded ops and layer states per sample, at its cells in token order."""
    samples, cells = [], []
    for s in range(ref.n_samples):
        c, t = ref.cells(s)
        cells.append(c)
        samples.append(ReplaySample(s, ref.inputs["positions"][s, c].astype(np.int64), t, ref.rows["phase"][s, c]))

    def tensor(layer, name, i):
        view = ref.layer(layer)
        ds = view.op(name) if name in OP else view.state(name)
        return None if ds is None else np.asarray(ds[samples[i].sample])[cells[i]]
    return ReplayInput(samples, list(range(ref.n_layers)), str(ref.meta["engine"]["dtype"]), tensor)


def _replay(vllm_python, ref_path, preset: str):  # noqa: F811
    from prefill_diff.engine.config import load_side
    from prefill_diff.engine.foreign import vllm_engine
    from prefill_diff.engine.prepared import prepare
    ref = Trace(ref_path)
    given = replay_input(ref)
    return ref, given, vllm_engine.replay_ops(prepare(load_side(preset)), given)


def _share(ref_rows, got_rows) -> float:
    eq = sum(int((a == b).sum()) for a, b in zip(ref_rows, got_rows))
    return eq / sum(a.size for a in ref_rows)


def test_vllm_replays_its_ops_on_our_float32_inputs(vllm_python, traces):  # noqa: F811
    """vLLM's own modules, called on our engine's recorded inputs in the worker: every op but the attention core
    (its backend needs a scheduled step, and says so) equals our engine's output to float32 tolerance."""
    ref, given, got = _replay(vllm_python, traces["synthetic"][0], "vllm")
    with ref:
        assert set(got.not_replayed) == {"attn_core", "q_norm", "k_norm"} and got.dtype == "float32", got.not_replayed
        assert "scheduled step" in got.not_replayed["attn_core"]
        assert any("unfused" in n for n in got.notes) and any("fused add+RMSNorm" in n for n in got.notes)
        for layer in given.layers:
            for name in [n for n in OP_NAMES if n not in got.not_replayed]:
                rows = got.out[(layer, name)]
                assert len(rows) == len(given.samples)
                for i, row in enumerate(rows):
                    want = given.tensor(layer, name, i)
                    np.testing.assert_allclose(row, want, rtol=1e-4, atol=2e-5 * max(1.0, np.abs(want).max()),
                                               err_msg=f"layer {layer} {name}")


def test_vllm_bf16_replay_gemms_are_bitwise_transformers_and_its_fused_norm_and_rotary_are_not(vllm_python,  # noqa: F811
                                                                                                 tmp_path):
    """Against transformers in bfloat16, each op fed transformers' own input: vLLM's GEMMs (q, k, v, o_proj, gate,
    up, down) are 100% bitwise equal; its fused add+RMSNorm (mlp_norm: it normalises the float32 sum) and its
    rotary kernel are not, though within a few bfloat16 ULPs."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    path = tmp_path / "transformers-bf16.h5"
    res = CliRunner().invoke(cli, ["record", "transformers-bf16", "-o", str(path), "--level", "ops"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ref, given, got = _replay(vllm_python, path, "vllm-bf16")
    with ref:
        assert got.dtype == "bfloat16"
        share = {}
        for name in GEMMS + ("attn_norm", "act_mul", "attn_residual", "mlp_norm", "q_rope", "k_rope"):
            want = [given.tensor(layer, name, i) for layer in given.layers for i in range(len(given.samples))]
            rows = [got.out[(layer, name)][i] for layer in given.layers for i in range(len(given.samples))]
            share[name] = _share(want, rows)
            for a, b in zip(want, rows):  # never more than a few bfloat16 ULPs apart
                np.testing.assert_allclose(b, a, rtol=2 ** -6, atol=1e-2, err_msg=name)
        assert all(share[n] == 1.0 for n in GEMMS), share
        assert share["mlp_norm"] < 0.95 and share["q_rope"] < 0.95 and share["k_rope"] < 0.95, share
