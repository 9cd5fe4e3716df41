"""Traces: what the recorder writes is what the engine computed, and the reader checks files first."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from conftest import Capture, padded
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.engine.native.settings import cache_config
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.dumps.schema import FORMAT_NAME, FORMAT_VERSION
from prefill_diff.jobs.sides import prepare_side, record_side


@pytest.fixture
def left_trace(tmp_path):
    prep = prepare_side("batched-left")
    return prep, record_side(prep, tmp_path / "t.h5")


def test_trace_holds_what_the_engine_computed(left_trace):
    prep, path = left_trace
    call = prep.calls[0]
    cap = Capture()
    prep.engine.prefill(call.ids, call.mask, call.positions, cache_config(prep.side.run), recorder=cap)
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
    from prefill_diff.dumps.placement import TraceExistsError
    prep, path = left_trace
    with pytest.raises(TraceExistsError, match="pass --force"):
        record_side(prep, path)
    record_side(prep, path, force=True)
    Trace(path).close()


# -- an outside engine: a tiny Llama in plain numpy, written here, recording through the public API only ---------

def _numpy_llama(w: dict, theta: float, eps: float, n_heads: int, n_kv: int, tokens, rope="rotate-half"):
    """An independent float32 Llama prefill (no torch, none of our engine): per layer the five states,
    concat(O), the cache (keys after RoPE, values), then the final norm and logits of the last token."""
    f = lambda k: np.asarray(w[k], dtype=np.float32)
    n_layers = 1 + max(int(k.split(".")[1]) for k in w if k.startswith("layers."))
    x = f("tok_embeddings.weight")[np.asarray(tokens)]  # (T, d)
    T = x.shape[0]
    dh = f("layers.0.attention.wq.weight").shape[0] // n_heads
    norm = lambda v, g: (v / np.sqrt((v.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(
        np.float32) * g
    inv = 1.0 / theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    ang = np.arange(T)[:, None] * inv[None, :]  # (T, dh/2)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rot(v):  # (heads, T, dh)
        if rope == "rotate-half":  # Hugging Face / Llama convention: pairs (i, i + dh/2)
            a, b = v[..., :dh // 2], v[..., dh // 2:]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
        a, b = v[..., 0::2], v[..., 1::2]  # the wrong one for these weights: interleaved pairs (2i, 2i + 1)
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    layers = []
    for i in range(n_layers):
        p = f"layers.{i}."
        h = norm(x, f(p + "attention_norm.weight"))
        q = (h @ f(p + "attention.wq.weight").T).reshape(T, n_heads, dh).transpose(1, 0, 2)
        k = (h @ f(p + "attention.wk.weight").T).reshape(T, n_kv, dh).transpose(1, 0, 2)
        v = (h @ f(p + "attention.wv.weight").T).reshape(T, n_kv, dh).transpose(1, 0, 2)
        q, k = rot(q), rot(k)
        o = np.empty_like(q)
        for hq in range(n_heads):
            g = hq * n_kv // n_heads
            s = q[hq] @ k[g].T / np.sqrt(dh) + mask
            e = np.exp(s - s.max(-1, keepdims=True))
            o[hq] = (e / e.sum(-1, keepdims=True)) @ v[g]
        heads = o.transpose(1, 0, 2).reshape(T, n_heads * dh)
        attn = heads @ f(p + "attention.wo.weight").T
        mid = x + attn
        u = norm(mid, f(p + "ffn_norm.weight"))
        gate = u @ f(p + "feed_forward.w1.weight").T
        mlp = ((gate / (1 + np.exp(-gate))) * (u @ f(p + "feed_forward.w3.weight").T)) @ f(
            p + "feed_forward.w2.weight").T
        out = mid + mlp
        layers.append({"layer_input": x, "attn_update": attn, "attn_heads": heads, "mid": mid, "mlp_update": mlp,
                       "layer_output": out, "keys": k, "values": v})
        x = out
    last = norm(x[-1:], f("norm.weight"))[0]
    return layers, last, f("output.weight") @ last


def _write_numpy_trace(path, samples, rope="rotate-half"):
    """Exactly as the Recorder docstring says: meta with model.args and engine.dtype, then per sample its
    inputs, per layer every state and the cache, then the final outputs."""
    from prefill_diff.dumps import Recorder
    from prefill_diff.engine.models.sources import load_snapshot
    from prefill_diff.engine.models.spec import ModelSpec
    snap = load_snapshot(ModelSpec())
    w = {k: v.numpy() for k, v in snap.state.items()}
    a = snap.args
    meta = {"model": {"args": {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                               "head_dim": a.head_dim, "vocab_size": a.vocab_size, "rope_theta": a.rope_theta,
                               "norm_eps": a.norm_eps}},
            "engine": {"name": "numpy-llama", "dtype": "float32"}}
    n_cols = max(len(s) for s in samples)
    runs = [_numpy_llama(w, a.rope_theta, a.norm_eps, a.n_heads, a.n_kv_heads, s, rope) for s in samples]
    with Recorder(path, level="full") as rec:
        rec.begin(samples=[list(s) for s in samples], n_cols=n_cols, meta=meta)
        for s, toks in enumerate(samples):
            n = len(toks)
            rec.inputs(s, 0, np.asarray(toks), np.ones(n), np.arange(n), np.arange(n))
        for layer in range(a.n_layers):
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output", "attn_heads"):
                for s in range(len(samples)):
                    rec.state(layer, name, s, 0, runs[s][0][layer][name])
            for s, toks in enumerate(samples):
                st = runs[s][0][layer]
                rec.cache(layer, s, st["keys"], st["values"], np.arange(len(toks)))
            rec.layer_done(layer)
        for s, toks in enumerate(samples):
            rec.final(s, runs[s][1], runs[s][2], column=len(toks) - 1, token_index=len(toks) - 1)


def test_an_outside_numpy_engine_writes_a_trace_that_compares(tmp_path, run_cli):
    ours = tmp_path / "ours.h5"
    assert run_cli("record", "reference", "-o", ours).exit_code == 0
    with Trace(ours) as t:
        samples = [list(s) for s in t.samples]
    good, wrong = tmp_path / "numpy.h5", tmp_path / "numpy-wrong-rope.h5"
    _write_numpy_trace(good, samples)
    _write_numpy_trace(wrong, samples, rope="interleaved")
    out = tmp_path / "r.json"
    res = run_cli("compare", ours, good, "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 4 and rep["policy"]["name"] == "float32"
    assert all(t["compared"] > 0 for row in rep["layers"] for t in row["tensors"].values())
    res = run_cli("compare", ours, wrong, "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1, rep["verdict_line"]
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"]) == (0, "cache_keys") and fb["position"] > 0, rep["verdict_line"]


def _tiny_meta(**engine):
    return {"model": {"args": {"dim": 4, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2,
                               "vocab_size": 8}}, "engine": {"dtype": "float32", **engine}}


@pytest.mark.parametrize("meta,words", [
    ({"engine": {"dtype": "float32"}}, "meta.model.args is required"),
    ({"model": {"args": {"dim": 4, "n_layers": 1, "n_heads": 2, "head_dim": 2, "vocab_size": 8}},
      "engine": {"dtype": "float32"}}, "meta.model.args.n_kv_heads is required"),
    ({"model": {"args": {"dim": 4, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2, "vocab_size": 8}}},
     "meta.engine.dtype is required"),
    (_tiny_meta(), None),
    ({**_tiny_meta(), "engine": {"dtype": "fp32"}}, "meta.engine.dtype must be one of"),
    ({**_tiny_meta(), "layout": {"key_rotation": "pre"}}, "meta.model.rope_inv_freq is required"),
    ({**_tiny_meta(), "record": [1]}, "meta.record must be a dict"),
])
def test_begin_refuses_missing_required_metadata(tmp_path, meta, words):
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.dumps.trace_file import RecorderError
    rec = Recorder(tmp_path / "t.h5")
    try:
        if words is None:
            rec.begin([[1, 2]], 2, meta)  # the minimal metadata is enough
        else:
            with pytest.raises(RecorderError, match=words.replace(".", r"\.")):
                rec.begin([[1, 2]], 2, meta)
    finally:
        rec.abort()


@pytest.mark.parametrize("when,meta,words", [
    ("begin", {**_tiny_meta(), "absent_states": {"layer_input": "x"}}, "meta.absent_states may name only"),
    ("begin", {**_tiny_meta(), "tolerance": {"base": "float8"}}, "meta.tolerance.base"),
    ("close", {"texts": ["a", "b", "c"]}, "meta.texts must hold one text per sample"),
    ("close", {"absent_states": {"attn_heads": "x"}}, "meta.absent_states may name only"),
])
def test_the_recorder_refuses_metadata_its_reader_would_refuse(tmp_path, when, meta, words):
    """The write side checks the read side's schema: nothing is left that looks like a trace."""
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.dumps.trace_file import RecorderError
    path = tmp_path / "t.h5"
    rec = Recorder(path)
    try:
        with pytest.raises(RecorderError, match=words.replace(".", r"\.")) as e:
            rec.begin([[1, 2]], 2, meta if when == "begin" else _tiny_meta())
            rec.inputs(0, 0, np.array([1, 2]), np.ones(2, bool), np.arange(2), np.arange(2))
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                rec.state(0, name, 0, 0, np.ones((2, 4), np.float32))
            rec.cache(0, 0, np.ones((1, 2, 2), np.float32), np.ones((1, 2, 2), np.float32), np.arange(2))
            rec.final(0, np.ones(4, np.float32), np.ones(8, np.float32), 1, 1)
            rec.update_meta(**meta)
            rec.close()
        assert "reader would refuse" in str(e.value)
    finally:
        rec.abort()
    assert not path.exists()


