"""A trace moved into place only when complete: temporary files tracked, renamed without replacing.

A trace is written under a temporary name beside its target (``partial``), moved into place atomically when
it is complete (``place``: never over a file that appeared meanwhile, unless forced) and remembered
(``completed``); an interrupted process removes its temporary files (``remove_partial_files``) and can say
which traces it did complete (``completed_traces``).
"""
from __future__ import annotations

import ctypes
import errno
import os

from ..engine.shared.errors import INTERRUPT, PrefillDiffError

_PARTIAL: set = set()  # temporary files of this process not yet renamed into place


_COMPLETED: list = []  # traces this process moved into place (what an interrupt must not call "not kept")


def check_interrupt() -> None:
    """Python may deliver a Ctrl-C's KeyboardInterrupt inside a garbage-collector callback, where it is
    printed and dropped; the CLI's handler also sets a flag, checked at every layer and before a trace is
    moved into place, so an interrupted recording is never completed."""
    if INTERRUPT["seen"]:
        raise KeyboardInterrupt


def remove_partial_files() -> list:
    """Delete this process's unfinished temporary traces (after an interrupt); returns their paths."""
    gone = []
    for tmp in list(_PARTIAL):
        try:
            os.unlink(tmp)
            gone.append(str(tmp))
        except FileNotFoundError:
            pass
        _PARTIAL.discard(tmp)
    return gone


def n_completed() -> int:
    """How many traces this process has finished so far (a start index for ``completed_traces``)."""
    return len(_COMPLETED)


def completed_traces(start: int = 0) -> list:
    """Traces this process finished and moved into place (from the ``start``-th on) that are still there."""
    return [p for p in _COMPLETED[start:] if os.path.exists(p)]


class TraceExistsError(PrefillDiffError):
    """The target trace exists and --force was not given."""


def _renameat2_noreplace(src: str, dst: str) -> bool:
    """rename(src, dst) failing if dst exists (Linux renameat2 RENAME_NOREPLACE); False if unavailable here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_NOREPLACE = -100, 1
    if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), dst)
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def place(tmp, path, force: bool) -> None:
    """Move a finished trace into place atomically. Without ``force`` it never replaces a file, not even one
    that appeared while this trace was recorded (two `record`s to one path at once): a hard link to the target
    fails if the target exists (then the temporary name is removed); where hard links are not supported,
    renameat2(RENAME_NOREPLACE); where neither is, a check just before the rename (the one window left)."""
    tmp, path = str(tmp), str(path)
    if force:
        os.replace(tmp, path)
        return
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system
            if not _renameat2_noreplace(tmp, path):
                if os.path.exists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
            return
        os.unlink(tmp)
    except FileExistsError:
        raise TraceExistsError(f"{path} appeared while this trace was being recorded (another process writing "
                               "the same path?); it was not replaced and this trace was not kept; pass --force to "
                               "overwrite") from None


def partial(tmp) -> None:
    """``tmp`` is a trace being written: an interrupt removes it (registered before the file exists)."""
    _PARTIAL.add(tmp)


def settled(tmp) -> None:
    """``tmp`` is gone or moved into place: no longer this process's to remove."""
    _PARTIAL.discard(tmp)


def completed(path) -> None:
    """The trace at ``path`` was moved into place by this process."""
    _COMPLETED.append(str(path))
