"""dumps/chunks.py: rows read straight from the file equal h5py's reads, and every file or dataset that is
not plainly ours (compressed, crafted chunk index, big-endian, virtual, open for writing) goes to h5py."""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.chunks import ChunkReader, Refused, RowPlan
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.dumps.rows import read_ahead
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.verify.report import compare_traces

S, C, W, H, D, L = 3, 12, 16, 2, 4, 2
STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")


def record(path, level="full", compression=None, noise=0.0, seed=0):
    """A small trace through the public Recorder, random values (each row differs from every other)."""
    rng = np.random.default_rng(seed)
    meta = {"model": {"args": {"dim": W, "n_layers": L, "n_heads": H, "n_kv_heads": H, "head_dim": D,
                               "vocab_size": 32}}, "engine": {"dtype": "float32"}}
    with Recorder(path, level, force=True, compression=compression, sample_tokens=4, sample_channels=8) as rec:
        rec.begin([list(range(1, C + 1))] * S, C, meta)
        for s in range(S):
            rec.inputs(s, 0, np.arange(1, C + 1), np.ones(C), np.arange(C), np.arange(C))
        for layer in range(L):
            for name in STATES:
                for s in range(S):
                    x = np.random.default_rng(1000 * layer + 10 * s + STATES.index(name)).standard_normal(
                        (C, W), dtype=np.float32)
                    rec.state(layer, name, s, 0, x + noise * rng.standard_normal((C, W), dtype=np.float32))
            for s in range(S):
                kv = np.random.default_rng(7 + layer * S + s).standard_normal((H, C, D), dtype=np.float32)
                rec.cache(layer, s, kv, kv + 1, np.arange(C))
            rec.layer_done(layer)
        for s in range(S):
            rec.final(s, np.ones(W, np.float32), np.arange(32, dtype=np.float32), C - 1, C - 1)
    return path


def row_datasets(f: h5py.File, min_ndim: int = 3):
    out = []
    f.visititems(lambda n, o: out.append(o) if isinstance(o, h5py.Dataset) and o.ndim >= min_ndim else None)
    return out


def assert_rows_read_directly(t: Trace, datasets, layout):
    """Every row of every dataset: a direct read, byte-for-byte equal to h5py's read."""
    assert datasets
    for ds in datasets:
        plan = t._chunks.plan(ds)
        assert isinstance(plan, RowPlan), (ds.name, plan)
        assert (ds.chunks is None) == (layout == "contiguous"), ds.name
        for i in range(ds.shape[0]):
            buf = np.full(ds.shape[1:], np.nan, dtype=ds.dtype)
            assert t._chunks.read_row(ds, i, buf)
            assert buf.tobytes() == ds[i].tobytes(), (ds.name, i)
            assert t.read_row(ds, i, "x").tobytes() == ds[i].tobytes()


def test_full_trace_rows_read_directly_equal_h5py(tmp_path):
    with Trace(record(tmp_path / "full.h5")) as t:
        assert t._chunks.refusal is None
        states = [ds for ds in row_datasets(t.f) if "/cache/" not in ds.name]
        caches = [ds for ds in row_datasets(t.f) if "/cache/" in ds.name]
        assert len(states) == L * len(STATES) and len(caches) == 2 * L
        assert_rows_read_directly(t, states + caches, "chunked")
        # a row index h5py would refuse is not read directly either
        assert not t._chunks.read_row(states[0], S, np.empty(states[0].shape[1:], np.float32))


def test_sampled_trace_rows_read_directly_equal_h5py(tmp_path):
    """The sampled level keeps its (sample, slot, channel) values contiguous: offsets from get_offset()."""
    with Trace(record(tmp_path / "sampled.h5", level="sampled")) as t:
        sampled = [ds for ds in row_datasets(t.f) if "/sampled/" in ds.name]
        assert len(sampled) == L * (len(STATES) + 2)
        assert_rows_read_directly(t, sampled, "contiguous")


def test_compare_with_direct_reads_equals_compare_through_h5py(tmp_path, monkeypatch):
    ref, cand = record(tmp_path / "ref.h5"), record(tmp_path / "cand.h5", noise=1e-3)

    def run():
        with Trace(ref) as a, Trace(cand) as b:
            rep = compare_traces(a, b)
            return bool(rep), [(t.tensor, t.max_abs, t.max_rel, t.n_bad, t.cosine) for lr in rep.layers
                               for t in lr.tensors]

    from prefill_diff.dumps import chunks
    views, real_view = [], ChunkReader.view
    monkeypatch.setattr(ChunkReader, "view", lambda self, plan, i: (views.append(i), real_view(self, plan, i))[1])
    mapped = run()
    assert len(views) > 0  # the first run really read mapped rows
    monkeypatch.setattr(chunks, "MMAP", False)
    direct = run()
    monkeypatch.setattr(ChunkReader, "read_row", lambda self, ds, index, buf: False)
    assert mapped == direct == run()
    assert not direct[0] and any(n_bad for _, _, _, n_bad, _ in direct[1])  # the noise breaks tolerance