def test_wrong_shapes_are_refused_naming_the_expected_shape(tmp_path):
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.dumps.trace_file import RecorderError
    rec = Recorder(tmp_path / "t.h5")
    rec.begin([[1, 2, 3]], 3, _tiny_meta())
    try:
        with pytest.raises(RecorderError, match=r"layer 0 cache keys of sample 0 has shape \(3, 1, 2\), "
                                                r"expected \(1, 3, 2\)"):
            rec.cache(0, 0, np.zeros((3, 1, 2)), np.zeros((1, 3, 2)), np.arange(3))  # (T, H_kv, d_h): transposed
        with pytest.raises(RecorderError, match=r"layer 0 mid of sample 0 has shape \(3, 5\), expected \(T, 4\)"):
            rec.state(0, "mid", 0, 0, np.zeros((3, 5)))
        with pytest.raises(RecorderError, match=r"attn_heads of sample 0 has shape \(3, 2\), expected \(T, 4\)"):
            rec.state(0, "attn_heads", 0, 0, np.zeros((3, 2)))
        with pytest.raises(RecorderError, match="state name must be one of"):
            rec.state(0, "attention", 0, 0, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="layer 1 out of range"):
            rec.state(1, "mid", 0, 0, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="outside the 3 columns"):
            rec.state(0, "mid", 0, 1, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="outside the 3 columns"):
            rec.state(0, "mid", 0, -1, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="layer -1 out of range"):
            rec.state(-1, "mid", 0, 0, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="sample 1 out of range"):
            rec.state(0, "mid", 1, 0, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="sample -1 out of range"):
            rec.state(0, "mid", -1, 0, np.zeros((3, 4)))
        with pytest.raises(RecorderError, match="expected an array with one row per column"):
            rec.state(0, "mid", 0, 0, np.float32(1.0))
        with pytest.raises(RecorderError, match=r"final logits of sample 0 has shape \(7,\), expected \(8,\)"):
            rec.final(0, np.zeros(4), np.zeros(7), 2, 2)
        with pytest.raises(RecorderError, match="sample 1 out of range"):
            rec.final(1, np.zeros(4), np.zeros(8), 2, 2)
    finally:
        rec.abort()


