"""Reading whole sample rows of uncompressed datasets straight from the trace file.

HDF5 reads a chunk into its own buffer and then copies it into ours; for the comparison's row
reads (one row = one chunk of a state or cache dataset) that copy is about half the cost of
reading. When a dataset's bytes are stored as is, a row is just ``nbytes`` bytes at a known file
offset, and ``os.preadv`` puts them straight into the caller's buffer.

Only what HDF5 would read byte for byte is read directly, and only from a file that has passed
the reader's checks (dumps/file_checks.py ``check_storage``: no external links, external storage,
virtual datasets or unknown filters) and is open read-only through the default (sec2) driver with
no user block. Each dataset is checked again before its first direct read: chunked with one
chunk per row, or contiguous; no filters and no external storage; a native little-endian type
that HDF5 stores exactly as numpy lays it out; every row allocated, of exactly the expected size
and inside the file. Before the first direct read from a file, a few values are read both ways
and must agree. Anything else - gzip, a chunk index that points past the end of the file,
big-endian data, a virtual view over rank files - is read by h5py, as before:
``ChunkReader.read_row`` returns False and the caller reads the row with ``read_direct``.

``ChunkReader.mapped_plan`` and ``view`` go one step further for the comparison: the file is
mapped read-only (``mmap``) and a row is a numpy view of the page cache's own pages, with no
copy at all; ``will_need`` announces the next rows to the kernel (``madvise(MADV_WILLNEED)``) so
that a cold file is read while the current rows are compared, and ``done_with`` drops a compared
row's pages from the process (``MADV_DONTNEED``: they stay in the page cache). The file's size is
checked before each view; a file cut short by another program in the moment a row is being read
can still stop the process with SIGBUS, as with any memory-mapped reader (``PREFILL_DIFF_MMAP=0``
reads with system calls).
"""
from __future__ import annotations

import mmap
import os
import stat
import sys
from typing import NamedTuple

import h5py
import numpy as np

# The comparison reads rows of states (S, C, W) and cache tensors (S, H, T, D); a 1-D dataset's
# "rows" are single values, not worth a system call each.
MIN_RANK = 2
PROBE = 64  # values of a first row read both ways before a file's first direct read
MMAP = os.environ.get("PREFILL_DIFF_MMAP", "").strip() != "0" and hasattr(mmap, "MADV_WILLNEED")
FAULT_AROUND = 64 * 1024  # bytes a page fault may map around it (Linux's default fault_around_bytes)


class RowPlan(NamedTuple):
    """Where the rows of one dataset lie in the file: row i is ``nbytes`` bytes at ``offsets[i]``, a row of
    ``shape`` and ``dtype`` (the dataset's, kept: h5py's properties cost microseconds each)."""
    offsets: tuple
    nbytes: int
    shape: tuple = ()
    dtype: np.dtype | None = None


class Refused(NamedTuple):
    """Why a dataset is read by h5py (kept so tests and curious callers can see the reason)."""
    reason: str


def file_refusal(f: h5py.File) -> str | None:
    """Why rows of this open file cannot be read directly, or None when they can."""
    if not hasattr(os, "preadv"):
        return "os.preadv is not available on this platform"
    if sys.byteorder != "little":
        return "this machine is big-endian"
    if f.driver != "sec2":
        return f"the file is open through the {f.driver!r} HDF5 driver, not sec2"
    if f.mode != "r":
        return "the file is open for writing (HDF5 may hold data not yet on disk)"
    if f.userblock_size:  # chunk addresses ignore the user block in HDF5 < 1.14.4
        return f"the file has a user block of {f.userblock_size} bytes"
    return None


def _dtype_refusal(ds: h5py.Dataset) -> str | None:
    dt = ds.dtype
    if dt.kind not in "fiu" or dt.fields is not None or dt.subdtype is not None:
        return f"type {dt} is not a plain number"
    if dt.byteorder not in "=<|":
        return f"type {dt} is not little-endian"
    # the file's type must be the one numpy's layout describes (an HDF5 float with a custom
    # precision or bit offset maps to the nearest numpy type and is converted on read)
    if not ds.id.get_type().equal(h5py.h5t.py_create(dt)):
        return f"the stored type is not exactly numpy's {dt}"
    return None