def test_gzip_trace_is_read_by_h5py(tmp_path):
    with Trace(record(tmp_path / "gz.h5", compression="gzip")) as t:
        ds = t.layer(0).state("mid")
        plan = t._chunks.plan(ds)
        assert isinstance(plan, Refused) and "filters" in plan.reason
        assert not t._chunks.read_row(ds, 1, np.empty(ds.shape[1:], ds.dtype))
        assert np.array_equal(t.read_row(ds, 1, "x"), ds[1])


def _patch_chunk_entry(path, ds_name: str, row: int, address: int | None = None, size: int | None = None):
    """Rewrite one row's entry in the dataset's chunk index (a v1 B-tree, no checksum: the recorder writes
    HDF5 1.8 format): its chunk address and/or stored size. The entry is found by its address, which must
    appear once in the file; the key before it is size (4 bytes), filter mask (4), rank + 1 coordinates (8 each)."""
    with h5py.File(path, "r") as f:
        ds = f[ds_name]
        info = ds.id.get_chunk_info_by_coord((row,) + (0,) * (ds.ndim - 1))
        key_bytes = 8 + 8 * (ds.ndim + 1)
    data = bytearray(open(path, "rb").read())
    old = info.byte_offset.to_bytes(8, "little")
    assert data.count(old) == 1, "the chunk address must appear once in the file (the v1 B-tree entry)"
    at = data.index(old)
    assert int.from_bytes(data[at - key_bytes:at - key_bytes + 4], "little") == info.size
    if address is not None:
        data[at:at + 8] = address.to_bytes(8, "little")
    if size is not None:
        data[at - key_bytes:at - key_bytes + 4] = size.to_bytes(4, "little")
    open(path, "wb").write(bytes(data))


def test_chunk_offset_past_end_of_file_is_never_read(tmp_path, monkeypatch):
    """A crafted chunk index points one row past the end of the file: no direct read goes there, h5py's read
    fails, and the comparison reports a damaged trace."""
    good = record(tmp_path / "good.h5")
    bad = tmp_path / "bad.h5"
    shutil.copy(good, bad)
    name = "layers/001/mid"
    _patch_chunk_entry(bad, name, 1, address=os.path.getsize(bad) + 4096)
    size = os.path.getsize(bad)
    reads = []
    real = os.preadv

    def spy(fd, buffers, offset, *flags):
        n = sum(memoryview(b).nbytes for b in buffers)
        reads.append((os.fstat(fd).st_size, offset, n))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    with Trace(bad) as t:
        ds = t.f[name]
        plan = t._chunks.plan(ds)
        assert isinstance(plan, Refused) and "outside the file" in plan.reason, plan
        assert not t._chunks.read_row(ds, 0, np.empty(ds.shape[1:], ds.dtype))  # the whole dataset refused
        with pytest.raises(TraceError, match="cannot read"):
            t.read_row(ds, 1, "x")
        other = t.f["layers/000/mid"]  # the rest of the file is still read directly
        assert isinstance(t._chunks.plan(other), RowPlan)
    with Trace(good) as a, Trace(bad) as b, pytest.raises(TraceError):
        compare_traces(a, b)
    assert reads and all(offset + n <= file_size for file_size, offset, n in reads)
    assert any(file_size == size for file_size, _, _ in reads)  # the crafted file was read directly, inside


def test_chunk_index_pointing_inside_the_file_reads_what_h5py_reads(tmp_path):
    """An address moved onto another row's bytes (inside the file) is not refused, but it is read exactly as
    HDF5 reads it: direct and h5py reads agree, so the comparison sees the same (wrong) values either way."""
    path = tmp_path / "moved.h5"
    shutil.copy(record(tmp_path / "good.h5"), path)
    with h5py.File(path, "r") as f:
        target = f["layers/001/mid"].id.get_chunk_info_by_coord((0, 0, 0)).byte_offset
    _patch_chunk_entry(path, "layers/001/mid", 2, address=target)
    with Trace(path) as t:
        ds = t.f["layers/001/mid"]
        buf = np.empty(ds.shape[1:], ds.dtype)
        assert t._chunks.read_row(ds, 2, buf)
        assert buf.tobytes() == ds[2].tobytes() == ds[0].tobytes()


