"""What a trace's layers keep in memory until the recorder flushes them (dumps/layer_store.py): the running statistics
and buffers it keeps per layer, and the datasets it writes from them, read back with h5py against values computed
here by hand; a layer written and reached again is rewritten whole, in place; every dataset it makes is one the
schema declares."""
from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from prefill_diff.dumps import schema as sc
from prefill_diff.dumps.h5write import LIBVER
from prefill_diff.dumps.layer_store import LayerBuffers, LayerStore
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.dumps.reductions import RunningStats
from prefill_diff.dumps.sampling import Sampled

S, C = 2, 4
NAN = math.nan


@pytest.fixture
def store(tmp_path):
    with h5py.File(tmp_path / "t.h5", "w", libver=LIBVER) as f:
        st = LayerStore(f)
        st.dims.update(S=S, C=C, stat=len(sc.STAT_COLUMNS))
        yield st


def _datasets(f: h5py.File) -> dict:
    """Every dataset in the file: its path -> the dataset."""
    out = {}
    f.visititems(lambda name, obj: out.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
    return out


def _declared(f: h5py.File, dims: dict) -> None:
    """Every dataset in ``f`` is an element of the schema, of its declared dtype kind and shape."""
    for path, ds in _datasets(f).items():
        found = sc.element_of(path)
        assert found is not None, f"{path} is not declared"
        el, _ = found
        assert el.problem(ds, dims) is None, (path, el.problem(ds, dims))


# -- what it keeps -----------------------------------------------------------------------------------------------------

def test_a_layers_statistics_are_kept_once_per_tensor_for_every_sample(store):
    st = store.stat(3, "mid")
    assert isinstance(st, RunningStats) and len(st.valid) == S and st.checksum == [0, 0]
    assert store.stat(3, "mid") is st and store.stat(3, "layer_output") is not st and store.stat(4, "mid") is not st
    assert store.dirty == {3, 4}
    assert store.n_samples == S


def test_a_layers_buffers_start_empty_and_are_kept(store):
    buf = store.buffers(1)
    assert buf == LayerBuffers() and buf.positions is None and buf.lengths is None and buf.heads == ()
    assert buf.tensors == {} and buf.sampled == {} and buf.routing == {} and buf.routing_source is None
    buf.heads = (2, 4)
    assert store.buffers(1) is buf and store.buffers(1).heads == (2, 4)
    assert store.dirty == {1}
    assert LayerBuffers().sampled is not LayerBuffers().sampled  # each layer its own tables


def test_a_layers_group_is_made_once_with_three_digits(store):
    g = store.group(7)
    assert g.name == "/layers/007" and store.group(7) == g
    store.group(12)
    assert sorted(store.f["layers"]) == ["007", "012"]


# -- statistics and checksums ------------------------------------------------------------------------------------------

def test_statistics_are_written_as_rows_of_the_stat_columns(store):
    st = store.stat(0, "mid")
    st.add(0, (3, 3, -1.0, 2.0, 3.0, 9.0, 5))  # count, finite, min, max, sum, sumsq, checksum
    st.add(0, (4, 2, 0, 0, 0, 0, 0), padding=True)
    store.write_layer(0)
    f = store.f
    rows = f["layers/000/stats/mid"]
    assert rows.dtype == np.float64 and rows.shape == (S, 8)
    assert np.array_equal(rows[...], [[3, 3, -1, 2, 1.0, 3.0, 4, 2],  # mean = 3/3, l2 = sqrt(9)
                                      [0, 0, NAN, NAN, NAN, NAN, 0, 0]], equal_nan=True)  # no valid cell
    sums = f["layers/000/checksums/mid"]
    assert sums.dtype == np.int64 and sums[...].tolist() == [5, 0]
    assert json.loads(f["layers/000/stats"].attrs["columns"]) == ["count", "finite", "min", "max", "mean", "l2",
                                                                   "pad_count", "pad_finite"]
    assert store.dirty == set()
    _declared(f, store.dims)


def test_a_layer_reached_again_is_rewritten_whole_in_place(store):
    store.stat(2, "layer_input").add(0, (2, 2, 1.0, 1.0, 2.0, 2.0, 7))
    store.write_layer(2)
    ds = store.f["layers/002/stats/layer_input"]
    before = h5py.h5o.get_info(ds.id).addr
    store.stat(2, "layer_input").add(1, (1, 1, -4.0, -4.0, -4.0, 16.0, -3))  # a later prefill call, sample 1
    store.stat(2, "layer_input").add(0, (2, 2, 3.0, 3.0, 6.0, 18.0, 1))  # and more of sample 0
    assert store.dirty == {2}
    store.write_layer(2)
    ds = store.f["layers/002/stats/layer_input"]
    assert h5py.h5o.get_info(ds.id).addr == before  # the same dataset
    assert ds[...].tolist() == [[4, 4, 1.0, 3.0, 2.0, math.sqrt(20), 0, 0], [1, 1, -4.0, -4.0, -4.0, 4.0, 0, 0]]
    assert store.f["layers/002/checksums/layer_input"][...].tolist() == [8, -3]
    assert list(store.f["layers/002"]) == ["checksums", "stats"]


def test_a_checksum_wraps_as_a_signed_64_bit_sum(store):
    st = store.stat(0, "mid")
    st.add(0, (1, 1, 0, 0, 0, 0, (1 << 63) - 1))
    st.add(0, (1, 1, 0, 0, 0, 0, 2))
    store.write_layer(0)
    assert store.f["layers/000/checksums/mid"][0] == -(1 << 63) + 1


def test_a_layer_with_nothing_kept_is_an_empty_group(store):
    store.write_layer(5)
    assert list(store.f["layers/005"]) == [] and _datasets(store.f) == {}


def test_every_dirty_layer_is_written_in_order(store, monkeypatch):
    for layer in (4, 0, 2):
        store.stat(layer, "mid").add(0, (1, 1, 1.0, 1.0, 1.0, 1.0, 1))
    written = []
    real = store.write_layer
    monkeypatch.setattr(store, "write_layer", lambda layer: written.append(layer) or real(layer))
    store.write_dirty()
    assert written == [0, 2, 4] and store.dirty == set()
    assert sorted(store.f["layers"]) == ["000", "002", "004"]
    store.write_dirty()
    assert written == [0, 2, 4], "nothing dirty, nothing written"


# -- the cache index ---------------------------------------------------------------------------------------------------

def test_cache_positions_and_lengths_are_written_with_the_heads(store):
    buf = store.buffers(0)
    buf.positions = np.array([[0, 1, 2], [0, 1, -1]], dtype=np.int64)
    buf.lengths = np.array([3, 2], dtype=np.int64)
    buf.heads = (2, 16)  # (n_kv_heads, head_dim)
    store.write_layer(0)
    cache = store.f["layers/000/cache"]
    assert cache["positions"][...].tolist() == [[0, 1, 2], [0, 1, -1]] and cache["lengths"][...].tolist() == [3, 2]
    assert cache.attrs["n_kv_heads"] == 2 and cache.attrs["head_dim"] == 16
    assert cache["positions"].chunks == (1, 3) and cache["positions"].maxshape == (S, None)
    _declared(store.f, {**store.dims, "T": 3})


def test_a_longer_cache_later_resizes_its_positions(store):
    buf = store.buffers(0)
    buf.positions, buf.lengths, buf.heads = np.array([[0, 1], [0, -1]]), np.array([2, 1]), (1, 4)
    store.write_layer(0)
    buf.positions = np.array([[0, 1, 2, 3], [0, 1, -1, -1]])  # what the recorder pads to on a longer call
    buf.lengths = np.array([4, 2])
    store.write_layer(0)
    cache = store.f["layers/000/cache"]
    assert cache["positions"][...].tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]
    assert cache["lengths"][...].tolist() == [4, 2]