def _storage_refusal(ds: h5py.Dataset) -> str | None:
    plist = ds.id.get_create_plist()
    layout = plist.get_layout()
    if layout not in (h5py.h5d.CHUNKED, h5py.h5d.CONTIGUOUS):
        return "the layout is neither chunked nor contiguous"
    if plist.get_nfilters():
        return "the data passes through HDF5 filters (compressed)"
    if plist.get_external_count():
        return "the data is kept in an external file"
    if ds.ndim < MIN_RANK or ds.shape[0] == 0:
        return f"shape {ds.shape} has no rows to read"
    if layout == h5py.h5d.CHUNKED and ds.chunks != (1, *ds.shape[1:]):
        return f"chunks {ds.chunks} are not one whole row of shape {ds.shape}"
    return None


def _row_offsets(ds: h5py.Dataset, nbytes: int, file_size: int) -> tuple | str:
    """Each row's file offset, or why they cannot be trusted."""
    rows = ds.shape[0]
    if ds.chunks is None:
        base, size = ds.id.get_offset(), ds.id.get_storage_size()
        if base is None or size != rows * nbytes:
            return f"the data is not allocated as {rows * nbytes} bytes (storage: {size} bytes)"
        offsets = tuple(base + i * nbytes for i in range(rows))
    else:
        zeros = (0,) * (ds.ndim - 1)
        infos = [ds.id.get_chunk_info_by_coord((i, *zeros)) for i in range(rows)]
        for i, info in enumerate(infos):
            if info.byte_offset is None:
                return f"row {i} is not allocated (HDF5 reads it as the fill value)"
            if info.size != nbytes or info.filter_mask or info.chunk_offset != (i, *zeros):
                return f"row {i} is stored as {info.size} bytes (filter mask {info.filter_mask}), not {nbytes}"
        offsets = tuple(info.byte_offset for info in infos)
    bad = [o for o in offsets if o < 0 or o + nbytes > file_size]
    if bad:
        return f"a row lies at byte {bad[0]}, outside the file of {file_size} bytes"
    return offsets


