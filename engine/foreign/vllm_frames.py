"""The frames prefill-diff and the vLLM worker exchange, read: an 8-byte little-endian header length, a JSON header
whose ``arrays`` lists (name, dtype, shape), then each array's bytes. The worker's ``Channel`` writes them.

Plain numpy: prefill-diff imports this module by name, and the worker (which imports nothing of prefill-diff by
name) loads it by its path.
"""
from __future__ import annotations

import json
import struct

import numpy as np

HEADER_LIMIT = 1 << 24  # bytes of JSON one frame's header may take


def read_frames(stream, error=ValueError, who: str = "the frames"):
    """(header, {name: array}) until the stream ends; a damaged frame raises ``error`` naming ``who`` sent it."""
    while True:
        size = stream.read(8)
        if len(size) < 8:
            return
        (n,) = struct.unpack("<Q", size)
        if n > HEADER_LIMIT:
            raise error(f"{who} sent a malformed frame (a {n}-byte header)")
        head = json.loads(stream.read(n).decode("utf-8"))
        arrays = {}
        for name, dtype, shape in head.pop("arrays", ()):
            a = np.empty(shape, dtype=np.dtype(dtype))
            if a.size and stream.readinto(memoryview(a).cast("B")) != a.nbytes:
                raise error(f"{who}'s output ended inside an array")
            arrays[name] = a
        yield head, arrays