def test_no_positions_no_cache_group(store):
    store.buffers(0).heads = (1, 4)
    store.write_layer(0)
    assert "cache" not in store.f["layers/000"]


def test_the_cache_index_goes_beside_the_full_levels_cache_tensors(store):
    """At the full level the recorder made cache/keys (and so the cache group) first: the index joins them."""
    keys = sc.CACHE.create(store.group(0), {**store.dims, "H": 1, "T": 2, "D": 4}, "keys", np.float32)
    buf = store.buffers(0)
    buf.tensors["keys"] = h5py.Dataset(keys)
    buf.positions, buf.lengths, buf.heads = np.array([[0, 1], [0, 1]]), np.array([2, 2]), (1, 4)
    store.write_layer(0)
    assert sorted(store.f["layers/000/cache"]) == ["keys", "lengths", "positions"]
    assert store.f["layers/000/cache"].attrs["n_kv_heads"] == 1


# -- sampled values, routing -------------------------------------------------------------------------------------------

def test_sampled_values_are_written_with_their_channels_width_and_source(store):
    store.dims["P"] = 3
    values = np.full((S, 3, 2), np.nan, dtype=np.float32)
    values[0, :2] = [[1.5, -2.0], [0.25, 4.0]]
    store.buffers(1).sampled["attn_update"] = Sampled(values, np.array([3, 17]), 64, "torch.bfloat16")
    store.write_layer(1)
    ds = store.f["layers/001/sampled/attn_update"]
    assert ds.dtype == np.float32 and ds.shape == (S, 3, 2)
    assert np.array_equal(ds[...], values, equal_nan=True)
    assert ds.attrs["channels"].tolist() == [3, 17] and ds.attrs["width"] == 64
    assert ds.attrs["source_dtype"] == b"torch.bfloat16"
    values[1, 0] = [9.0, 8.0]  # a later call's sample, in the same buffer
    store.write_layer(1)
    assert store.f["layers/001/sampled/attn_update"][1, 0].tolist() == [9.0, 8.0]
    _declared(store.f, {**store.dims, "K": 2})


