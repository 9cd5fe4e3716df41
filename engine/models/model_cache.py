"""A cache of converted models: a GGUF file is parsed, dequantised and its tokenizer built once, not every run.

Where: ``$PREFILL_DIFF_CACHE`` (the ``--model-cache`` option sets it), else ``$XDG_CACHE_HOME/prefill-diff``,
else ``~/.cache/prefill-diff``; the value ``off`` disables the cache. Layout under that root::

    prefill-diff-cache.json       marks the directory as ours: a non-empty directory without it is refused
    models/<sha256 of the source file>-<kind>/
        manifest.json             the source's sha256 and size (and its path, for people), the format and
                                  package versions, what the kind records (ModelArgs, weights digest), the size
                                  and sha256 of every other file, and its own sha256
        ...                       the converted files (flat: no subdirectories, no links)
    models/.tmp-<uuid>/           an entry being written, and beside it .tmp-<uuid>.lock, whose lock (flock)
                                  its writer holds until the directory is renamed into place or removed
    models/.trash-<uuid>/         an unusable entry being deleted

Kinds: ``native`` (our float32 master weights under our names, and the tokenizer transformers built from the
GGUF metadata, saved as tokenizer files) and ``transformers`` (the model transformers' own GGUF loader built,
saved with ``save_pretrained``: config.json + model.safetensors). They are kept apart on purpose: the
transformers engine is the implementation we did not write, so its weights come from its own GGUF reader,
never from ours. What each kind's files hold is written and read in engine/models/cache_entries.py, whose source
(with gguf_loader.py's) versions every entry: this module's storage and cache_listing.py's listing and pruning
can change without making the entries stale.

Every use verifies the entry (and marks it used: its directory's mtime): the manifest is intact and names
exactly the files present, each a regular file (never a link) of the recorded size and sha256, made from a
source with the sha256 we just computed, by the same format and package versions. A damaged or stale entry
is reported on stderr in one line, moved aside and rebuilt. Entries are written to a temporary directory
inside ``models/`` and renamed into place, so a reader never sees half an entry and concurrent runs cannot
corrupt each other (a losing rename discards its copy). Nothing outside the cache directory is ever written
or removed.

engine/models/cache_listing.py's ``listing()`` and ``prune()`` (the ``prefill-diff cache`` command) list what
``models/`` holds, with sizes and whether each entry verifies, and remove entries, never following a link. A
temporary directory is removed only when no writer holds its lock (the lock dies with its process), an entry
only when no run holds it: a run holds a shared lock on the manifest while it verifies and loads the entry.
Files of another user are listed, never removed.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import stat
import sys
import uuid
from contextlib import contextmanager
from typing import Callable, NamedTuple

from ..shared.errors import ConfigError
from ..shared.untrusted import visible

ENV = "PREFILL_DIFF_CACHE"
OFF = "off"
MARKER = "prefill-diff-cache.json"
MANIFEST = "manifest.json"
FORMAT = 1  # bump when a conversion changes what it writes: older entries become stale and are rebuilt
_CHUNK = 4 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MANIFEST_LIMIT = 1 << 20
TMP_PREFIX, LOCK_SUFFIX, TRASH_PREFIX = ".tmp-", ".lock", ".trash-"  # an entry being written; being deleted


class Entry(NamedTuple):
    """A verified cache entry: its directory and what its writer recorded."""
    dir: str
    meta: dict


class _Unusable(Exception):
    """An entry that must not be used (damaged or stale); the message says why."""


class _Stale(_Unusable):
    """An entry made by other code (another format, our code or package versions)."""


def configure(value: str) -> None:
    """The ``--model-cache`` option: a directory, or ``off``. Set as the environment variable, so that
    processes this one starts (tensor-parallel ranks) use the same cache."""
    if not value.strip():
        raise ConfigError("--model-cache needs a directory or 'off' (got an empty value)")
    os.environ[ENV] = value


def root() -> str | None:
    """The cache directory, or None when the cache is off."""
    value = os.environ.get(ENV, "").strip()
    if value == OFF:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "prefill-diff")


def file_sha256(path: str, follow: bool = False) -> str:
    """sha256 of a file's bytes, read in chunks; a link is refused (O_NOFOLLOW) unless ``follow``."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | (0 if follow else _NOFOLLOW))
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


_SOURCE_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> sha256: one hash per file per process


