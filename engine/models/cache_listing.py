"""What the converted-model cache holds, and pruning it: the ``prefill-diff cache`` command's library.

``listing()`` walks the cache's ``models/`` directory (engine/models/model_cache.py lays it out) and says of each
item what it is (an entry of a kind, a temporary directory, a leftover of a deletion, something not ours), its
size on disk, its last use and its state, each entry verified as a run verifies it; nothing is created.
``prune()`` decides from that listing what goes, and removes it under the locks runs and writers hold, never
following a link and never removing another user's files; ``parse_size`` reads ``--max-size``.
"""
from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass

from ..shared.errors import ConfigError
from ..shared.untrusted import visible
from .model_cache import (LOCK_SUFFIX, MANIFEST, TMP_PREFIX, TRASH_PREFIX, _NOFOLLOW, _delete, _existing_models_dir,
                          _open_for_lock, _read_manifest, _remove_locked, _Stale, _Unusable, _verify, _writer_running,
                          root)

_ENTRY_NAME = re.compile(r"([0-9a-f]{64})-([a-z0-9_]+)")
UNLOCKED_AGE = 86400  # seconds: a temporary directory without a lock file (an earlier version's) is abandoned after


@dataclass(frozen=True)
class Item:
    """One thing in the cache's ``models/`` directory, as ``listing()`` found it."""
    name: str                # its name in models/ (a temporary directory's, without .lock)
    paths: tuple[str, ...]   # what it is made of: a directory (or what stands in its place), a lock file
    kind: str                # an entry's kind (native, transformers), temporary, discarded, or unknown
    state: str               # intact, damaged, stale (an entry); writing, abandoned (temporary); leftover; unknown
    why: str                 # what the state rests on, as a phrase after the item: "is stale (...)"
    size: int                # bytes on disk (allocated blocks, as du counts them)
    used: float              # when last used or written (mtime, seconds since the epoch)
    source: str | None       # the file an entry was converted from, as its writer recorded it (None: not recorded)
    source_sha256: str | None
    owner: str | None        # the owner of a file in it that is not the current user's (None: all are ours)


@dataclass(frozen=True)
class Listing:
    """The cache's place (None: the cache is off), its models/ directory (None: nothing stored yet), its items."""
    root: str | None
    models: str | None
    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(i.size for i in self.items)


def listing(now: float | None = None) -> Listing:
    """What the cache holds, most recently used first, each entry verified as a run would verify it. Creates
    nothing; a directory that is not ours is refused (ConfigError) as a run refuses it."""
    where = root()
    models = None if where is None else _existing_models_dir(where)
    if models is None:
        return Listing(where, None, ())
    now = time.time() if now is None else now
    names = set(os.listdir(models))
    locked = {n[:-len(LOCK_SUFFIX)] for n in names if n.startswith(TMP_PREFIX) and n.endswith(LOCK_SUFFIX)}
    items = [_item(models, name, name in locked, now) for name in (names - {n + LOCK_SUFFIX for n in locked}) | locked]
    return Listing(where, models, tuple(sorted((i for i in items if i is not None), key=lambda i: -i.used)))


def _item(models: str, name: str, locked: bool, now: float) -> Item | None:
    """The item ``name`` in ``models``, None when it went away meanwhile."""
    path = os.path.join(models, name)
    paths = tuple(p for p in (path, path + LOCK_SUFFIX if locked else None) if p and os.path.lexists(p))
    if not paths:
        return None
    size, used, owner = _usage(paths)
    kind, state, why, source, digest = "unknown", "unknown", "is not made by prefill-diff (left alone)", None, None
    if name.startswith(TMP_PREFIX):
        kind = "temporary"
        state, why = _writer_state(path, locked, used, now)
    elif name.startswith(TRASH_PREFIX):
        kind, state, why = "discarded", "leftover", "is left over from deleting an unusable entry"
    elif m := _ENTRY_NAME.fullmatch(name):
        digest, kind = m.groups()
        state, why = _entry_state(path, digest)
        source = _recorded_source(path)
    return Item(name, paths, kind, state, why, size, used, source, digest, owner)


def _entry_state(path: str, digest: str) -> tuple[str, str]:
    """intact, damaged or stale, by the verification every run makes, and why."""
    try:
        _verify(path, digest)
    except _Stale as e:
        return "stale", str(e)
    except _Unusable as e:
        return "damaged", str(e)
    except OSError as e:
        return "damaged", f"is damaged (cannot read it: {e.strerror or e})"
    return "intact", ""


def _recorded_source(path: str) -> str | None:
    if os.path.islink(path):
        return None
    try:
        source = _read_manifest(path)["body"].get("source")
    except (_Unusable, OSError):
        return None
    return source if isinstance(source, str) else None


def _writer_state(tmp: str, locked: bool, mtime: float, now: float) -> tuple[str, str]:
    """writing or abandoned: whether the conversion writing ``tmp`` still holds its lock, and why."""
    if not locked:
        if now - mtime > UNLOCKED_AGE:
            return "abandoned", "has no lock file and was not changed for a day (left by an earlier version)"
        return "writing", "has no lock file (an earlier version's conversion?): taken for abandoned after a day"
    running = _writer_running(tmp + LOCK_SUFFIX)
    if running is None:
        return "writing", "has a lock that cannot be tested here: taken for a running conversion"
    if running:
        return "writing", "is being written by a running conversion"
    return "abandoned", "was left by a conversion that is no longer running"


