"""Untrusted input, handled in one place: part of the shared leaf (engine/shared/).

Text shown to people is made visible, never markup; files that may not be files are refused before they are
read; integers that may not fit are refused by their range.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
import unicodedata

from .errors import ConfigError, PrefillDiffError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
CONFIG_LIMIT = 1 << 20  # bytes of TOML a config or tolerance file may hold

# bidirectional overrides and isolates: invisible, and they reorder what a terminal shows ("Trojan source")
_BIDI = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A)) | {0x200E, 0x200F, 0x061C}


def _show(ch: str) -> str:
    o = ord(ch)
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def visible(text) -> str:
    """Foreign text made safe to print: control characters (ESC, CR, BEL, DEL, C1, newlines, tabs),
    bidirectional overrides and lone surrogates are written as escapes (\\x1b, \\u202e) instead of acting
    on the terminal. Markup is not touched here: print the result as plain text (rich.text.Text)."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        o = ord(ch)
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs") or o in _BIDI or (cat == "Cf" and o in (0xFEFF,)) or cat in ("Zl", "Zp") \
                or (o & 0xFFFE) == 0xFFFE or 0xFDD0 <= o <= 0xFDEF:  # noncharacters: XML 1.0 forbids U+FFFE/F
            out.append(_show(ch))
        else:
            out.append(ch)
    return "".join(out)


def regular_file(path, what: str, limit: int | None = None) -> str:
    """Refuse anything that is not a regular file (FIFO, device, socket, directory, a link to one) *before*
    opening it: opening a FIFO blocks, and /dev/zero never ends. With ``limit``, refuse larger files."""
    p = str(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise PrefillDiffError(f"{p}: no such {what}") from None
    except OSError as e:
        raise PrefillDiffError(f"{p}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a character device" if stat.S_ISCHR(st.st_mode) else "a block device"
                if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        via = f" (a link to {os.path.realpath(p)})" if os.path.islink(p) else ""
        raise PrefillDiffError(f"{p}: the {what} is {kind}{via}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise PrefillDiffError(f"{p}: the {what} is {st.st_size} bytes, over the {limit}-byte limit")
    return p


def strict_json(raw: bytes):
    """UTF-8 JSON as JSON defines it: NaN, Infinity and -Infinity (which Python's parser accepts) are refused with
    ValueError, as are bytes that are not UTF-8 (UnicodeDecodeError is a ValueError); nesting too deep for the
    parser raises RecursionError."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")
    return json.loads(raw.decode("utf-8"), parse_constant=refuse)


def name_max(directory: str) -> int:
    """The longest file name (in bytes) the file system holding ``directory`` allows (255 where it does not say)."""
    try:
        return os.pathconf(directory or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_name_length(path, what: str) -> None:
    """Refuse an output path whose file name is longer than its file system allows, before any work."""
    d, name = os.path.split(os.path.abspath(os.fspath(path)))
    n, limit = len(os.fsencode(name)), name_max(d)
    if n > limit:
        raise PrefillDiffError(f"cannot write {what}: its file name is {n} bytes, more than the {limit} the file "
                               f"system allows ({visible(name[:40])}...)")


def partial_sibling(path) -> str:
    """A hidden name beside ``path`` to write it under before renaming it into place: ``.NAME.partial-PID-HEX``,
    or ``.partial-PID-HEX`` where that would be a longer file name than the file system allows."""
    d, name = os.path.split(os.fspath(path))
    tag = f"partial-{os.getpid()}-{secrets.token_hex(4)}"
    full = f".{name}.{tag}"
    if len(os.fsencode(full)) > name_max(os.path.abspath(d or ".")):
        full = f".{tag}"
    return os.path.join(d, full)


def read_small_file(path, what: str, limit: int = CONFIG_LIMIT) -> bytes:
    """The bytes of a small regular file (config, tolerance); never blocks, never reads past ``limit``."""
    p = regular_file(path, what, limit)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)  # the path may have been swapped for a FIFO since the check
        if not stat.S_ISREG(st.st_mode):
            raise PrefillDiffError(f"{p}: the {what} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise PrefillDiffError(f"{p}: the {what} is over the {limit}-byte limit")
    return data


def check_int64(value, what: str) -> int:
    """An integer that fits int64, or ConfigError naming where it is."""
    if not INT64_MIN <= value <= INT64_MAX:
        shown = str(value) if len(str(value)) <= 40 else str(value)[:20] + "…" + f" ({len(str(value))} digits)"
        raise ConfigError(f"{what} is {shown}, outside the 64-bit integer range")
    return value


def check_prompt_text(prompt: str, index: int) -> None:
    """A prompt must be valid UTF-8 text: bytes that are not arrive from the command line as lone surrogates
    (Python's surrogateescape); refuse them naming the byte offset, before any tokenizer sees them."""
    for i, ch in enumerate(prompt):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            offset = len(prompt[:i].encode("utf-8", "surrogateescape"))
            raw = ch.encode("utf-8", "surrogateescape") if 0xDC80 <= ord(ch) <= 0xDCFF else None
            byte = f"byte 0x{raw[0]:02x}" if raw else f"code point U+{ord(ch):04X}"
            raise ConfigError(f"prompt {index} is not valid UTF-8 text ({byte} at byte offset {offset})")