def source_sha256(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _SOURCE_DIGESTS:
        _SOURCE_DIGESTS[key] = file_sha256(path, follow=True)  # the user's file: a link to it is fine
    return _SOURCE_DIGESTS[key]


# our code that makes an entry's files (not this module's storage, nor cache_listing.py's listing and pruning:
# changing those leaves every entry's content as it was)
_CONVERTERS = ("gguf_loader.py", "cache_entries.py")


def versions() -> dict:
    """The code that makes a conversion (ours, by the sha256 of its source, and the packages it calls): an entry
    made by other code is stale."""
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in _CONVERTERS:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    out = {"format": FORMAT, "code": h.hexdigest()[:16]}
    for pkg in ("gguf", "transformers", "safetensors", "tokenizers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def cached(source: str, kind: str, convert: Callable, save: Callable, load: Callable):
    """``load(entry)`` from a verified entry for ``source``'s bytes, else ``convert()``, stored with
    ``save(value, directory)`` (it writes the files and returns what to record, or None to store nothing).

    With the cache off this is ``convert()``. A cache that cannot be written is reported and skipped."""
    where = root()
    if where is None:
        return convert()
    try:
        models = _models_dir(where)
        digest = source_sha256(source)
    except OSError as e:  # an unwritable cache directory, an unreadable source (its loader says why)
        _say(f"cannot use the model cache in {where} ({e.strerror or e}); running without it")
        return convert()
    name = f"{digest}-{kind}"
    with _held(os.path.join(models, name)) as there:  # prune leaves the entry alone while it is loaded
        entry = _lookup(models, name, digest) if there else None
        if entry is _UNTRUSTED:  # another user's, or writable by others: never loaded, never replaced
            return convert()
        if entry is not None:
            return load(entry)
    value = convert()
    reclaim(models)
    try:
        _store(models, name, digest, os.path.getsize(source), lambda d: save(value, d), source=source)
    except Exception as e:  # a full or read-only disk, said by the OS or by a writer's own error (safetensors)
        why = getattr(e, "strerror", None) or f"{type(e).__name__}: {str(e)[:200]}"
        _say(f"cannot write the model cache in {models} ({why}); running without it")
    return value


def reclaim(models: str) -> int:
    """Remove the temporary directories of conversions that are no longer running (killed: their lock file is
    there and nobody holds it), ours only, before writing a new entry; returns how many. Never one whose
    conversion still holds its lock, nor one without a lock file (prune decides those)."""
    gone = 0
    try:
        names = os.listdir(models)
    except OSError:
        return 0
    for name in names:
        tmp = os.path.join(models, name)
        if not name.startswith(TMP_PREFIX) or name.endswith(LOCK_SUFFIX) or name + LOCK_SUFFIX not in names:
            continue
        try:
            if os.lstat(tmp).st_uid != os.getuid() or os.lstat(tmp + LOCK_SUFFIX).st_uid != os.getuid():
                continue
            if _writer_running(tmp + LOCK_SUFFIX) is False:
                gone += _remove_locked(models, tmp, tmp + LOCK_SUFFIX) is None
        except OSError:
            continue
    return gone


def _say(message: str) -> None:
    print(f"prefill-diff: {visible(message)}", file=sys.stderr, flush=True)


def _models_dir(where: str) -> str:
    """``where``/models, after making sure ``where`` is ours (made ours when new or empty)."""
    os.makedirs(where, exist_ok=True)
    _check_dir(where)
    marker = os.path.join(where, MARKER)
    if not os.path.lexists(marker):
        _check_empty(where)
        try:  # created in place (O_EXCL), so a concurrent run never sees a non-empty directory without it
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump({"prefill_diff_model_cache": FORMAT}, f)
        except FileExistsError:
            pass
    _check_marker(where)
    models = os.path.join(where, "models")
    try:
        os.mkdir(models)
    except FileExistsError:
        pass
    _check_models(models)
    return models


def _existing_models_dir(where: str) -> str | None:
    """``where``/models of an existing cache, None when there is none yet; the same checks as ``_models_dir``,
    but nothing is created."""
    if not os.path.lexists(where):
        return None
    _check_dir(where)
    if not os.path.lexists(os.path.join(where, MARKER)):
        _check_empty(where)
        return None
    _check_marker(where)
    models = os.path.join(where, "models")
    if not os.path.lexists(models):
        return None
    _check_models(models)
    return models


def _check_dir(where: str) -> None:
    if not os.path.isdir(where):
        raise ConfigError(f"model cache {visible(where)} is not a directory (set --model-cache DIR or off)")


def _check_empty(where: str) -> None:
    """A directory without our marker is ours to take only when empty."""
    if os.listdir(where):
        raise ConfigError(f"model cache {visible(where)} is not a prefill-diff cache (no {MARKER}) and is "
                          "not empty: refusing to use it (choose another --model-cache DIR, or off)")


def _check_marker(where: str) -> None:
    if not _is_regular(os.path.join(where, MARKER)):
        raise ConfigError(f"model cache {visible(where)}: {MARKER} is not a regular file: refusing to use it")


def _check_models(models: str) -> None:
    if os.path.islink(models) or not os.path.isdir(models):
        raise ConfigError(f"model cache {visible(models)} is not a directory of ours (a link or a file): "
                          "refusing to use it")


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_UNTRUSTED = object()  # _lookup: an entry that is not ours to trust


def _lookup(models: str, name: str, digest: str):
    """The verified entry, None when there is none; a damaged or stale one is reported and moved aside; an entry
    another user owns or others may write (its directory or a file in it) is reported and left alone:
    _UNTRUSTED (its manifest could have been recomputed over edited weights, as ssh ignores such key files)."""
    path = os.path.join(models, name)
    if not os.path.lexists(path):
        return None
    why = _untrusted(path)
    if why is not None:
        _say(f"model cache entry {path} {why}: not used; converting afresh (and not caching: the entry's name is "
             "taken)")
        return _UNTRUSTED
    try:
        entry = Entry(path, _verify(path, digest))
    except _Unusable as why:
        _say(f"model cache entry {path} {why}; rebuilding it")
        _discard(models, path)
        return None
    try:
        os.utime(path, follow_symlinks=False)  # marks it used (prune --older-than, --max-size)
    except OSError:
        pass  # another user's entry, a read-only cache: still used
    return entry


def _untrusted(path: str) -> str | None:
    """Why the entry at ``path`` is not to be trusted (owned by another user, or writable by group or others:
    the directory or any file in it), or None."""
    me = os.getuid()
    try:
        paths = [path] + [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
        for p in paths:
            st = os.lstat(p)
            if st.st_uid != me:
                return f"is owned by uid {st.st_uid}, not by you ({me})" if p == path else \
                    f"holds {os.path.basename(p)}, owned by uid {st.st_uid}, not by you ({me})"
            if st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode):
                return f"{'is' if p == path else 'holds ' + os.path.basename(p) + ','} writable by others " \
                       f"(mode {stat.S_IMODE(st.st_mode):o})"
    except OSError:
        return None  # gone or unreadable: verification says so
    return None


@contextmanager
def _held(path: str):
    """A shared lock on entry ``path``'s manifest while a run verifies and loads it (prune takes it exclusively
    to remove the entry); yields False when a prune removed the entry before the lock was taken."""
    fds: list[int] = []
    try:
        yield _lock_shared(path, fds)
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _lock_shared(path: str, fds: list[int]) -> bool:
    try:
        fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW))
        fds.append(os.open(MANIFEST, os.O_RDONLY | _NOFOLLOW, dir_fd=fds[0]))
    except OSError:
        return True  # no entry, not a directory, no manifest: _lookup says which
    try:
        fcntl.flock(fds[1], fcntl.LOCK_SH)  # waits while a prune removes the entry
    except OSError:
        return True  # a file system without locks: used unlocked
    return _same_file(path, fds[0])


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced since it was opened)."""
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _verify(path: str, digest: str) -> dict:
    """What the entry's writer recorded, after checking every byte of the entry; raises _Unusable."""
    if os.path.islink(path) or not os.path.isdir(path):
        raise _Unusable("is damaged (not a directory)")
    manifest = _read_manifest(path)
    body = manifest["body"]
    if body.get("source_sha256") != digest:
        raise _Unusable(f"is damaged (made from source sha256 {str(body.get('source_sha256'))[:16]}…, "
                        f"the name says {digest[:16]}…)")
    made, now = body.get("versions"), versions()
    if made != now:
        made = made if isinstance(made, dict) else {}
        differ = ", ".join(f"{k} {made.get(k)} -> {now.get(k)}" for k in sorted(set(made) | set(now))
                           if made.get(k) != now.get(k))
        raise _Stale(f"is stale (made by other code: {differ})")
    files = body.get("files")
    if not isinstance(files, dict):
        raise _Unusable("is damaged (its manifest lists no files)")
    present = set(os.listdir(path)) - {MANIFEST}
    if present != set(files):
        raise _Unusable(f"is damaged (files {sorted(present ^ set(files))} differ from its manifest)")
    for fname, want in sorted(files.items()):
        fpath = os.path.join(path, fname)
        st = os.lstat(fpath)
        if not stat.S_ISREG(st.st_mode):
            raise _Unusable(f"is damaged ({fname} is not a regular file)")
        if not isinstance(want, dict) or st.st_size != want.get("size"):
            raise _Unusable(f"is damaged ({fname} has {st.st_size} bytes, its manifest says "
                            f"{want.get('size') if isinstance(want, dict) else want})")
        if file_sha256(fpath) != want.get("sha256"):
            raise _Unusable(f"is damaged ({fname}: sha256 differs from its manifest)")
    return body.get("meta") or {}


