"""Traces: what the recorder writes is what the engine computed, and the reader checks files first."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from conftest import Capture, padded
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.dumps.schema import FORMAT_NAME, FORMAT_VERSION
from prefill_diff.verify.pipeline import prepare_side, record_side


@pytest.fixture
def left_trace(tmp_path):
    prep = prepare_side("batched-left")
    return prep, record_side(prep, tmp_path / "t.h5")


def test_trace_holds_what_the_engine_computed(left_trace):
    prep, path = left_trace
    call = prep.calls[0]
    cap = Capture()
    prep.engine.prefill(call.ids, call.mask, call.positions, prep.side.run.cache, recorder=cap)
    with Trace(path) as t:
        assert t.f.attrs["format"].decode() == FORMAT_NAME and t.f.attrs["format_version"].decode() == FORMAT_VERSION
        assert t.version == FORMAT_VERSION
        assert t.samples == [tuple(x) for x in prep.tokens]
        np.testing.assert_array_equal(t.inputs["valid_mask"], call.mask.numpy())
        np.testing.assert_array_equal(t.inputs["input_ids"], call.ids.numpy())
        for layer in range(t.n_layers):
            v = t.layer(layer)
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output", "attn_heads"):
                np.testing.assert_array_equal(v.state(name)[:], cap.states[(layer, name)].numpy())
            for s, toks in enumerate(prep.tokens):
                k, val, pos = cap.caches[(layer, s)]
                n = len(toks)
                np.testing.assert_array_equal(v.cache("keys")[s, :, :n], k.numpy())
                np.testing.assert_array_equal(v.cache("values")[s, :, :n], val.numpy())
                assert v.cache_positions[s, :n].tolist() == pos.tolist()
                assert int(v.cache_lengths[s]) == n
        for s in range(len(prep.tokens)):
            h, z, cell, tok = cap.finals[s]
            np.testing.assert_array_equal(t.final["logits"][s], z.numpy())
            np.testing.assert_array_equal(t.final["norm_last"][s], h.numpy())
            assert t.final["gather_token"][s] == tok == len(prep.tokens[s]) - 1
            assert t.final["topk_ids"][s, 0] == int(z.argmax())
        meta = t.meta
        assert meta["model"]["weights_digest"].startswith("sha256:")
        assert meta["repro"]["torch"] == torch.__version__
        assert meta["side"]["run"]["batching"] == "left"


def test_logical_cells_ignore_padding(left_trace):
    prep, path = left_trace
    with Trace(path) as t:
        for s, toks in enumerate(prep.tokens):
            cols, tok = t.cells(s)
            assert tok.tolist() == list(range(len(toks)))
            assert cols.tolist() == list(range(t.n_cols - len(toks), t.n_cols))
            assert t.pad_cols(s).tolist() == list(range(t.n_cols - len(toks)))


def test_reader_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        Trace(tmp_path / "nope.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(TraceError, match="not a readable HDF5 file"):
        Trace(junk)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(TraceError, match="not a prefill-diff trace"):
        Trace(foreign)


def test_reader_rejects_unknown_version(left_trace, tmp_path):
    _, path = left_trace
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = "9.0"
    with pytest.raises(TraceError, match=r"version '9.0' is not supported \(this reader reads versions 1.x\)"):
        Trace(path)


def test_recorder_refuses_to_overwrite(left_trace):
    from prefill_diff.dumps.recorder import TraceExistsError
    prep, path = left_trace
    with pytest.raises(TraceExistsError, match="pass --force"):
        record_side(prep, path)
    record_side(prep, path, force=True)
    Trace(path).close()