def _tiny_trace(rec, finals=(0, 1), layers=True):
    rec.begin([[1, 2], [3]], 2, _tiny_meta())
    for s, n in ((0, 2), (1, 1)):
        rec.inputs(s, 0, np.arange(1, n + 1), np.ones(n), np.arange(n), np.arange(n))
        if layers:
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                rec.state(0, name, s, 0, np.ones((n, 4), dtype=np.float32))
            rec.cache(0, s, np.ones((1, n, 2)), np.ones((1, n, 2)), np.arange(n))
    if layers:
        rec.layer_done(0)
    for s in finals:
        rec.final(s, np.ones(4), np.arange(8.0), 0, 0)


def test_a_sample_without_final_is_refused_at_close_and_no_file_is_left(tmp_path):
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.dumps.trace_file import RecorderError
    path = tmp_path / "t.h5"
    with pytest.raises(RecorderError, match=r"final\(\) was never called for sample\(s\) \[1\]"):
        with Recorder(path) as rec:
            _tiny_trace(rec, finals=(0,))
    assert list(tmp_path.iterdir()) == []  # neither the trace nor a partial file
    with pytest.raises(RecorderError, match="layer 0 has no state 'layer_input'"):
        with Recorder(path) as rec:
            _tiny_trace(rec, layers=False)
    assert list(tmp_path.iterdir()) == []
    with Recorder(path) as rec:
        _tiny_trace(rec)
    with Trace(path) as t:
        assert t.final["written"].tolist() == [1, 1]


