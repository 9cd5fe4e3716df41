"""HDF5 objects made through h5py's low-level API (dumps/h5write.py): what they make is read back by h5py's high-level
API, and compared with what h5py's own create_dataset, create_group and attrs make from the same arguments (its
creation property list, filters, fill value and types); the file's format is read from its bytes."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.h5write import LIBVER, new_attr, new_dataset, new_group, text_attr


@pytest.fixture
def f(tmp_path):
    with h5py.File(tmp_path / "t.h5", "w", libver=LIBVER) as h:
        yield h


def _plist(ds: h5py.Dataset) -> dict:
    """What a dataset was created with, as HDF5 reports it."""
    p = ds.id.get_create_plist()
    fill = np.zeros((), ds.dtype)
    p.get_fill_value(fill)
    chunked = p.get_layout() == h5py.h5d.CHUNKED
    return {"layout": p.get_layout(), "chunk": p.get_chunk() if chunked else None,
            "filters": [p.get_filter(i) for i in range(p.get_nfilters())], "fill": fill.tobytes(),
            "fill_defined": p.fill_value_defined(), "fill_time": p.get_fill_time(), "alloc": p.get_alloc_time(),
            "track_times": p.get_obj_track_times(), "attr_order": p.get_attr_creation_order(),
            "shape": ds.shape, "maxshape": ds.maxshape}


# -- new_dataset -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.uint8, np.int8, np.int32])
def test_a_dataset_holds_its_data_with_its_dtype_and_shape(f, dtype):
    data = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    dsid = new_dataset(f, "x", (2, 3, 4), dtype, data)
    assert isinstance(dsid, h5py.h5d.DatasetID)
    ds = f["x"]
    assert ds.dtype == np.dtype(dtype) and ds.shape == (2, 3, 4)
    assert np.array_equal(ds[...], data)
    assert ds.chunks is None and ds.compression is None and not ds.shuffle  # contiguous unless told


def test_a_dataset_with_gzip_is_shuffled_and_deflated_at_level_1(f):
    data = np.linspace(0, 1, 60, dtype=np.float32).reshape(3, 4, 5)
    new_dataset(f, "z", (3, 4, 5), np.float32, data, chunks=(1, 4, 5), gzip=True)
    ds = f["z"]
    assert ds.compression == "gzip" and ds.compression_opts == 1 and ds.shuffle and ds.chunks == (1, 4, 5)
    assert [flt[0] for flt in _plist(ds)["filters"]] == [h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE]
    assert np.array_equal(ds[...], data)


@pytest.mark.parametrize("dtype, fill", [(np.float32, np.nan), (np.float64, np.nan), (np.int64, -1), (np.uint8, 0),
                                         (np.int64, 0)])
def test_cells_never_written_read_as_the_fill_value(f, dtype, fill):
    new_dataset(f, "g", (2, 3), dtype, fill=fill)
    got = f["g"][...]
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(got, np.full((2, 3), fill, dtype=dtype), equal_nan=True)
    assert np.array_equal(f["g"].fillvalue, np.array(fill, dtype=dtype), equal_nan=True)


def test_a_resizable_dataset_grows_along_its_unlimited_axis(f):
    new_dataset(f, "p", (2, 3), np.int64, np.arange(6).reshape(2, 3), fill=-1, chunks=(1, 3), maxshape=(2, None))
    ds = f["p"]
    assert ds.maxshape == (2, None) and ds.chunks == (1, 3)
    ds.resize((2, 5))
    assert ds[...].tolist() == [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]]


def test_groups_on_the_way_are_made(f):
    new_dataset(f, "layers/000/stats/mid", (1, 8), np.float64, np.ones((1, 8)))
    assert isinstance(f["layers"], h5py.Group) and isinstance(f["layers/000/stats"], h5py.Group)
    assert f["layers/000/stats/mid"][...].sum() == 8


def test_a_group_is_given_as_an_h5py_group_or_its_low_level_id(f):
    g = f.create_group("g")
    new_dataset(g, "a", (2,), np.int64, np.array([1, 2]))
    new_dataset(g.id, "b", (2,), np.int64, np.array([3, 4]))
    assert f["g/a"][...].tolist() == [1, 2] and f["g/b"][...].tolist() == [3, 4]


@pytest.mark.parametrize("kw", [{}, {"fill": np.nan, "chunks": (1, 3), "maxshape": (2, None), "gzip": True},
                                {"fill": -1}, {"chunks": (2, 3)}, {"fill": 0, "chunks": (1, 3), "gzip": True}])
def test_a_dataset_is_what_h5pys_create_dataset_makes(f, kw):
    dtype = np.float32 if kw.get("fill") is np.nan or "fill" not in kw else np.int64
    new_dataset(f, "low", (2, 3), dtype, **kw)
    high = {"fillvalue": kw.get("fill"), "chunks": kw.get("chunks"), "maxshape": kw.get("maxshape")}
    if kw.get("gzip"):
        high.update(compression="gzip", compression_opts=1, shuffle=True)
    f.create_dataset("high", (2, 3), dtype, **high)
    assert _plist(f["low"]) == _plist(f["high"])
    assert f["low"].id.get_type() == f["high"].id.get_type()


def test_a_dataset_carries_no_time_stamps(f):
    """No time stamps: the same trace recorded twice is the same bytes (an object made with them has a time)."""
    new_dataset(f, "t", (2,), np.int64, np.array([1, 2]))
    info = h5py.h5o.get_info(f["t"].id)
    assert info.ctime == info.mtime == 0 and not f["t"].id.get_create_plist().get_obj_track_times()
    f.create_dataset("stamped", (2,), np.int64, track_times=True)
    assert h5py.h5o.get_info(f["stamped"].id).ctime > 0


def test_data_of_another_shape_is_refused_before_anything_is_made(f):
    with pytest.raises(ValueError, match=r"^internal: stats/mid holds shape \(2, 8\), the format says \(3, 8\)$"):
        new_dataset(f, "stats/mid", (3, 8), np.float64, np.zeros((2, 8)))
    assert "stats" not in f


def test_a_dataset_cannot_be_made_twice(f):
    new_dataset(f, "x", (1,), np.int64)
    with pytest.raises(ValueError, match=r"already exists"):
        new_dataset(f, "x", (1,), np.int64)


def test_the_same_kind_is_made_right_in_two_files(tmp_path):
    """The creation properties are made once per kind and reused: a second file gets the same dataset."""
    for name in ("a.h5", "b.h5"):
        with h5py.File(tmp_path / name, "w", libver=LIBVER) as h:
            new_dataset(h, "x", (2, 2), np.float32, np.eye(2, dtype=np.float32), fill=np.nan, chunks=(1, 2),
                        gzip=True)
            assert h5py.h5o.get_info(h["/"].id).ctime == 0  # no object has a time: the bytes cannot depend on it
    with h5py.File(tmp_path / "a.h5", "r") as a, h5py.File(tmp_path / "b.h5", "r") as b:
        assert _plist(a["x"]) == _plist(b["x"]) and np.array_equal(a["x"][...], b["x"][...])
    assert (tmp_path / "a.h5").read_bytes() == (tmp_path / "b.h5").read_bytes()


# -- new_group ---------------------------------------------------------------------------------------------------------

def test_a_group_is_made_with_the_groups_on_its_way(f):
    gid = new_group(f.id, "layers/007")
    assert isinstance(gid, h5py.h5g.GroupID)
    assert isinstance(f["layers/007"], h5py.Group) and list(f["layers"]) == ["007"]
    new_group(gid, "cache")
    assert list(f["layers/007"]) == ["cache"]


def test_a_group_carries_no_time_stamps(f):
    new_group(f.id, "g")
    assert h5py.h5o.get_info(f["g"].id).ctime == 0
    assert not f["g"].id.get_create_plist().get_obj_track_times()


def test_a_group_cannot_be_made_twice(f):
    new_group(f.id, "g")
    with pytest.raises(ValueError, match=r"already exists"):
        new_group(f.id, "g")


def test_a_group_name_is_ascii(f):
    with pytest.raises(UnicodeEncodeError):
        new_group(f.id, "é")


# -- new_attr, text_attr -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, dtype, shape", [(3, "int64", ()), (1.5, "float64", ()), (True, "bool", ()),
                                                 (np.float32(2), "float32", ()), (np.arange(3), "int64", (3,)),
                                                 (np.array([[1.0, 2.0]]), "float64", (1, 2)), ("x", "|S1", ())])
def test_an_attribute_is_what_h5pys_attrs_write(f, value, dtype, shape):
    a, b = f.create_group("a"), f.create_group("b")
    new_attr(a.id, "v", value)
    b.attrs["v"] = np.bytes_(value.encode()) if isinstance(value, str) else value
    got, want = a.attrs.get_id("v"), b.attrs.get_id("v")
    assert got.dtype == want.dtype == np.dtype(dtype) and got.shape == want.shape == shape
    assert got.get_type() == want.get_type()
    assert np.array_equal(a.attrs["v"], b.attrs["v"])


def test_a_text_attribute_is_fixed_length_utf8(f):
    g = f.create_group("g")
    new_attr(g.id, "source_dtype", "torch.bfloat16")
    new_attr(g.id, "name", "modèle 模型")
    new_attr(g.id, "empty", "")
    assert g.attrs["source_dtype"] == b"torch.bfloat16"
    assert g.attrs["name"].decode("utf-8") == "modèle 模型"
    assert g.attrs["empty"] == b""
    info = h5py.check_string_dtype(g.attrs.get_id("name").dtype)
    assert info is not None and info.length == len("modèle 模型".encode("utf-8"))  # not variable-length


def test_an_attribute_is_made_once(f):
    g = f.create_group("g")
    new_attr(g.id, "n", 1)
    with pytest.raises(OSError, match=r"already exists"):
        new_attr(g.id, "n", 2)
    assert g.attrs["n"] == 1


def test_text_attr_stores_fixed_length_text_and_replaces(f):
    g = f.create_group("g")
    text_attr(g, "meta", '{"a": "é"}')
    raw = g.attrs["meta"]
    assert isinstance(raw, bytes) and raw.decode("utf-8") == '{"a": "é"}'
    assert h5py.check_string_dtype(g.attrs.get_id("meta").dtype).length == len('{"a": "é"}'.encode("utf-8"))
    text_attr(g, "meta", "{}")  # an existing attribute is replaced, as attrs[...] = does
    assert g.attrs["meta"] == b"{}"
    g.attrs["vlen"] = "x"  # what h5py would store for a str: variable-length, in the global heap
    assert h5py.check_string_dtype(g.attrs.get_id("vlen").dtype).length is None


# -- LIBVER ------------------------------------------------------------------------------------------------------------

def test_the_file_format_is_the_checksummed_one(tmp_path):
    """LIBVER's object formats (HDF5 1.8 to 1.10): a version 2 superblock and object headers with their "OHDR"
    signature, both checksummed; h5py's default (1.6-compatible) writes neither."""
    assert LIBVER == ("v108", "v110")
    with h5py.File(tmp_path / "new.h5", "w", libver=LIBVER) as h:
        new_dataset(h, "x", (2,), np.int64, np.array([1, 2]))
        assert h.libver == LIBVER
    with h5py.File(tmp_path / "old.h5", "w") as h:
        h.create_dataset("x", data=np.array([1, 2]))
    new, old = (tmp_path / "new.h5").read_bytes(), (tmp_path / "old.h5").read_bytes()
    assert new[:8] == old[:8] == b"\x89HDF\r\n\x1a\n"
    assert new[8] == 2 and b"OHDR" in new
    assert old[8] == 0 and b"OHDR" not in old
