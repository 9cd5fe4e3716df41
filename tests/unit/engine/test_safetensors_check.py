"""A safetensors file checked against itself before any tensor is read (engine/models/safetensors_check.py). Files are
written byte by byte here (an 8-byte little-endian header length, the JSON header, the data), so every lie a
stranger's file can tell is told exactly once; files the safetensors library writes are accepted with the header it
wrote."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from prefill_diff.engine.models.safetensors_check import DTYPES, HEADER_MAX_BYTES, check
from prefill_diff.engine.shared.errors import ModelLoadError

WHERE = "hf:/models/tiny"


def _file(tmp_path, header, data: bytes = b"", name="model.safetensors", length: int | None = None):
    """A safetensors file: header (a dict made JSON, or raw bytes), the data; ``length`` overrides the stated
    header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return str(p)


def _t(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _refused(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        check(path, WHERE)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{WHERE}: "), msg
    return msg


# -- accepted ----------------------------------------------------------------------------------------------------------

def test_a_true_header_is_returned_without_its_metadata(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "a": _t("F32", (2, 3), (0, 24)), "b": _t("I64", (5,), (24, 64)),
              "s": _t("BF16", (), (64, 66))}  # a scalar: its shape is [], one element
    got = check(_file(tmp_path, header, bytes(66)), WHERE)
    assert got == {"a": _t("F32", (2, 3), (0, 24)), "b": _t("I64", (5,), (24, 64)), "s": _t("BF16", (), (64, 66))}


def test_tensors_in_any_order_touching_empty_or_with_gaps_are_accepted(tmp_path):
    """Spans may come in any order and may touch; an empty tensor takes no bytes; a gap or trailing bytes are not
    a lie about any tensor (the safetensors library refuses them itself, and the loader reports its refusal)."""
    header = {"late": _t("U8", (4,), (12, 16)), "early": _t("F32", (2,), (0, 8)), "none": _t("F16", (0, 7), (8, 8)),
              "gap_after": _t("I16", (1,), (20, 22))}
    assert set(check(_file(tmp_path, header, bytes(30)), WHERE)) == {"late", "early", "none", "gap_after"}


def test_an_empty_header_and_null_metadata_are_a_file_of_no_tensors(tmp_path):
    assert check(_file(tmp_path, {}), WHERE) == {}
    assert check(_file(tmp_path, {"__metadata__": None}, name="b.safetensors"), WHERE) == {}
    assert check(_file(tmp_path, b'{}        ', name="c.safetensors"), WHERE) == {}  # padded with spaces


@pytest.mark.parametrize("dtype, size", [("BOOL", 1), ("U8", 1), ("I8", 1), ("F8_E5M2", 1), ("F8_E4M3", 1),
                                         ("F8_E8M0", 1), ("I16", 2), ("U16", 2), ("F16", 2), ("BF16", 2), ("I32", 4),
                                         ("U32", 4), ("F32", 4), ("I64", 8), ("U64", 8), ("F64", 8), ("C64", 8)])
def test_each_dtype_is_its_size_in_bytes(tmp_path, dtype, size):
    assert DTYPES[dtype] == size
    assert check(_file(tmp_path, {"t": _t(dtype, (3, 2), (0, 6 * size))}, bytes(6 * size)), WHERE)
    one_more = _file(tmp_path, {"t": _t(dtype, (3, 2), (0, 7 * size))}, bytes(7 * size), name="off.safetensors")
    assert _refused(one_more).endswith(f"shape [3, 2] of {dtype} is {6 * size} bytes, its data_offsets span {7 * size}")


def test_the_table_is_every_dtype_it_sizes():
    assert len(DTYPES) == 17


def test_a_file_the_safetensors_library_wrote_is_accepted_as_it_wrote_it(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"f32": np.zeros((2, 3), np.float32), "i64": np.arange(5, dtype=np.int64),
               "f16": np.zeros((0, 4), np.float16), "u8": np.ones(3, np.uint8), "b": np.array([True, False]),
               "f64": np.zeros((1, 1, 2), np.float64), "c64": np.zeros(2, np.complex64)}
    path = str(tmp_path / "lib.safetensors")
    st.save_file(tensors, path, metadata={"format": "np"})
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    written = json.loads(raw[8:8 + n])
    del written["__metadata__"]
    assert check(path, WHERE) == written
    assert set(written) == set(tensors)


# -- refused: the file -------------------------------------------------------------------------------------------------

def test_a_missing_file_cannot_be_opened(tmp_path):
    assert _refused(str(tmp_path / "gone.safetensors")) == (f"{WHERE}: cannot open gone.safetensors (No such file or "
                                                            "directory)")


def test_a_directory_is_not_a_regular_file(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    assert _refused(str(tmp_path / "dir.safetensors")) == f"{WHERE}: dir.safetensors is not a regular file"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "p.safetensors")
    assert _refused(str(tmp_path / "p.safetensors")) == f"{WHERE}: p.safetensors is not a regular file"


def test_a_device_is_refused_without_reading():
    assert _refused("/dev/zero") == f"{WHERE}: zero is not a regular file"


@pytest.mark.parametrize("size", [0, 1, 7])
def test_a_file_shorter_than_the_length_field_is_refused(tmp_path, size):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01" * size)
    assert _refused(str(p)) == (f"{WHERE}: short.safetensors is {size} bytes, too short for a safetensors file (an "
                                "8-byte header length, then the header)")


def test_a_header_length_past_the_file_is_refused(tmp_path):
    path = _file(tmp_path, {}, length=3)  # the header is 2 bytes: say 3
    assert _refused(path) == f"{WHERE}: model.safetensors's header length 3 is more than the file's 2 bytes after it"


def test_a_header_length_past_the_librarys_limit_is_refused_naming_it(tmp_path):
    path = _file(tmp_path, {}, length=2**64 - 1)  # -1 read as a signed length
    msg = _refused(path)
    assert msg == (f"{WHERE}: model.safetensors's header length {2**64 - 1:,} is more than the file's 2 bytes after it "
                   f"(and than the {HEADER_MAX_BYTES:,} a header may be)")
    assert HEADER_MAX_BYTES == 100 * 1024 * 1024


def test_a_header_length_past_the_librarys_limit_in_a_file_that_long_is_refused_naming_the_limit(tmp_path):
    """A header length the file could hold, but longer than a header may be: the message says which limit it
    passed (the file's bytes after the length field are more than the length)."""
    n = HEADER_MAX_BYTES + 1
    p = tmp_path / "model.safetensors"
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 16)  # sparse: nothing past the length field is written or read
    assert _refused(str(p)) == (f"{WHERE}: model.safetensors's header length {n:,} is more than the "
                                f"{HEADER_MAX_BYTES:,} bytes a header may be")


# -- refused: the header -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"a": "\xff"}', b"\xfe\xff{}", b'{"a": 1', b"{'a': 1}", b'{"a": NaN}', b"",
                                 b'{"t": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}'])
