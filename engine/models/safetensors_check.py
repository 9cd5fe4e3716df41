"""A safetensors file checked against itself before any tensor is read.

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON (an object: tensor name ->
{dtype, shape, data_offsets}, and an optional "__metadata__" table of strings), then the data, each tensor's
bytes at [begin, end) counted from the data's start. A file from a stranger may lie in any of those: a length
past the end, a header that is not JSON, offsets that overlap, run backwards or past the end, a shape whose
bytes are not the span it claims, an unknown dtype. ``check`` refuses each in one line naming the file, the
tensor and the values, so that the safetensors library only ever reads a file whose header is true.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct

from ..shared.errors import ModelLoadError
from ..shared.untrusted import strict_json

HEADER_MAX_BYTES = 100 << 20  # the safetensors library's own limit on the header
# the dtypes the format defines, and each element's size in bytes (sub-byte fp4/fp6 formats are not loaded)
DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
          "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def check(path: str, where: str) -> dict:
    """The header of the safetensors file at ``path`` ({name: entry}, without "__metadata__") once every entry is
    shown true of the file; ModelLoadError otherwise. The file must be a regular file (a FIFO is refused without
    blocking, a directory or a device without reading)."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ModelLoadError(f"{where}: cannot open {name} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelLoadError(f"{where}: {name} is not a regular file")
        size = st.st_size
        if size < 8:
            raise ModelLoadError(f"{where}: {name} is {size} bytes, too short for a safetensors file (an 8-byte "
                                 "header length, then the header)")
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        if n > size - 8:
            raise ModelLoadError(f"{where}: {name}'s header length {n:,} is more than the file's {size - 8:,} "
                                 f"bytes after it" + ("" if n <= HEADER_MAX_BYTES else
                                                     f" (and than the {HEADER_MAX_BYTES:,} a header may be)"))
        if n > HEADER_MAX_BYTES:
            raise ModelLoadError(f"{where}: {name}'s header length {n:,} is more than the {HEADER_MAX_BYTES:,} "
                                 "bytes a header may be")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise ModelLoadError(f"{where}: cannot read {name} ({e.strerror})") from None
    finally:
        os.close(fd)
    return _entries(raw, size - 8 - n, name, where)


def _entries(raw: bytes, data_len: int, name: str, where: str) -> dict:
    try:
        header = strict_json(raw)
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{where}: {name}'s header is not UTF-8 JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{where}: {name}'s header must be a JSON object (got {type(header).__name__})")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ModelLoadError(f"{where}: {name}'s __metadata__ must be a table of strings")
    spans = []
    for tensor, entry in header.items():
        spans.append(_span(tensor, entry, data_len, name, where))
    spans.sort()
    for (a0, a1, t0), (b0, b1, t1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ModelLoadError(f"{where}: {name}: tensors {_shown(t0)} [{a0}, {a1}) and {_shown(t1)} [{b0}, {b1}) "
                                 "overlap")
    return header


def _span(tensor: str, entry, data_len: int, name: str, where: str) -> tuple:
    what = f"{where}: {name}: tensor {_shown(tensor)}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ModelLoadError(f"{what} must be a table of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ModelLoadError(f"{what} has dtype {_shown(dtype)} (known: {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise ModelLoadError(f"{what} has shape {_shown(shape)} (a list of non-negative integers)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise ModelLoadError(f"{what} has data_offsets {_shown(offsets)} (two non-negative integers)")
    begin, end = offsets
    if not begin <= end <= data_len:
        raise ModelLoadError(f"{what} has data_offsets [{begin}, {end}), outside the file's {data_len:,} data bytes"
                             if end > data_len else f"{what} has data_offsets [{begin}, {end}) running backwards")
    need = math.prod(shape) * DTYPES[dtype]
    if need != end - begin:
        raise ModelLoadError(f"{what}: shape {shape} of {dtype} is {need:,} bytes, its data_offsets span "
                             f"{end - begin:,}")
    return begin, end, tensor


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _shown(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
