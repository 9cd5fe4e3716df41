"""--first-layers N (engine/models/snapshot.py ``Snapshot.truncated``): both sides run the model's first N layers,
the later layers' weights dropped before any engine sees them; the trace and the report say so."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.engine.models.sources import load_snapshot
from prefill_diff.engine.models.spec import ModelSpec


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d = tmp_path_factory.mktemp("cut")
    for name, extra in (("whole", []), ("cut", ["--first-layers", "2"])):
        res = CliRunner().invoke(cli, ["record", "reference", "-o", str(d / f"{name}.h5"), *extra])
        assert res.exit_code == 0, res.output
    return d / "whole.h5", d / "cut.h5"


@pytest.mark.slow  # the traces: two recordings
def test_the_first_two_layers_are_the_whole_runs_bit_for_bit(traces):
    whole, cut = (h5py.File(p, "r") for p in traces)
    assert sorted(cut["layers"]) == ["000", "001"] and len(whole["layers"]) == 4
    meta = json.loads(cut.attrs["meta"])
    assert meta["model"]["truncated"] == {"layers": 2, "of": 4} and meta["model"]["args"]["n_layers"] == 2
    for layer in ("000", "001"):
        for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
            assert np.array_equal(whole[f"layers/{layer}/{name}"][()], cut[f"layers/{layer}/{name}"][()],
                                  equal_nan=True), (layer, name)
        for name in ("keys", "values"):
            assert np.array_equal(whole[f"layers/{layer}/cache/{name}"][()], cut[f"layers/{layer}/cache/{name}"][()])


@pytest.mark.slow  # the traces: two recordings
def test_the_final_logits_are_the_truncated_models(traces):
    """norm + unembedding applied to layer 1's output at each sample's last token, computed here in float64 from
    the model's weights, equal the cut trace's logits (and differ from the whole model's)."""
    whole, cut = (h5py.File(p, "r") for p in traces)
    snap = load_snapshot(ModelSpec("synthetic"))
    w_norm = snap.state["norm.weight"].double()
    w_out = snap.state.get("output.weight", snap.state["tok_embeddings.weight"]).double()
    out = torch.from_numpy(cut["layers/001/layer_output"][()]).double()
    for s, col in enumerate(cut["final/gather_col"][()]):
        h = out[s, col]
        h = h * torch.rsqrt(h.pow(2).mean() + snap.args.norm_eps) * w_norm
        want = (w_out @ h).numpy()
        got = cut["final/logits"][s]
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), np.abs(got - want).max()
        assert not np.allclose(whole["final/logits"][s], want, rtol=1e-3, atol=1e-3)


def test_a_truncated_snapshot_keeps_only_its_layers():
    snap = load_snapshot(ModelSpec("synthetic"))
    cut = snap.truncated(1)
    assert cut.args.n_layers == 1 and cut.truncated_of == 4
    assert not [k for k in cut.state if k.startswith(("layers.1.", "layers.2.", "layers.3."))]
    assert "norm.weight" in cut.state and cut.state["layers.0.attention.wq.weight"] is \
        snap.state["layers.0.attention.wq.weight"]
    assert cut.weights_digest != snap.weights_digest


@pytest.mark.parametrize("n", ["0", "5"])
def test_first_layers_out_of_range_is_refused_naming_both_numbers(run_cli, n):
    res = run_cli("run", "reference", "reference", "--first-layers", n)
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == f"Error: --first-layers must be from 1 to the model's 4 layers " \
                                                  f"(got {n})", res.output


@pytest.mark.slow  # the traces: two recordings
def test_a_truncated_trace_against_a_whole_one_says_why_they_differ(traces, run_cli):
    res = run_cli("compare", *map(str, traces))
    assert res.exit_code == 2  # not comparable: refused, as every metadata break
    assert "n_layers 4 vs 2; the candidate ran its model's first 2 of 4 layers (--first-layers)" in \
        res.output.replace("\n", " "), res.output


@pytest.mark.slow
def test_run_first_layers_on_transformers_says_so_in_the_header(run_cli, tmp_path):
    """transformers' own module cut after loading (hf_engine.truncate) agrees with ours on the first 2 layers; the
    header says 'first 2 of 4 layers' for both sides; a config's [model] is cut too."""
    res = run_cli("run", "reference", "transformers", "--first-layers", "2", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert res.output.count("first 2 of 4 layers") == 2, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["layers"]) == 2 and rep["candidate"]["truncated"] == {"layers": 2, "of": 4}


@pytest.mark.slow
def test_vllm_gets_the_truncated_checkpoint(tmp_path):
    """vLLM's checkpoint is written from the cut snapshot (an hf:DIR source too): 2 layers in its config and its
    weights."""
    from safetensors import safe_open
    from prefill_diff.engine.foreign.vllm_engine import model_directory
    d = model_directory(load_snapshot(ModelSpec("synthetic")).truncated(2), str(tmp_path))
    assert json.loads(open(f"{d}/config.json").read())["num_hidden_layers"] == 2
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        layers = {k.split(".")[2] for k in f.keys() if k.startswith("model.layers.")}
    assert layers == {"0", "1"}