def test_a_header_that_is_not_utf8_json_is_refused(tmp_path, raw):
    msg = _refused(_file(tmp_path, raw))
    assert msg.startswith(f"{WHERE}: model.safetensors's header is not UTF-8 JSON ("), msg


def test_a_header_nested_too_deep_is_refused(tmp_path):
    msg = _refused(_file(tmp_path, b"[" * 100_000 + b"]" * 100_000))
    assert msg.startswith(f"{WHERE}: model.safetensors's header is not UTF-8 JSON ("), msg


@pytest.mark.parametrize("raw, kind", [(b"[]", "list"), (b"3", "int"), (b'"x"', "str"), (b"null", "NoneType")])
def test_a_header_that_is_not_an_object_is_refused(tmp_path, raw, kind):
    assert _refused(_file(tmp_path, raw)) == f"{WHERE}: model.safetensors's header must be a JSON object (got {kind})"


@pytest.mark.parametrize("meta", [{"a": 1}, ["a"], "format", {"a": None}, {"a": {"b": "c"}}])
def test_metadata_that_is_not_a_table_of_strings_is_refused(tmp_path, meta):
    assert _refused(_file(tmp_path, {"__metadata__": meta})) == (f"{WHERE}: model.safetensors's __metadata__ must be a "
                                                                 "table of strings")


@pytest.mark.parametrize("entry", [[1, 2], "F32", {"dtype": "F32", "shape": [1]},
                                   {**_t(), "extra": 1}, {"dtype": "F32", "shape": [2], "offsets": [0, 8]}])
def test_an_entry_that_is_not_dtype_shape_and_offsets_is_refused(tmp_path, entry):
    assert _refused(_file(tmp_path, {"w": entry}, bytes(8))) == (f"{WHERE}: model.safetensors: tensor 'w' must be a "
                                                                 "table of dtype, shape and data_offsets")


@pytest.mark.parametrize("dtype, shown", [("F33", "'F33'"), ("f32", "'f32'"), ("F4", "'F4'"), (4, "4"),
                                          (None, "null"), (["F32"], '["F32"]')])
def test_an_unknown_dtype_is_refused_with_the_known_ones(tmp_path, dtype, shown):
    msg = _refused(_file(tmp_path, {"w": _t(dtype)}, bytes(8)))
    assert msg == f"{WHERE}: model.safetensors: tensor 'w' has dtype {shown} (known: {', '.join(DTYPES)})"


