"""Where the commands' text goes: the standard streams made safe for any encoding and free of trailing spaces.

Every command runs with ``sys.stdout`` and ``sys.stderr`` wrapped in ``TextOut`` (``text_streams``, entered by
the CLI's group for each invocation), so the rich consoles, ``click.echo`` and the error lines all pass through
one place. A character the stream's encoding cannot hold (``PYTHONIOENCODING=ascii``, an ASCII locale) is
written as an ASCII stand-in (``STANDINS``: ✗ x, the sparkline's blocks an ASCII ramp, box drawing - | +,
… ...) or else as ?, never raised as an error: the verdict and the exit status survive. Rich lays out for a
Unicode stream (``TextOut.encoding`` is UTF-8: it takes any text), so tables keep the widths they were fitted
to; most stand-ins are one character for one, so columns and panel edges stay aligned.
Lines lose the trailing spaces rich pads table cells and panels with, so piped output has none.
"""
from __future__ import annotations

import codecs
import contextlib
import io
import os
import re
import sys
import unicodedata

SPARK_ASCII = "_-~=+*#@"  # the sparkline's eight levels, lowest first
STANDINS = {
    "✗": "x", "✓": "v", "…": "...", "—": "-", "–": "-", "␣": "_", "§": "S", "·": ".", "•": "*",
    "⌊": "[", "⌋": "]", "⌈": "[", "⌉": "]", "≥": ">=", "≤": "<=", "≠": "!=", "≈": "~", "→": "->",
    "←": "<-", "×": "x", "±": "+/-", "²": "^2", "³": "^3", "√": "sqrt", "ℓ": "l", "θ": "theta",
    "Δ": "Delta", "⊙": "*", "ᵀ": "^T", "∈": "in", "∞": "inf", "µ": "u", "‘": "'", "’": "'", "“": '"', "”": '"',
    "\u0303": "~", "\u0302": "^", "\u00a0": " ",
    **dict(zip("▁▂▃▄▅▆▇█", SPARK_ASCII)),
}
ERRORS = "prefill-diff-standins"  # the codec error handler that writes STANDINS


def standin(ch: str) -> str:
    """An ASCII stand-in for one character: STANDINS, box drawing as - | +, other blocks #, else ?."""
    if ch in STANDINS:
        return STANDINS[ch]
    if "\u2500" <= ch <= "\u257f":  # box drawing
        name = unicodedata.name(ch, "").split()
        if "AND" not in name and ("HORIZONTAL" in name) != ("VERTICAL" in name):
            return "-" if "HORIZONTAL" in name else "|"
        return "+"  # corners, tees and crossings
    if "\u2580" <= ch <= "\u259f":  # block elements
        return "#"
    return "?"


def _standins(err: UnicodeEncodeError):
    return "".join(standin(ch) for ch in err.object[err.start:err.end]), err.end


codecs.register_error(ERRORS, _standins)

_TAIL = re.compile(r"(?: |\x1b\[[0-9;]*m)+$")  # the spaces and colour codes that end a line


def unpadded(s: str) -> str:
    """``s`` without the spaces that end its lines (kept: the colour codes among them, and the unfinished line)."""
    lines = s.split("\n")
    for i, line in enumerate(lines[:-1]):
        if line.endswith(" ") or "\x1b" in line:
            m = _TAIL.search(line)
            lines[i] = line if m is None else line[:m.start()] + m.group(0).replace(" ", "")
    return "\n".join(lines)


class TextOut(io.TextIOBase):
    """A text stream in front of another: trailing spaces dropped, what its encoding cannot hold stood in for.

    ``encoding`` is UTF-8, as it takes any text: rich lays out as for a Unicode terminal, and click, which
    re-opens an ASCII stream's buffer as UTF-8, writes through it too (it has no ``buffer``).
    """

    def __init__(self, stream):
        self.stream = stream
        self.target_encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            self.unicode = codecs.lookup(self.target_encoding).name.startswith("utf")
        except LookupError:
            self.target_encoding, self.unicode = "ascii", False

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return ERRORS

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        text = unpadded(s) if "\n" in s else s
        if not self.unicode:
            text = text.encode(self.target_encoding, ERRORS).decode(self.target_encoding)
        self.stream.write(text)
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def text_streams():
    """``sys.stdout`` and ``sys.stderr`` wrapped in ``TextOut`` for the duration (not twice), then restored."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None and not isinstance(sys.stdout, TextOut):
        sys.stdout = TextOut(sys.stdout)
    if sys.stderr is not None and not isinstance(sys.stderr, TextOut):
        sys.stderr = TextOut(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


# The exit status a command ends with when the reader of its stdout goes away (`| head -1`): 0 for listings and
# summaries; a verdict's status once the verdict is known (``keep_status_if_stdout_closes``), so that a closed pipe
# never turns a pass into a failure or a failure into a pass.
_CLOSED_STDOUT = {"status": 0}


def keep_status_if_stdout_closes(status: int) -> None:
    """From now on a closed stdout ends the command with ``status`` (the verdict's), writing nothing more."""
    _CLOSED_STDOUT["status"] = status


def status_if_stdout_closes() -> int:
    return _CLOSED_STDOUT["status"]


def reset_closed_stdout_status() -> None:
    _CLOSED_STDOUT["status"] = 0


def silence_stdout() -> None:
    """The reader of stdout went away: what is still buffered and anything written later go to /dev/null (the
    file descriptor is replaced, so neither the interpreter's last flush nor a library raises again)."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
    except (OSError, ValueError):
        fd = 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def flush_stdout() -> bool:
    """Flush stdout; False (and stdout silenced) when its reader has gone away."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        return True
    except BrokenPipeError:
        silence_stdout()
        return False
    except ValueError:  # closed by a test harness
        return True


def xml_for_stdout(text: str) -> str:
    """XML for stdout: characters its encoding cannot hold as character references (lossless, still XML)."""
    enc = getattr(sys.stdout, "target_encoding", None) or getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(enc, "xmlcharrefreplace").decode(enc)
