"""The optional compiled kernels (dumps/_kernels.c): one pass over the data per group of reductions.

``pip install`` compiles ``_kernels`` when a C compiler is at hand; without one the install goes on and
every caller uses its numpy code, which computes the same quantities in several passes (slower, not
different: tests/test_kernels.py compares the two). ``PREFILL_DIFF_NATIVE=0`` turns the kernels off for
a process. (CI sets ``PREFILL_DIFF_REQUIRE_NATIVE=1``: a test then fails if they did not build, so that
a broken build cannot hide behind the fallback.)
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np

ENV = "PREFILL_DIFF_NATIVE"
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))  # what the kernels read (and bfloat16 bit patterns)


def _load():
    if os.environ.get(ENV, "").strip() == "0":
        return None, f"turned off ({ENV}=0)"
    if sys.byteorder != "little":  # the checksum reads 8-byte words as little-endian
        return None, "not used on a big-endian machine"
    try:
        from ._kernels import row_pass, stats, unaligned_ok
    except ImportError as e:
        return None, f"not built ({e})"
    return SimpleNamespace(row_pass=row_pass, stats=stats, unaligned_ok=bool(unaligned_ok)), "in use"


_MODULE, STATE = _load()


def compiled():
    """The compiled kernels (``row_pass``, ``stats``: see dumps/_kernels.c; ``unaligned_ok``: whether they read rows
    at any byte offset, as mapped trace rows often are), or None: the callers' numpy code is used."""
    return _MODULE


def describe() -> str:
    """Whether the compiled kernels are in use, in words (``prefill-diff --version``)."""
    return f"compiled kernels: {STATE}"