def _usage(paths: tuple[str, ...]) -> tuple[int, float, str | None]:
    """Bytes on disk of ``paths`` and all they hold (links not followed), the first one's mtime, and the owner of
    the first file found that is not the current user's."""
    size, foreign, me = 0, None, os.geteuid()
    for st in (st for p in paths for st in _walk(p)):
        size += getattr(st, "st_blocks", 0) * 512 or st.st_size
        if st.st_uid != me and foreign is None:
            foreign = st.st_uid
    try:
        used = os.lstat(paths[0]).st_mtime
    except OSError:
        used = 0.0
    return size, used, None if foreign is None else _user(foreign)


def _walk(path: str):
    """lstat of ``path`` and, for a directory, of everything under it; what cannot be read is skipped."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    yield st
    if stat.S_ISDIR(st.st_mode):
        try:
            names = os.listdir(path)
        except OSError:
            return
        for name in names:
            yield from _walk(os.path.join(path, name))


def _user(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


@dataclass(frozen=True)
class Decision:
    """What prune did with an item (or, in a dry run, would do), and why."""
    item: Item
    removed: bool
    why: str


@dataclass(frozen=True)
class Pruned:
    """prune's outcome: the listing it started from, what it removed and what it kept that it might have."""
    found: Listing
    decisions: tuple[Decision, ...]
    dry_run: bool

    @property
    def freed(self) -> int:
        return sum(d.item.size for d in self.decisions if d.removed)

    @property
    def left(self) -> int:
        return self.found.total - self.freed


def prune(everything: bool = False, older_than: float | None = None, max_size: int | None = None,
          dry_run: bool = False, now: float | None = None) -> Pruned:
    """Remove damaged and stale entries, abandoned temporary directories and leftovers; with ``everything``
    every entry, with ``older_than`` (days) the entries not used for that long, with ``max_size`` (bytes) the
    least recently used entries until the cache fits. Never removes another user's files, an entry a run is
    loading, a temporary directory whose conversion is running, or anything not made by prefill-diff."""
    if older_than is not None and not older_than >= 0:
        raise ConfigError(f"--older-than must be a number of days >= 0 (got {older_than:g})")
    if max_size is not None and max_size < 0:
        raise ConfigError(f"--max-size must be >= 0 (got {max_size})")
    now = time.time() if now is None else now
    found = listing(now)
    plan = _plan(found.items, everything, older_than, max_size, now)
    if not dry_run:
        plan = [_carry_out(found.models, d) if d.removed else d for d in plan]
    return Pruned(found, tuple(plan), dry_run)


def _plan(items, everything: bool, older_than: float | None, max_size: int | None, now: float) -> list[Decision]:
    """The decisions on every item that goes, or that would go but stays (and why)."""
    out = []
    for it in items:
        go = _why_go(it, everything, older_than, now)
        if go is not None:
            stay = _why_stay(it)
            out.append(Decision(it, stay is None, go if stay is None else stay))
    if max_size is not None:
        left = sum(it.size for it in items) - sum(d.item.size for d in out if d.removed)
        considered = {d.item.name for d in out}
        for it in sorted(items, key=lambda i: i.used):  # least recently used first
            if left <= max_size:
                break
            if it.name not in considered and it.state == "intact" and _why_stay(it) is None:
                out.append(Decision(it, True, "was least recently used, and the cache is larger than --max-size"))
                left -= it.size
    return out


def _why_go(it: Item, everything: bool, older_than: float | None, now: float) -> str | None:
    if it.state != "intact":  # damaged, stale, abandoned, leftover; and what stays anyway (writing, unknown)
        return it.why
    if everything:
        return "--all asks for every entry"
    days = (now - it.used) / 86400
    if older_than is not None and days > older_than:
        return f"was not used for {days:.0f} day{'' if round(days) == 1 else 's'} (--older-than {older_than:g})"
    return None


def _why_stay(it: Item) -> str | None:
    if it.state in ("writing", "unknown"):
        return it.why
    if it.owner is not None:
        return f"is owned by {it.owner}, not by you: not removed"
    return None


def _carry_out(models: str, d: Decision) -> Decision:
    """Remove the item, or say why it stayed after all (in use, or the removal failed)."""
    try:
        busy = _remove(models, d.item)
    except OSError as e:
        busy = f"could not be removed ({e.strerror or e})"
    return d if busy is None else Decision(d.item, False, busy)


def _remove(models: str, it: Item) -> str | None:
    """Remove ``it``, taking the lock its writer or readers hold; None when done, else why it stays."""
    path = os.path.join(models, it.name)
    if it.kind == "temporary" and path + LOCK_SUFFIX in it.paths:
        return _remove_locked(models, path, path + LOCK_SUFFIX)
    if it.kind in ("temporary", "discarded"):
        _delete(models, path)
        return None
    return _remove_entry(models, path)


def _remove_entry(models: str, path: str) -> str | None:
    """An entry, when no run holds its manifest's lock (taken while removing); a link or a file in an entry's
    place is unlinked, never followed."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError:  # a link, a file, or gone
        _delete(models, path)
        return None
    try:
        try:
            mfd = _open_for_lock(MANIFEST, dir_fd=dfd)
        except OSError:
            mfd = None  # no manifest: no run can use it
        if mfd is not None:
            try:
                fcntl.flock(mfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(mfd)
                return "is in use by a running prefill-diff"
        try:
            _delete(models, path)
        finally:
            if mfd is not None:
                os.close(mfd)
    finally:
        os.close(dfd)
    return None


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes from a size such as 500M, 2G, 2GiB (powers of 1024) or 2GB (powers of 1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"--max-size must be a size such as 500M, 2G, 2GiB or 2GB (got {visible(text)!r})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