def _pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` with the file's bytes at ``offset``; False if the file ends first or cannot be read."""
    done = 0
    try:
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)  # a read may stop short (Linux: 2 GiB at most)
            if n <= 0:
                return False
            done += n
    except OSError:
        return False
    return True


class ChunkReader:
    """Direct row reads for one open, checked trace file; every refusal falls back to h5py.

    Build it only for a file the reader has checked (Trace._check). ``refusal`` says why the
    whole file is read by h5py (None: rows may be read directly, dataset by dataset).
    """

    def __init__(self, f: h5py.File, enabled: bool = True, why: str = "not a checked trace file"):
        self.f = f
        self.refusal = (file_refusal(f) if enabled else why)
        self._plans: dict = {}
        self._probed = False
        self._map = None  # the file mapped read-only (view), False once mapping failed or closed
        if self.refusal is None:
            self.fd = f.id.get_vfd_handle()  # the descriptor HDF5 itself reads through (sec2: pread)
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                self.refusal = "the trace is not a regular file"
            self.file_size = st.st_size
            self.fileno = f.id.fileno

    def plan(self, ds: h5py.Dataset) -> RowPlan | Refused:
        """The row plan of ``ds`` (made and checked once, then cached), or why it is read by h5py."""
        if self.refusal is not None:
            return Refused(self.refusal)
        key = ds.name
        if key not in self._plans:
            try:
                self._plans[key] = self._make_plan(ds)
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # h5py will say what is wrong
                self._plans[key] = Refused(f"the chunk index cannot be read ({type(e).__name__})")
        return self._plans[key]

    def _make_plan(self, ds: h5py.Dataset) -> RowPlan | Refused:
        why = _storage_refusal(ds) or _dtype_refusal(ds)
        if why:
            return Refused(why)
        nbytes = int(np.prod(ds.shape[1:])) * ds.dtype.itemsize
        offsets = _row_offsets(ds, nbytes, self.file_size)
        if isinstance(offsets, str):
            return Refused(offsets)
        plan = RowPlan(offsets=offsets, nbytes=nbytes, shape=tuple(ds.shape[1:]), dtype=ds.dtype)
        if not self._probed:  # once per file: HDF5 and this module agree on what an address means
            if not self._probe(ds, plan):
                self.refusal = "a row read directly differs from HDF5's read of it"
                return Refused(self.refusal)
            self._probed = True
        return plan

    def _probe(self, ds: h5py.Dataset, plan: RowPlan) -> bool:
        """The first PROBE values of the dataset's first row, read both ways, must be the same bytes. (Per
        file, not per dataset: HDF5 reads all of a 4 MiB chunk to return 64 values of it.)"""
        n = min(PROBE, ds.shape[-1])
        want = np.ascontiguousarray(ds[(0,) * (ds.ndim - 1) + (slice(0, n),)])  # the row's first n values
        got = np.empty(n, dtype=ds.dtype)
        return _pread_into(self.fd, memoryview(got).cast("B"), plan.offsets[0]) and got.tobytes() == want.tobytes()

    def read_row(self, ds: h5py.Dataset, index: int, buf: np.ndarray) -> bool:
        """Read ``ds[index]`` into ``buf`` (C-contiguous, of ``ds``'s row shape and dtype) and return True;
        return False, with ``buf`` undefined, when this row must be read by h5py instead."""
        plan = self._usable_plan(ds, index)
        if plan is None:
            return False
        if buf.dtype != plan.dtype or buf.nbytes != plan.nbytes or not buf.flags.c_contiguous \
                or not buf.flags.writeable:
            return False
        return _pread_into(self.fd, memoryview(buf).cast("B"), plan.offsets[index])

    def _usable_plan(self, ds: h5py.Dataset, index: int = 0) -> RowPlan | None:
        if self.refusal is not None or not ds.id.valid or ds.id.fileno != self.fileno:
            return None
        plan = self.plan(ds)
        if isinstance(plan, Refused) or not 0 <= index < len(plan.offsets):
            return None
        return plan

    def _mapped(self):
        if self._map is None:
            self._map = False
            if MMAP:
                try:
                    m = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError):  # e.g. a file system that cannot map
                    return None
                if len(m) >= self.file_size:
                    self._map = m
                else:
                    m.close()
        return self._map or None

    def mapped_plan(self, ds: h5py.Dataset) -> RowPlan | None:
        """The row plan of ``ds`` when its rows can be viewed in the mapped file (view), else None."""
        plan = self._usable_plan(ds)
        return plan if plan is not None and self._mapped() is not None else None

    def view(self, plan: RowPlan, index: int) -> np.ndarray:
        """Row ``index`` of a mapped_plan as a read-only view of the mapped file (no copy). Raises OSError when
        the file is now shorter than the row's end (another program cut it short since it was checked)."""
        off = plan.offsets[index]
        if os.fstat(self.fd).st_size < off + plan.nbytes:
            raise OSError(f"the file is now shorter than a row at byte {off} needs (changed while read)")
        return np.frombuffer(self._map, dtype=plan.dtype, count=plan.nbytes // plan.dtype.itemsize,
                             offset=off).reshape(plan.shape)

    def will_need(self, plan: RowPlan, index: int) -> None:
        """Ask the kernel to start reading row ``index`` of a mapped_plan into the page cache (a cold file is
        then read while the current rows are compared; for a cached row it is a page-table walk)."""
        self._advise(mmap.MADV_WILLNEED, plan.offsets[index], plan.offsets[index] + plan.nbytes)

    def done_with(self, plan: RowPlan, index: int) -> None:
        """Drop row ``index`` of a mapped_plan from this process's page tables (MADV_DONTNEED; a shared file
        mapping keeps its data: the page cache still holds the pages, and a view touched again faults them
        back in). Without it every page compared stays mapped, and the process's resident size grows with
        the traces (2.2 GiB for two 1 GiB traces). The range is widened by FAULT_AROUND on both sides: a page
        fault maps the cached pages around it too (Linux's fault-around, 64 KiB), which would otherwise stay
        mapped at every row's edges (38 MiB over two 2 GiB traces)."""
        self._advise(mmap.MADV_DONTNEED, max(0, plan.offsets[index] - FAULT_AROUND),
                     plan.offsets[index] + plan.nbytes + FAULT_AROUND)

    def _advise(self, advice: int, lo: int, hi: int) -> None:
        """madvise over bytes [lo, hi) of the mapping (lo rounded down to a page, hi capped at the end); advice
        only, so a failure or a closed mapping is ignored."""
        if not self._map:
            return
        lo = lo // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(advice, lo, min(hi, len(self._map)) - lo)
        except (OSError, ValueError):  # ValueError: closed since
            pass

    def close(self) -> None:
        """Unmap the file; a mapping that rows still view is released when the last view is gone."""
        m, self._map = self._map, False
        if m:
            try:
                m.close()
            except BufferError:
                pass


__all__ = ["ChunkReader", "RowPlan", "Refused", "file_refusal"]
