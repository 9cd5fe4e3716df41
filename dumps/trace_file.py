"""The HDF5 file a trace is recorded into: a temporary sibling of its target (or a file in memory), checked for
room before the first array, moved into place only when complete, removed when the recording fails.

The temporary name is registered (``placement.partial``) before the file exists, so an interrupt at any moment
can remove it; ``finish`` renames it with ``placement.place`` once the file is closed, never after an interrupt.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import h5py

from ..engine.shared.errors import PrefillDiffError
from ..engine.shared.untrusted import check_name_length, partial_sibling
from .h5write import LIBVER
from .placement import TraceExistsError, check_interrupt, completed, partial, place, settled


class RecorderError(PrefillDiffError):
    """The recorder was called out of order or with inconsistent data, or its trace cannot be written."""


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


class TraceFile:
    """One trace's open HDF5 file ``f``: written as ``tmp`` beside ``path`` and moved there by ``finish``, or kept
    in memory (``in_memory``: no path, or asked for)."""

    def __init__(self, path, force: bool = False, in_memory: bool = False):
        self.path = Path(path) if path is not None else None
        self.in_memory, self.force = in_memory, force
        if in_memory or path is None:
            self.in_memory, self.tmp = True, None
            self.f = h5py.File(f"mem-{secrets.token_hex(6)}.h5", "w", driver="core", backing_store=False,
                               libver=LIBVER)
        else:
            try:
                check_name_length(self.path, "the trace")
                if self.path.exists() and not force:
                    raise TraceExistsError(f"{self.path} exists; pass --force to overwrite it")
                if self.path.is_dir():
                    raise RecorderError(f"{self.path} is a directory")
            except OSError as e:
                raise RecorderError(f"cannot write {self.path}: {e.strerror}") from None
            self.tmp = Path(partial_sibling(self.path))
            partial(self.tmp)  # registered before it exists, so an interrupt at any moment can remove it
            try:
                self.f = h5py.File(self.tmp, "w", libver=LIBVER)
            except OSError as e:
                settled(self.tmp)
                raise RecorderError(f"cannot write {self.path}: {e}") from None
        self.closed = False

    def check_space(self, need: int) -> None:
        """Refuse to start a trace of about ``need`` bytes its file system has no room for: HDF5 cannot recover
        from a full disk (it crashes the process after the failed write), so the space is checked before the
        first array."""
        where = os.path.dirname(os.path.abspath(self.tmp))
        try:
            st = os.statvfs(where)
        except OSError:
            return  # a file system that does not say: the write itself will tell
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise RecorderError(f"not enough space for the trace {self.path}: it needs about {_mib(need)}, and its "
                                f"file system ({where}) has {_mib(free)} free")

    def finish(self) -> None:
        """Close the file and move it into place (in memory: flush it)."""
        if self.in_memory:
            self.f.flush()
            self.closed = True
            return
        self.f.close()
        self.closed = True
        check_interrupt()  # the interrupt may have been swallowed: never move an interrupted trace into place
        try:
            place(self.tmp, self.path, self.force)  # atomic: readers see the old state or the whole trace
        except BaseException:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            settled(self.tmp)
            raise
        completed(self.path)
        settled(self.tmp)

    def abort(self) -> None:
        """Drop the partial file."""
        if self.closed:
            return
        self.closed = True
        try:
            self.f.close()
        except Exception:
            pass
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            settled(self.tmp)
