"""Who made a trace or a report, with what command, and when: the ``provenance`` both carry.

These three fields differ between two otherwise identical runs by design, so reproducibility checks compare
everything else. The time honours ``SOURCE_DATE_EPOCH`` (https://reproducible-builds.org/specs/source-date-epoch/),
so a build that sets it records the same time on every run. Does not import torch.
"""
from __future__ import annotations

import functools
import os
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata

from ..engine.shared.errors import ConfigError

EPOCH_VAR = "SOURCE_DATE_EPOCH"
ARGV_LIMIT = 8192  # characters of the command line kept: a trace's metadata strings are bounded (dumps/metacheck.py)
LATEST = 253402300799  # 9999-12-31T23:59:59Z, the last second ISO 8601's four-digit year can write


@functools.lru_cache(maxsize=None)
def version() -> str:
    """prefill-diff's installed version ("unknown" when run from a source tree that was never installed)."""
    try:
        return metadata.version("prefill-diff")
    except metadata.PackageNotFoundError:
        return "unknown"


def timestamp() -> str:
    """Now, or SOURCE_DATE_EPOCH when set, in UTC as ISO 8601 to the second: 2025-01-31T12:00:00Z."""
    raw = os.environ.get(EPOCH_VAR, "").strip()
    if not raw:
        return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > LATEST:
        raise ConfigError(f"{EPOCH_VAR} must be a whole number of seconds since 1970-01-01 UTC, at most {LATEST} "
                          f"(got {raw[:40]!r})")
    return datetime.fromtimestamp(int(raw), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(argv=None) -> str:
    """The process's command line as one shell-quoted text (the program by its name, or ``python -m MODULE``);
    undecodable bytes as \\x escapes, at most ARGV_LIMIT characters."""
    args = list(sys.argv if argv is None else argv)
    if args:
        orig = getattr(sys, "orig_argv", [])
        n = len(args)
        if argv is None and len(orig) > n and orig[-n - 1] == "-m":  # python -m MODULE ...
            args[0:1] = ["python", "-m", orig[-n]]
        else:
            args[0] = os.path.basename(args[0]) or args[0]
    text = shlex.join(os.fsencode(a).decode("utf-8", "backslashreplace") for a in args)
    if len(text) > ARGV_LIMIT:
        text = text[:ARGV_LIMIT] + f" … ({len(text)} characters in all)"
    return text


def provenance() -> dict:
    """{"version", "argv", "time"}: this prefill-diff's version, the command line and the time (UTC)."""
    return {"version": version(), "argv": command_line(), "time": timestamp()}