def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not _is_regular(mpath):
        raise _Unusable(f"is damaged (no {MANIFEST})")
    try:
        fd = os.open(mpath, os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_MANIFEST_LIMIT + 1)
        manifest = json.loads(raw)
        body = manifest["body"]
        ok = len(raw) <= _MANIFEST_LIMIT and isinstance(body, dict) and manifest["sha256"] == _body_sha256(body)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise _Unusable(f"is damaged ({MANIFEST} is unreadable or does not match its own sha256)")
    return manifest


def _body_sha256(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _discard(models: str, path: str) -> None:
    """Delete an unusable entry (quietly: another run may have moved it first)."""
    try:
        _delete(models, path)
    except OSError:
        pass


def _delete(models: str, path: str) -> None:
    """Move ``path`` aside (atomically, so no reader sees it half-deleted), then delete it, never following a
    link; a path that is already gone is no error."""
    trash = os.path.join(models, f"{TRASH_PREFIX}{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    if os.path.islink(trash) or not os.path.isdir(trash):
        os.unlink(trash)
    else:
        shutil.rmtree(trash)  # removes links inside, never what they point at


@contextmanager
def _writing(models: str):
    """A new temporary directory in ``models``, and beside it the lock file its writer holds until the directory
    is renamed into place or removed: prune removes a temporary directory only when nobody holds its lock."""
    tmp, fd = _new_lock(models)
    try:
        os.mkdir(tmp, 0o700)
        yield tmp
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        _unlink_quietly(tmp + LOCK_SUFFIX)
        os.close(fd)


def _new_lock(models: str) -> tuple[str, int]:
    """A temporary directory's path (not made yet) and its lock file, created and locked exclusively."""
    while True:
        tmp = os.path.join(models, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(tmp + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits if a prune took it between its creation and now
            if _same_file(tmp + LOCK_SUFFIX, fd):
                return tmp, fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # that prune removed it: make another


def _writer_running(lock: str) -> bool | None:
    """Whether a writer holds ``lock``; None when that cannot be told (a file system without locks)."""
    try:
        fd = os.open(lock, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove_locked(models: str, tmp: str, lock: str) -> str | None:
    """A temporary directory and its lock file, when no writer holds the lock (taken while removing)."""
    fd = _open_for_lock(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "is being written by a running conversion"
    try:
        _delete(models, tmp)
        os.unlink(lock)
    finally:
        os.close(fd)
    return None


def _open_for_lock(path: str, dir_fd: int | None = None) -> int:
    """``path`` opened to take its lock: for writing where allowed (some network file systems lock only those)."""
    try:
        return os.open(path, os.O_RDWR | _NOFOLLOW, dir_fd=dir_fd)
    except PermissionError:
        return os.open(path, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)


def _store(models: str, name: str, digest: str, size: int, write: Callable[[str], dict | None],
           source: str | None = None) -> None:
    """Write an entry into a temporary directory, record every file in its manifest, rename it into place.

    ``source``: the file it was converted from, recorded for people (``prefill-diff cache``), never verified."""
    with _writing(models) as tmp:
        meta = write(tmp)
        if meta is None:
            return
        files = {}
        for fname in sorted(os.listdir(tmp)):
            fpath = os.path.join(tmp, fname)
            st = os.lstat(fpath)
            if not stat.S_ISREG(st.st_mode):  # our writers write flat files; anything else is a bug
                raise RuntimeError(f"model cache writer left {fname!r}, not a regular file")
            if st.st_mode & 0o022:  # whatever the umask: an entry others may write is not trusted (_untrusted)
                os.chmod(fpath, stat.S_IMODE(st.st_mode) & ~0o022)
            files[fname] = {"size": st.st_size, "sha256": file_sha256(fpath)}
        body = {"source_sha256": digest, "source_size": size, "versions": versions(), "files": files, "meta": meta}
        if source is not None:
            body["source"] = os.path.abspath(source)
        fd = os.open(os.path.join(tmp, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"body": body, "sha256": _body_sha256(body)}, f, sort_keys=True, indent=1)
        try:
            os.rename(tmp, os.path.join(models, name))
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # another run stored the same entry first: keep theirs (_writing removes this copy)