def _routing(A=2, E=4, logits_dtype=np.float32):
    ids = np.full((S, C, A), -1, dtype=np.int64)
    ids[0, :2] = [[3, 1], [0, 2]]
    weights = np.full((S, C, A), np.nan)
    weights[0, :2] = [[0.75, 0.25], [0.5, 0.5]]
    margin, scale = np.full((S, C), np.nan), np.full((S, C), np.nan)
    margin[0, :2], scale[0, :2] = [0.5, 0.125], [1.0, 2.0]
    logits = np.full((S, C, E), np.nan, dtype=logits_dtype)
    logits[0, :2] = [[0, 1, 2, 3], [3, 2, 1, 0]]
    return {"ids": ids, "weights": weights, "margin": margin, "scale": scale, "logits": logits}


def test_routing_is_written_with_the_router_logits_source(store):
    store.dims.update(A=2, E=4)
    buf = store.buffers(0)
    buf.routing = _routing()
    buf.routing_source = "torch.bfloat16"
    store.write_layer(0)
    r = store.f["layers/000/routing"]
    assert sorted(r) == ["ids", "logits", "margin", "scale", "weights"]
    for name, want in _routing().items():
        assert r[name].dtype == want.dtype and np.array_equal(r[name][...], want, equal_nan=True), name
    assert r["logits"].attrs["source_dtype"] == b"torch.bfloat16"
    assert "source_dtype" not in r["ids"].attrs
    buf.routing["ids"][1, 0] = [2, 3]
    store.write_layer(0)
    assert r["ids"][1, 0].tolist() == [2, 3]
    _declared(store.f, store.dims)


def test_router_logits_without_a_source_name_their_own_dtype(store):
    store.dims.update(A=2, E=4)
    store.buffers(0).routing = _routing(logits_dtype=np.float64)
    store.write_layer(0)
    assert store.f["layers/000/routing/logits"].attrs["source_dtype"] == b"float64"