@pytest.mark.parametrize("shape, shown", [([-1], "[-1]"), ([2.0], "[2.0]"), ([True], "[true]"), ("2", "'2'"),
                                          ([[2]], "[[2]]"), ({"n": 2}, '{"n": 2}'), ([None], "[null]")])
def test_a_shape_that_is_not_counts_is_refused(tmp_path, shape, shown):
    entry = {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}
    msg = _refused(_file(tmp_path, {"w": entry}, bytes(8)))
    assert msg == f"{WHERE}: model.safetensors: tensor 'w' has shape {shown} (a list of non-negative integers)"


@pytest.mark.parametrize("offsets, shown", [([0], "[0]"), ([0, 4, 8], "[0, 4, 8]"), ([-4, 4], "[-4, 4]"),
                                            ([0, 8.0], "[0, 8.0]"), ([False, 8], "[false, 8]"), ("0,8", "'0,8'")])
def test_offsets_that_are_not_two_counts_are_refused(tmp_path, offsets, shown):
    entry = {"dtype": "F32", "shape": [2], "data_offsets": offsets}
    msg = _refused(_file(tmp_path, {"w": entry}, bytes(8)))
    assert msg == f"{WHERE}: model.safetensors: tensor 'w' has data_offsets {shown} (two non-negative integers)"


def test_offsets_past_the_data_are_refused(tmp_path):
    msg = _refused(_file(tmp_path, {"w": _t("F32", (2,), (4, 12))}, bytes(10)))
    assert msg == f"{WHERE}: model.safetensors: tensor 'w' has data_offsets [4, 12), outside the file's 10 data bytes"


def test_offsets_far_past_the_data_are_refused_without_overflow(tmp_path):
    huge = 2**70
    msg = _refused(_file(tmp_path, {"w": _t("U8", (huge,), (0, huge))}, bytes(4)))
    assert msg == (f"{WHERE}: model.safetensors: tensor 'w' has data_offsets [0, {huge}), outside the file's 4 data "
                   "bytes")


def test_offsets_running_backwards_are_refused(tmp_path):
    msg = _refused(_file(tmp_path, {"w": _t("F32", (0,), (8, 4))}, bytes(8)))
    assert msg == f"{WHERE}: model.safetensors: tensor 'w' has data_offsets [8, 4) running backwards"


@pytest.mark.parametrize("shape, dtype, need", [((2, 3), "F32", 24), ((3,), "BF16", 6), ((), "I64", 8),
                                                ((4, 0), "F64", 0)])
def test_a_shape_whose_bytes_are_not_its_span_is_refused(tmp_path, shape, dtype, need):
    msg = _refused(_file(tmp_path, {"w": _t(dtype, shape, (0, 16))}, bytes(16)))
    assert msg == (f"{WHERE}: model.safetensors: tensor 'w': shape {list(shape)} of {dtype} is {need:,} bytes, its "
                   "data_offsets span 16")


@pytest.mark.parametrize("a, b", [((0, 8), (4, 12)), ((0, 8), (7, 9)), ((0, 16), (4, 8)), ((4, 8), (4, 8)),
                                  ((0, 8), (6, 6))])
def test_overlapping_tensors_are_refused_naming_both(tmp_path, a, b):
    """Partly (by one byte too), one inside the other, the same span twice, and an empty tensor inside another's
    bytes."""
    header = {"first": _t("U8", (a[1] - a[0],), a), "second": _t("U8", (b[1] - b[0],), b)}
    msg = _refused(_file(tmp_path, header, bytes(16)))
    (lo_name, lo), (hi_name, hi) = sorted([("first", a), ("second", b)], key=lambda x: (x[1], x[0]))
    assert msg == (f"{WHERE}: model.safetensors: tensors {lo_name!r} [{lo[0]}, {lo[1]}) and {hi_name!r} [{hi[0]}, "
                   f"{hi[1]}) overlap")


def test_an_overlap_is_found_among_many_tensors(tmp_path):
    header = {f"t{i}": _t("U8", (4,), (4 * i, 4 * i + 4)) for i in range(50)}
    header["t49"] = _t("U8", (4,), (100, 104))  # on top of t25
    assert "tensors 't25' [100, 104) and 't49' [100, 104) overlap" in _refused(_file(tmp_path, header, bytes(200)))


def test_a_strangers_tensor_name_is_shown_as_text_and_shortened(tmp_path):
    """A name is shown by repr (control characters and bidi overrides escaped) and cut to 60 characters."""
    name = "evil\x1b[2J\u202e" + "n" * 100
    msg = _refused(_file(tmp_path, {name: _t("X")}, bytes(8)))
    assert "\x1b" not in msg and "\u202e" not in msg and "'evil\\x1b[2J\\u202e" in msg
    shown = msg.split("tensor ", 1)[1].split(" has dtype", 1)[0]
    assert len(shown) == 60 and shown.endswith("..."), shown