def test_chunk_of_the_wrong_stored_size_is_read_by_h5py(tmp_path):
    path = tmp_path / "size.h5"
    shutil.copy(record(tmp_path / "good.h5"), path)
    _patch_chunk_entry(path, "layers/000/mlp_update", 1, size=C * W * 4 - 4)
    with Trace(path) as t:
        ds = t.f["layers/000/mlp_update"]
        plan = t._chunks.plan(ds)
        assert isinstance(plan, Refused) and f"stored as {C * W * 4 - 4} bytes" in plan.reason, plan
        assert not t._chunks.read_row(ds, 0, np.empty(ds.shape[1:], ds.dtype))


def test_addresses_hdf5_reads_differently_refuse_the_whole_file(tmp_path, monkeypatch):
    """The probe: if this module and HDF5 disagreed on what a chunk address means (HDF5 before 1.14.4 left
    the user block out of it), the first row read both ways differs and nothing of the file is read directly."""
    from prefill_diff.dumps import chunks
    real = chunks._row_offsets
    monkeypatch.setattr(chunks, "_row_offsets", lambda ds, n, size: tuple(o - 64 for o in real(ds, n, size)))
    with Trace(record(tmp_path / "t.h5")) as t:
        ds = t.layer(0).state("mid")
        plan = t._chunks.plan(ds)
        assert isinstance(plan, Refused) and "differs" in plan.reason
        assert t._chunks.refusal and isinstance(t._chunks.plan(t.layer(1).state("mid")), Refused)
        assert np.array_equal(t.read_row(ds, 1, "x"), ds[1])


def test_big_endian_dataset_is_read_by_h5py(tmp_path):
    path = record(tmp_path / "be.h5")
    with h5py.File(path, "r+") as f:
        name = "layers/000/attn_update"
        x = f[name][()]
        attrs = dict(f[name].attrs)
        del f[name]
        ds = f.create_dataset(name, data=x.astype(">f4"), chunks=(1, C, W))
        ds.attrs.update(attrs)
    with Trace(path) as t:
        ds = t.layer(0).state("attn_update")
        assert ds.dtype == np.dtype(">f4")
        plan = t._chunks.plan(ds)
        assert isinstance(plan, Refused) and "little-endian" in plan.reason
        assert not t._chunks.read_row(ds, 1, np.empty(ds.shape[1:], ds.dtype))
        assert np.array_equal(t.read_row(ds, 1, "x"), x[1])
        assert isinstance(t._chunks.plan(t.layer(0).state("mid")), RowPlan)


