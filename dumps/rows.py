"""Fast reading of stored sample rows: into reused per-thread buffers, straight from the file for the
uncompressed rows of a checked trace (dumps/chunks.py), as views of the mapped file, and read ahead of the
comparison on a thread. ``RowReading`` is how a Trace offers them.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from functools import cached_property
from typing import Iterator, NamedTuple

import h5py
import numpy as np

from .chunks import ChunkReader
from .file_checks import DAMAGE, TraceError



_local = threading.local()


def _row_buffer(slot: str, shape, dtype) -> np.ndarray:
    bufs = getattr(_local, "rows", None)
    if bufs is None:
        bufs = _local.rows = {}
    key = (slot, tuple(shape), np.dtype(dtype).str)
    if key not in bufs:
        for k in [k for k in bufs if k[0] == slot]:  # one buffer per slot: drop the old shape
            del bufs[k]
        bufs[key] = np.empty(shape, dtype=dtype)
    return bufs[key]


class RowSource(NamedTuple):
    """Rows of one dataset of one open trace (a RowReading), for read_ahead."""
    trace: "RowReading"
    ds: h5py.Dataset


def _new_reader() -> None:
    """The read-ahead thread's executor; a forked child gets a new one (the parent's thread is not there, and
    the old executor would queue work that no thread ever runs)."""
    global _READER
    _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-diff-read")


READ_AHEAD = True  # False: read_ahead reads each step on the calling thread (tests/bench/bench_compare.py)


AHEAD_MIN_BYTES = 256 * 1024  # smaller steps are read on the calling thread: a hand-over costs more than the read


def read_ahead(sources, steps) -> Iterator[tuple]:
    """For each step (one row index per source), the rows ``source.ds[index]`` of every source, in order; the
    next step's rows are read while this step's are used.

    A comparison alternates reading rows (a system call that copies from the page cache or waits
    for the disk) and computing on them (numpy); both release the GIL, so reading the next rows on
    a background thread hides most of the read. The rows are two alternating buffers per source,
    of the calling thread: a step's rows are valid until the next step is requested. A read's error
    is raised here, when its step is requested; a generator closed early waits for the read in
    flight (the traces may be closed next).
    """
    sources, steps = [RowSource(*s) for s in sources], [tuple(s) for s in steps]
    if not steps:
        return
    mapped = [s.trace.mapped_rows(s.ds) for s in sources]
    if all(m is not None for m in mapped):
        yield from _mapped_rows(mapped, steps)
        return
    bufs = [[_row_buffer(f"ahead{j}.{k}", s.ds.shape[1:], s.ds.dtype) for j, s in enumerate(sources)] for k in (0, 1)]

    def read(k: int) -> tuple:
        return tuple(s.trace.read_row_into(s.ds, i, b) for s, i, b in zip(sources, steps[k], bufs[k % 2]))

    step_bytes = sum(int(np.prod(s.ds.shape[1:])) * s.ds.dtype.itemsize for s in sources)
    if not READ_AHEAD or step_bytes < AHEAD_MIN_BYTES:
        yield from (read(k) for k in range(len(steps)))
        return
    for s in sources:
        s.trace.direct_reader()  # made on this thread: the reading thread only uses it
    pending = _READER.submit(read, 0)
    try:
        for k in range(len(steps)):
            rows = pending.result()
            pending = _READER.submit(read, k + 1) if k + 1 < len(steps) else None
            yield rows
    finally:
        if pending is not None:
            pending.cancel() or wait([pending])


def _mapped_rows(mapped, steps) -> Iterator[tuple]:
    """read_ahead over mapped files (Trace.mapped_rows): each row a view of the page cache, no copy and no
    thread; the next step's rows are announced to the kernel first, so that a cold file is read while this
    step is compared, and the previous step's pages are released from the process once it is over (its
    views stay valid: touched again, they fault the pages back in)."""
    for k, step in enumerate(steps):
        if k + 1 < len(steps):
            for (_, will_need, _), i in zip(mapped, steps[k + 1]):
                will_need(i)
        try:
            yield tuple(view(i) for (view, _, _), i in zip(mapped, step))
        finally:
            for (_, _, done_with), i in zip(mapped, step):
                done_with(i)


class RowReading:
    """A trace's rows, read fast (module docstring), turning HDF5 read failures into TraceError."""

    def read(self, ds, sel=()):
        """ds[sel], turning HDF5 read failures into TraceError."""
        try:
            return ds[sel]
        except DAMAGE as e:
            raise TraceError(f"{self.name}: cannot read {ds.name} (corrupt data: {str(e).splitlines()[0][:120]})") \
                from None

    def read_row(self, ds, index: int, slot: str) -> np.ndarray:
        """ds[index] (one sample's chunk) into a reused per-thread buffer named ``slot``.

        Streaming compare reads thousands of rows of the same shape; reading into the same memory
        avoids a fresh allocation (and its page faults) per row. The result is valid until the next
        read into the same slot on the same thread.
        """
        return self.read_row_into(ds, index, _row_buffer(slot, ds.shape[1:], ds.dtype))

    def read_row_into(self, ds, index: int, buf: np.ndarray) -> np.ndarray:
        """ds[index] into ``buf`` (C-contiguous, of the row's shape and dtype); returns ``buf``."""
        try:
            if not self._chunks.read_row(ds, index, buf):  # uncompressed rows of a checked file: os.preadv
                ds.read_direct(buf, np.s_[index])
        except DAMAGE as e:
            raise TraceError(f"{self.name}: cannot read {ds.name} (corrupt data: {str(e).splitlines()[0][:120]})") \
                from None
        return buf

    def mapped_rows(self, ds):
        """Three functions of a row index: ds[index] as a read-only view of the mapped file (dumps.chunks
        ChunkReader.view), announcing a row that will be needed, and releasing a row's pages from the
        process (they stay in the page cache); None when rows must be read (read_row_into)."""
        plan = self._chunks.mapped_plan(ds)
        if plan is None:
            return None
        chunks, name = self._chunks, ds.name

        def view(index: int) -> np.ndarray:
            try:
                return chunks.view(plan, index)
            except DAMAGE as e:
                raise TraceError(f"{self.name}: cannot read {name} ({str(e).splitlines()[0][:160]})") from None
        return view, lambda index: chunks.will_need(plan, index), lambda index: chunks.done_with(plan, index)

    @cached_property
    def _chunks(self) -> ChunkReader:  # made on the first row read, after _check passed
        return ChunkReader(self.f, enabled=not self._built_here, why="a view built over rank files")

    def direct_reader(self) -> ChunkReader:
        """The reader of this file's uncompressed rows (dumps.chunks), made on first use."""
        return self._chunks


_new_reader()
os.register_at_fork(after_in_child=_new_reader)