def test_reader_refuses_a_trace_with_an_unwritten_final_output(left_trace, tmp_path):
    import shutil
    _, path = left_trace
    bad = tmp_path / "bad.h5"
    shutil.copy(path, bad)
    with h5py.File(bad, "a") as f:
        f["final/written"][1] = 0
    with pytest.raises(TraceError, match=r"sample\(s\) \[1\] have no final output"):
        Trace(bad)


@pytest.mark.parametrize("call_layer_done", [True, False])
def test_sampled_values_and_cache_kept_per_layer_are_all_written(tmp_path, call_layer_done):
    """The recorder keeps a layer's sampled values and cache positions in memory and writes them once per layer
    (issue 18): what reaches the file is what was given, whether or not layer_done was called (close writes)."""
    rng = np.random.default_rng(1)
    args = {"dim": 6, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2, "vocab_size": 9}
    lengths, C = (4, 3), 4
    given = {}
    with Recorder(tmp_path / "s.h5", "sampled", sample_tokens=3, sample_channels=4) as rec:
        rec.begin([list(range(1, n + 1)) for n in lengths], C, {"model": {"args": args}, "engine": {"dtype": "float32"}})
        for s, n in enumerate(lengths):
            rec.inputs(s, 0, np.arange(1, n + 1), np.ones(n, bool), np.arange(n), np.arange(n))
        for layer in range(2):
            for s, n in enumerate(lengths):
                for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                    x = rng.standard_normal((n, 6)).astype(np.float32)
                    given[(layer, name, s)] = x
                    rec.state(layer, name, s, 0, x[:2])  # in two parts, as a chunked engine would
                    rec.state(layer, name, s, 2, x[2:])
                k, v = rng.standard_normal((2, 1, n, 2)).astype(np.float32)
                given[(layer, "cache_keys", s)] = k[0]
                rec.cache(layer, s, k, v, np.arange(n) + 10)
            if call_layer_done:
                rec.layer_done(layer)
        for s in range(2):
            rec.final(s, np.zeros(6, np.float32), np.arange(9, dtype=np.float32), lengths[s] - 1, lengths[s] - 1)
    with Trace(tmp_path / "s.h5") as t:
        toks = t.f["sampled/token_index"][:]
        for layer in range(2):
            v = t.layer(layer)
            assert v.cache_lengths.tolist() == list(lengths)
            for s, n in enumerate(lengths):
                assert v.cache_positions[s, :n].tolist() == list(range(10, 10 + n))
                assert (v.cache_positions[s, n:] == -1).all()
                for name in ("mid", "cache_keys"):
                    ds = v.sampled(name)
                    ch = ds.attrs["channels"]
                    for slot, tok in enumerate(toks[s]):
                        if tok >= 0:
                            np.testing.assert_array_equal(ds[s, slot], given[(layer, name, s)][tok][ch])
                        else:
                            assert np.isnan(ds[s, slot]).all()