def test_routing_without_logits_at_the_sampled_level(store):
    store.dims.update(A=2, E=4)
    r = _routing()
    del r["logits"]
    store.buffers(0).routing = r
    store.write_layer(0)
    assert sorted(store.f["layers/000/routing"]) == ["ids", "margin", "scale", "weights"]


# -- root datasets -----------------------------------------------------------------------------------------------------

def test_root_datasets_are_made_once_and_rewritten_in_place(store):
    store.dims.update(dim=3)
    ids = np.array([[5, 6, 0, 0], [7, 0, 0, 0]])
    store.root_dataset(sc.INPUTS["input_ids"], ids)
    store.root_dataset(sc.INPUTS["valid_mask"], (ids > 0).astype(np.uint8))
    h = np.arange(6, dtype=np.float32).reshape(S, 3)
    store.root_dataset(sc.FINAL["norm_last"], h, "torch.float16")
    f = store.f
    assert f["inputs/input_ids"].dtype == np.int64 and f["inputs/input_ids"][...].tolist() == ids.tolist()
    assert f["inputs/valid_mask"].dtype == np.uint8 and f["inputs/valid_mask"][...].sum() == 3
    assert f["final/norm_last"].dtype == np.float32 and f["final/norm_last"].attrs["source_dtype"] == b"torch.float16"
    assert "source_dtype" not in f["inputs/input_ids"].attrs
    ids[1, 1] = 8
    store.root_dataset(sc.INPUTS["input_ids"], ids)
    assert f["inputs/input_ids"][1].tolist() == [7, 8, 0, 0]
    assert sorted(f["inputs"]) == ["input_ids", "valid_mask"]
    _declared(f, store.dims)


def test_a_root_dataset_of_the_wrong_shape_is_refused(store):
    with pytest.raises(ValueError, match=r"input_ids holds shape \(2, 3\), the format says \(2, 4\)"):
        store.root_dataset(sc.INPUTS["input_ids"], np.zeros((2, 3), dtype=np.int64))


# -- through the recorder ----------------------------------------------------------------------------------------------

META = {"model": {"args": {"dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "vocab_size": 16}},
        "engine": {"dtype": "float32"}}


def _checksum(x: np.ndarray) -> int:
    """The wrapped int64 sum of each row's 8-byte words (rows of 8 float32 are 32 bytes: whole words)."""
    total = sum(int(w) for w in np.ascontiguousarray(x).view(np.int64).ravel())
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)


def test_a_recorders_states_reach_the_file_through_the_store():
    """Statistics of a state the recorder is handed, computed by hand; the layer reached again by a later call (sample
    1) keeps sample 0's statistics."""
    rec = Recorder(None, "stats")
    try:
        rec.begin([[1, 2, 3], [4, 5, 6]], 3, META)
        ones, cols = np.ones(3, dtype=bool), np.arange(3)
        rec.inputs(0, 0, np.array([1, 2, 3]), ones, cols, cols)
        x = (np.arange(24, dtype=np.float32) - 10).reshape(3, 8)  # -10 .. 13
        rec.state(1, "mid", 0, 0, x)
        rec.layer_done(1)
        f = rec.written()
        row = f["layers/001/stats/mid"][0]
        assert row.tolist() == [24, 24, -10, 13, 36 / 24, math.sqrt(1204), 0, 0]  # 1204 = 1²+..+10² + 1²+..+13²
        assert f["layers/001/checksums/mid"][0] == _checksum(x)
        rec.inputs(1, 0, np.array([4, 5, 6]), ones, cols, cols)
        rec.state(1, "mid", 1, 0, 2 * x)
        rec.layer_done(1)
        f = rec.written()
        rows = f["layers/001/stats/mid"][...]
        assert rows[0].tolist() == [24, 24, -10, 13, 36 / 24, math.sqrt(1204), 0, 0]
        assert rows[1].tolist() == [24, 24, -20, 26, 72 / 24, math.sqrt(4 * 1204), 0, 0]
        assert rec.store.layers == {} and set(rec.store.stats) == {1}
    finally:
        rec.abort()