def test_chunks_that_are_not_one_row_are_read_by_h5py(tmp_path):
    path = record(tmp_path / "split.h5")
    with h5py.File(path, "r+") as f:
        x = f["layers/000/mid"][()]
        del f["layers/000/mid"]
        f.create_dataset("layers/000/mid", data=x, chunks=(1, C // 2, W))
    with Trace(path) as t:
        ds = t.layer(0).state("mid")
        assert isinstance(t._chunks.plan(ds), Refused)
        assert np.array_equal(t.read_row(ds, 2, "x"), x[2])


def test_virtual_views_writable_files_and_user_blocks_are_read_by_h5py(tmp_path):
    path = record(tmp_path / "t.h5")

    class View(Trace):  # as dumps.rank_merge.RankTrace: a logical view the tool built itself
        _built_here = True

    with View(path) as t:
        assert t._chunks.refusal == "a view built over rank files"
        ds = t.layer(0).state("mid")
        assert np.array_equal(t.read_row(ds, 1, "x"), ds[1])
    layout = h5py.VirtualLayout(shape=(S, C, W), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(path), "layers/000/mid", shape=(S, C, W))
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_virtual_dataset("v", layout)
    with h5py.File(tmp_path / "v.h5", "r") as f:
        plan = ChunkReader(f).plan(f["v"])
        assert isinstance(plan, Refused) and "neither chunked nor contiguous" in plan.reason
    with h5py.File(path, "r+") as f:
        assert "writing" in ChunkReader(f).refusal
    with h5py.File(tmp_path / "ub.h5", "w", userblock_size=512) as f:
        f.create_dataset("x", data=np.ones((2, 3, 4), np.float32), chunks=(1, 3, 4))
    with h5py.File(tmp_path / "ub.h5", "r") as f:
        assert "user block" in ChunkReader(f).refusal
        assert not ChunkReader(f).read_row(f["x"], 0, np.empty((3, 4), np.float32))


def test_a_file_shorter_than_its_plan_falls_back(tmp_path):
    """If the file shrinks after the plan was made, the short read is not used: h5py reads (and fails)."""
    path = record(tmp_path / "t.h5")
    with h5py.File(path, "r") as f:
        r = ChunkReader(f)
        ds = f["layers/001/layer_output"]
        assert isinstance(r.plan(ds), RowPlan)
        os.truncate(path, r.plan(ds).offsets[S - 1] + 8)
        assert not r.read_row(ds, S - 1, np.empty(ds.shape[1:], ds.dtype))


# -- read-ahead: the next row pair is read on a background thread while this one is compared ----------------

@pytest.fixture(autouse=False)
def ahead_always(monkeypatch):
    """Rows read into buffers (the file not mapped, as for a compressed trace), ahead on the background thread
    although the test traces' rows are small."""
    from prefill_diff.dumps import chunks, rows
    monkeypatch.setattr(rows, "AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(chunks, "MMAP", False)


@pytest.mark.parametrize("threshold", [0, 1 << 40])
def test_read_ahead_yields_every_step_in_order_with_its_rows(tmp_path, monkeypatch, threshold):
    from prefill_diff.dumps import chunks, rows as row_reading
    monkeypatch.setattr(chunks, "MMAP", False)  # rows read into buffers (mapped rows: the tests below)
    monkeypatch.setattr(row_reading, "AHEAD_MIN_BYTES", threshold)  # read ahead, or each step on this thread
    a, b = record(tmp_path / "a.h5"), record(tmp_path / "b.h5", noise=1.0, seed=5)
    steps = [(0, 2, 1), (1, 1, 1), (2, 0, 0), (1, 2, 2), (1, 1, 0)]  # repeated and crossed rows
    with Trace(a) as ta, Trace(b) as tb:
        rd, cd, kd = ta.layer(1).state("mid"), tb.layer(1).state("mid"), tb.layer(0).cache("keys")
        sources = [(ta, rd), (tb, cd), (tb, kd)]
        seen = []
        for k, rows in enumerate(read_ahead(sources, steps)):
            assert len(rows) == 3
            for (_, ds), i, row in zip(sources, steps[k], rows):
                assert row.tobytes() == ds[i].tobytes()
            seen.append(tuple(r.ctypes.data for r in rows))
        assert len(seen) == len(steps)
        assert seen[0] != seen[1] and seen[0] == seen[2]  # two alternating buffers: a step lives until the next
        assert list(read_ahead(sources, [])) == []


def test_read_ahead_raises_a_damaged_row_when_its_pair_is_reached(tmp_path, monkeypatch, ahead_always):
    a = record(tmp_path / "a.h5")
    with Trace(a) as ta, Trace(a) as tb:
        rd = ta.layer(0).state("mid")
        real = Trace.read_row_into

        def damaged(self, ds, index, buf):
            if self is tb and index == 2:
                raise TraceError("b.h5: cannot read row 2 (corrupt data)")
            return real(self, ds, index, buf)

        monkeypatch.setattr(Trace, "read_row_into", damaged)
        got = []
        with pytest.raises(TraceError, match="row 2"):
            for rows in read_ahead([(ta, rd), (tb, rd)], [(0, 0), (1, 1), (2, 2)]):
                got.append(int(np.flatnonzero((rd[:] == rows[0]).all(axis=(1, 2)))[0]))
        assert got == [0, 1]  # the pairs before the damaged one were compared


@pytest.mark.slow
def test_read_ahead_closed_early_waits_for_the_read_in_flight(tmp_path, monkeypatch, ahead_always):
    """A comparison that stops early (first break, fail-fast, an error) may close the traces next: the read
    ahead of it must be over by then."""
    import threading
    import time
    a = record(tmp_path / "a.h5")
    started, done, real = threading.Event(), threading.Event(), Trace.read_row_into

    def slow(self, ds, index, buf):
        if index == 1:
            started.set()
            time.sleep(0.3)
            out = real(self, ds, index, buf)
            done.set()
            return out
        return real(self, ds, index, buf)

    with Trace(a) as ta:
        rd = ta.layer(0).state("mid")
        monkeypatch.setattr(Trace, "read_row_into", slow)
        gen = read_ahead([(ta, rd), (ta, rd)], [(0, 0), (1, 1), (2, 2)])
        next(gen)  # pair 0 is here; pair 1 is being read
        assert started.wait(10)
        gen.close()
        assert done.is_set()


def test_a_forked_child_reads_ahead_with_its_own_thread(tmp_path, ahead_always):
    """The parent's read-ahead thread does not exist in a forked child: the child must get its own, not queue
    work that no thread runs (a hang)."""
    import multiprocessing
    a = record(tmp_path / "a.h5")
    with Trace(a) as t:  # the parent uses its thread first
        rd = t.layer(0).state("mid")
        assert len(list(read_ahead([(t, rd)], [(0,), (1,)]))) == 2
    child = multiprocessing.get_context("fork").Process(target=_child_work, args=(str(a),))
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0


def _child_work(path: str) -> None:
    from prefill_diff.dumps import rows
    rows.AHEAD_MIN_BYTES = 0
    with Trace(path) as t:
        rd = t.layer(0).state("mid")
        rows = [r[0].copy() for r in read_ahead([(t, rd)], [(0,), (1,), (2,)])]
        assert all(r.tobytes() == rd[i].tobytes() for i, r in enumerate(rows))


# -- mapped rows: views of the page cache, no copy ------------------------------------------------------------

def test_mapped_rows_are_read_only_views_equal_to_h5py(tmp_path, monkeypatch):
    """Views equal h5py's reads; each step's pages are released from the process (done_with) once the next step
    is asked for, and a released view still reads the same bytes."""
    a, b = record(tmp_path / "a.h5"), record(tmp_path / "b.h5", noise=1.0, seed=5)
    steps = [(0, 2, 1), (1, 1, 1), (2, 0, 0), (1, 2, 2), (1, 1, 0)]
    released, real_done = [], ChunkReader.done_with
    monkeypatch.setattr(ChunkReader, "done_with", lambda self, plan, i: (released.append(i), real_done(self, plan, i)))
    with Trace(a) as ta, Trace(b) as tb:
        rd, cd, kd = ta.layer(1).state("mid"), tb.layer(1).state("mid"), tb.layer(0).cache("keys")
        sources = [(ta, rd), (tb, cd), (tb, kd)]
        assert all(t.mapped_rows(ds) is not None for t, ds in sources)
        kept = []
        for k, rows in enumerate(read_ahead(sources, steps)):
            for (_, ds), i, row in zip(sources, steps[k], rows):
                assert row.tobytes() == ds[i].tobytes() and row.shape == ds.shape[1:] and row.dtype == ds.dtype
                assert not row.flags.writeable  # the trace cannot be changed through a row
            kept.append(rows)
            assert released == [i for st in steps[:k] for i in st]  # the steps before this one
        assert released == [i for st in steps for i in st]
        assert kept[0][0].tobytes() == rd[0].tobytes()  # a view outlives its step and its release
    # the traces are closed while views of them are alive: the mapping stays until the last view goes
    assert kept[2][0].tobytes() == h5py.File(a, "r")["layers/001/mid"][2].tobytes()


def test_mapped_file_cut_short_raises_instead_of_reading_past_its_end(tmp_path):
    """Another program truncates the trace during the comparison: the next row's view is refused with a
    TraceError (touching pages past the end of a mapped file would stop the process with SIGBUS)."""
    path = record(tmp_path / "t.h5")
    with Trace(path) as t:
        ds = t.layer(1).state("layer_output")
        view, _, _ = t.mapped_rows(ds)
        assert view(0).tobytes() == ds[0].tobytes()
        plan = t._chunks.plan(ds)
        os.truncate(path, plan.offsets[S - 1] + 8)
        with pytest.raises(TraceError, match="changed while read"):
            view(S - 1)


def test_compressed_or_unmappable_rows_are_read_into_buffers(tmp_path, monkeypatch):
    from prefill_diff.dumps import chunks
    z = record(tmp_path / "z.h5", compression="gzip")
    with Trace(z) as t:
        ds = t.layer(0).state("mid")
        assert t.mapped_rows(ds) is None
        rows = [r[0].copy() for r in read_ahead([(t, ds)], [(0,), (2,)])]
        assert rows[1].tobytes() == ds[2].tobytes()
    plain = record(tmp_path / "p.h5")
    monkeypatch.setattr(chunks.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("cannot map")))
    with Trace(plain) as t:
        ds = t.layer(0).state("mid")
        assert t.mapped_rows(ds) is None  # a file system that cannot map: read with system calls
        assert next(iter(read_ahead([(t, ds)], [(1,)])))[0].tobytes() == ds[1].tobytes()


def test_mapping_is_turned_off_by_environment(tmp_path):
    import subprocess
    import sys
    path = record(tmp_path / "t.h5")
    code = ("import sys; from prefill_diff.dumps import chunks; from prefill_diff.dumps.reader import Trace\n"
            "t = Trace(sys.argv[1]); print(chunks.MMAP, t.mapped_rows(t.layer(0).state('mid')))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], env={**os.environ, "PREFILL_DIFF_MMAP": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]
