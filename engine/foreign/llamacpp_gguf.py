"""The GGUF file llama.cpp runs: the model's own, or a conversion written for the run; and what its header says.

``gguf_index`` walks a GGUF header once, skipping the metadata values, for the architecture, the tensor infos and
the data offset; ``GgufFile.describe`` counts the weight types from it and digests the quantized weights.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import struct
import tempfile
from typing import NamedTuple

import numpy as np

from ..shared.errors import ModelLoadError
from ..models.gguf_loader import smollm2_path
from ..models.gguf_writer import check_convertible, write_gguf



class GgufFile:
    """The file llama.cpp loads: the model's own GGUF, or a conversion written for this run."""

    def __init__(self, snapshot, gguf_type: str):
        self.tmpdir = None
        src = snapshot.source
        if src == "smollm2" or src.startswith("gguf:"):
            self.path = smollm2_path() if src == "smollm2" else src[5:]
            self.converted = None
        else:
            check_convertible(snapshot)
            self.tmpdir = tempfile.mkdtemp(prefix="prefill-diff-gguf-")
            self.path = os.path.join(self.tmpdir, "model.gguf")
            write_gguf(snapshot, self.path, gguf_type)
            self.converted = gguf_type
        self.describe = self._describe()

    def _describe(self) -> dict:
        """Architecture, weight types (counted over matrices) and, if quantized, a digest of those weights."""
        try:
            arch, tensors, data = gguf_index(self.path)
        except (ValueError, KeyError, IndexError, OSError) as e:  # struct.error is a ValueError
            raise ModelLoadError(f"{self.path}: not a GGUF file llama.cpp can run ({type(e).__name__}: {e})") from None
        counts, quant = {}, []
        float_types = {"F32", "F16", "BF16", "F64"}
        for t in tensors:
            if len(t["shape"]) < 2:
                continue
            counts[t["type"]] = counts.get(t["type"], 0) + 1
            if t["type"] not in float_types:
                quant.append(t)
        digest = None
        if quant:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for t in sorted(quant, key=lambda t: t["name"]):
                    h.update(f"{t['name']}|{t['type']}|{t['shape']}|".encode())
                    f.seek(data + t["offset"])
                    h.update(f.read(t["nbytes"]))
            digest = "sha256:" + h.hexdigest()
        names = set(counts)
        wdtype = ("float16" if "F16" in names else "bfloat16" if "BF16" in names else "float32")
        main = max((n for n in counts if n not in float_types), key=lambda n: counts[n], default=None)
        return {"arch": arch, "weight_types": dict(sorted(counts.items())), "weight_quant": main,
                "weights_dtype": wdtype, "quantized_weights_digest": digest}

    def close(self):
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class GgufIndex(NamedTuple):
    """What a GGUF header says about the weights: architecture, tensor infos, offset of the data section."""
    arch: str | None
    tensors: list[dict]
    data_offset: int


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Header:
    """A cursor over a GGUF header: reads strings and integers, skips values without building them."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.at = buf, path, 24

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        n, = self.unpack("<Q")
        self.at += n
        return self.buf[self.at - n:self.at].decode("utf-8", "replace")

    def skip(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.at += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip(etype)
        else:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype}")


def gguf_index(path: str) -> GgufIndex:
    """Architecture, tensor infos and data offset from a GGUF header, without parsing metadata values.

    gguf.GGUFReader builds every metadata field (tens of seconds for a 49k-token vocabulary on a busy
    machine); this walks the header once, skipping the values, as the GGUF format allows.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # gguf is optional: imported when used
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # only the header pages are read
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file")
    _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    h = _Header(buf, path)
    arch, alignment = None, 32
    for _ in range(n_kv):
        key = h.string()
        vtype, = h.unpack("<I")
        if key == "general.architecture" and vtype == _STRING:
            arch = h.string()
        elif key == "general.alignment" and vtype == _UINT32:
            alignment, = h.unpack("<I")
        else:
            h.skip(vtype)
    tensors = []
    for _ in range(n_tensors):
        name = h.string()
        nd, = h.unpack("<I")
        dims = h.unpack(f"<{nd}Q")
        ttype, offset = h.unpack("<IQ")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        tensors.append({"name": name, "shape": tuple(reversed(dims)), "type": GGMLQuantizationType(ttype).name,
                        "offset": offset, "nbytes": int(np.prod(dims)) // block * size})
    at = h.at
    buf.close()
    return GgufIndex(arch=arch, tensors=tensors, data_offset=-(-at // alignment) * alignment)
