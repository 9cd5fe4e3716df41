"""Rich text for people, shared by every terminal rendering: foreign text as plain text, lines of fields, tables
fitted to a width.

Rules: the header, the verdict and every line a machine may grep are ``Fields``: one unwrapped line where the
output is not a terminal (pipes, CI logs), folded on a terminal at its fields' boundaries (else at spaces) onto
indented continuation lines, never inside a word or a number; tables are fitted to the console's width by
dropping low-priority columns, never by cutting a number; an out-of-tolerance cell carries a symbol as well as a
colour, so CI logs (no colour) show it too. Text that comes from a trace or a prompt is built with
``rich.text.Text``, never as markup. Glyphs (✗, the sparkline, box drawing) are written as they are: where the
stream cannot encode them, ``cli/terminal.py`` stands in ASCII for them.
"""
from __future__ import annotations

import io
import re

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ...engine.shared.untrusted import visible

BAD = "✗"  # marks an out-of-tolerance cell (coloured red as well where there is colour)


def plain(text, style: str = "") -> Text:
    """Foreign text (trace metadata, prompts, token text, notes, file names) as a renderable: never parsed as
    rich markup, control characters and bidirectional overrides shown as escapes (\\x1b, \\u202e)."""
    return Text(visible(text), style=style)


class Fields:
    """One line of fields (separated by ``seps``, strongest first): printed whole where the output is not a
    terminal, one line to grep; on a terminal folded to its width (``fold``)."""

    def __init__(self, text: Text, seps: tuple = (), indent: int = 2):
        self.text, self.seps, self.indent = text, tuple(seps), indent

    def __rich_console__(self, console, options):
        yield fold(self.text, options.max_width, self.seps, self.indent) if options.is_terminal else self.text


def fold(text: Text, width: int, seps: tuple = (), indent: int = 2) -> Text:
    """``text`` in lines of at most ``width`` cells, continuation lines indented by ``indent``: each broken
    after the last separator of the strongest kind that fits (``seps``, then a space); a word longer than the
    line is kept whole."""
    lines = text.split("\n", allow_blank=True)
    if len(lines) > 1:
        return Text("\n").join(fold(line, width, seps, indent) for line in lines)
    s = text.plain
    kinds = [sorted({m.end() for m in re.finditer(re.escape(sep) + " *", s)}) for sep in (*seps, " ")]
    cuts, start, room = [], 0, max(width, 1)
    while cell_len(s[start:].rstrip()) > room:
        fits = [[b for b in bs if start < b < len(s) and cell_len(s[start:b].rstrip()) <= room] for bs in kinds]
        later = [b for bs in kinds for b in bs if start < b < len(s)]
        cut = next((max(f) for f in fits if f), min(later, default=None))  # else past the over-long word
        if cut is None:
            break
        cuts.append(cut)
        start, room = cut, max(width - indent, 1)
    pieces = text.divide(cuts)
    for piece in pieces:
        piece.rstrip()
    return Text("\n" + " " * indent).join(pieces)


def print_line(console, text, seps: tuple = ()) -> None:
    """Print one line of fields (``Fields``): whole off a terminal, folded at its fields on one."""
    console.print(text if isinstance(text, Fields) else Fields(text, seps), soft_wrap=True)


def num(x) -> str:
    """A number in three significant digits; - for none."""
    return "-" if x is None else f"{x:.3g}"


def token_repr(text) -> str:
    """A token's text as one unbreakable word: repr (control characters visible), spaces as ␣."""
    return repr(text).replace(" ", "␣") if text is not None else "?"


def fitted_table(columns, rows, width: int, **table_kw):
    """A table of ``columns`` = [(header, justify, priority)] that fits ``width`` without cutting a cell.

    Columns are dropped by priority (highest number first) until the natural widths fit; returns
    (table, headers of the dropped columns). Cells are never wrapped or cut.
    """
    keep = list(range(len(columns)))

    def build(idx):
        t = Table(box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, title_justify="left", **table_kw)
        for i in idx:
            t.add_column(columns[i][0], justify=columns[i][1], no_wrap=True)
        for r in rows:
            t.add_row(*(r[i] for i in idx))
        return t

    def need(idx):  # the table's natural width, measured by rendering it unconstrained (title aside)
        probe = Console(file=io.StringIO(), width=10_000, color_system=None)
        t = build(idx)
        t.title = None
        probe.print(t)
        return max((len(line.rstrip()) for line in probe.file.getvalue().splitlines()), default=0)
    while len(keep) > 1 and need(keep) > width:
        worst = max((columns[i][2], i) for i in keep)[1]
        if columns[worst][2] <= 0:
            break  # priority 0 columns are never dropped
        keep.remove(worst)
    t = build(keep)
    dropped = [columns[i][0].replace("_\n", "_").replace("\n", " ") for i in range(len(columns)) if i not in keep]
    return t, dropped


def span(xs) -> str:
    xs = sorted(xs)
    if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs[:12])) + (", …" if len(xs) > 12 else "")
