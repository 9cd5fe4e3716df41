"""Rich renderables for people. Functions return renderables or print through a given console.

Rules: the header, the verdict and every line a machine may grep are ``Fields``: one unwrapped
line where the output is not a terminal (pipes, CI logs), folded on a terminal at its fields' boundaries
(else at spaces) onto indented continuation lines, never inside a word or a number; tables are fitted to
the console's width by dropping low-priority columns, never by cutting a number; an out-of-tolerance cell
carries a symbol as well as a colour, so CI logs (no colour) show it too. Text that comes from a trace or a
prompt is built with ``rich.text.Text``, never as markup. Glyphs (✗, the sparkline, box drawing) are
written as they are: where the stream cannot encode them, ``cli/terminal.py`` stands in ASCII for them.
"""
from __future__ import annotations

import dataclasses
import datetime
import io
import math
import re

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..dumps.schema import LAYER_TENSORS
from ..engine.shared.untrusted import visible
from ..verify.formats.markdown import fmt_error

# Per-layer table columns: tensor name (the one name used by the verdict, JSON and inspect), header
# (the same name folded at its underscore), priority (lower is dropped last when the width is short).
COLUMNS = tuple((t.name, t.header, t.priority) for t in LAYER_TENSORS if t.header is not None)
SPARK = "▁▂▃▄▅▆▇█"
BAD = "✗"  # marks an out-of-tolerance cell (coloured red as well where there is colour)
DIFFERS = "*"  # marks a top id that is not in the other side's top 5
NEIGHBOURS = 2  # --layers auto: layers shown on each side of the first break
AUTO_ALL = 12  # --layers auto: tables of at most this many layers are shown whole


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


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def token_repr(text) -> str:
    """A token's text as one unbreakable word: repr (control characters visible), spaces as ␣."""
    return repr(text).replace(" ", "␣") if text is not None else "?"


def sparkline(values) -> str:
    """Max abs error per layer on a log scale; · for exact agreement."""
    logs = [math.log10(v) for v in values if v and v > 0 and math.isfinite(v)] or [0.0]
    lo, hi = min(logs), max(logs)
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("!")
        elif v <= 0:
            out.append("·")
        else:
            i = 0 if hi == lo else round((math.log10(v) - lo) / (hi - lo) * (len(SPARK) - 1))
            out.append(SPARK[i])
    return "".join(out)


def layer_max(lr) -> float | None:
    """The layer's largest max abs error over its valid cells; NaN when a valid cell is non-finite on one side."""
    vals = [t.max_abs for t in lr.tensors if t.level != "none"]
    if any(not t.finite.valid_ok for t in lr.tensors):
        return float("nan")
    return max(vals) if vals else None


def verdict_text(report) -> Text:
    return plain(report.verdict_line(), style="bold green" if report else "bold red")


def header_text(report) -> Text:
    def side(d):
        where = d.get("file") or ("in memory" if d.get("in_memory") else "trace not kept")
        return f"{d.get('origin')} ({where}, {d.get('level')} level)"
    return plain(f"reference: {side(report.ref)}  candidate: {side(report.cand)}  policy: {report.policy.name}",
                 style="dim")


# -- fitting tables to the width -------------------------------------------------------------------

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


# -- the run/compare report ---------------------------------------------------------------------

PAD = "pad"  # a cell whose only non-finite values are in padding rows: the number is the valid rows' error


def _cell(tr) -> Text:
    if tr is None or tr.level == "none":
        return Text("- ")
    err = fmt_error(tr.max_abs)
    value = err if tr.finite_ok else f"{err} {PAD}" if tr.finite.valid_ok else "NaN"
    if tr.shape_detail is not None:
        value = "shape"
    return Text(value + BAD, style="red") if not tr else Text(value + " ")


def _cache_cell(lr) -> Text:
    c = lr.cache
    if not c.lengths_ok:
        return Text("length" + BAD, style="red")
    if not c.positions_ok:
        return Text("positions" + BAD, style="red")
    return Text("ok ")


def shown_layers(report, which: str = "auto") -> list:
    """Indices into report.layers to show: all, failing only, or (auto) all up to AUTO_ALL layers, else the
    first break's neighbourhood (or, on a pass, the first, worst and last layers)."""
    n = len(report.layers)
    if which == "all" or (which == "auto" and n <= AUTO_ALL):
        return list(range(n))
    if which == "failing":
        return [i for i, lr in enumerate(report.layers) if not lr]
    fb = report.first_break
    keep = {n - 1}
    if fb is not None and fb.layer is not None and fb.stage == "layer":
        at = next((i for i, lr in enumerate(report.layers) if lr.layer == fb.layer), n - 1)
        keep |= set(range(max(at - NEIGHBOURS, 0), min(at + NEIGHBOURS + 1, n)))
    else:
        vals = [layer_max(lr) for lr in report.layers]
        worst = max(range(n), key=lambda i: -1.0 if vals[i] is None or math.isnan(vals[i]) else vals[i])
        keep |= {0, 1, worst, n - 2}
    return sorted(i for i in keep if 0 <= i < n)


def _is_stats(report, name) -> bool:
    return any((tr := lr.tensor(name)) is not None and tr.level == "stats" for lr in report.layers)


def layer_table(report, width: int = 120, which: str = "auto"):
    """The per-layer table, fitted to width; returns (table, lines below it), or a line saying that no layer
    fails when only failing layers were asked for."""
    stats_cols = [name for name, _, _ in COLUMNS if _is_stats(report, name)]
    title = f"per-layer max abs error ({BAD}: out of tolerance)"
    if len(stats_cols) == len(COLUMNS):
        title = (f"per-layer largest error of the statistics min, max, mean, rms (stats level: no values kept; "
                 f"{BAD}: out of tolerance)")
    elif stats_cols:
        title += "; " + ", ".join(stats_cols) + ": error of the statistics min, max, mean, rms (stats level)"
    cols = [("layer", "right", 0)] + [(h, "right", p) for _, h, p in COLUMNS] + [("cache", "right", 1)]
    idx = shown_layers(report, which)
    if not idx and which == "failing":  # a table with no rows would say nothing
        return Text(f"--layers failing: no layer is out of tolerance ({len(report.layers)} compared); --layers all "
                    "shows every layer"), []
    rows, prev = [], None
    for i in idx:
        if prev is not None and i != prev + 1:
            rows.append([Text("…")] + [Text("")] * (len(cols) - 1))
        lr = report.layers[i]
        rows.append([Text(str(lr.layer), style="green" if lr else "bold red")]
                    + [_cell(lr.tensor(name)) for name, _, _ in COLUMNS] + [_cache_cell(lr)])
        prev = i
    t, dropped = fitted_table(cols, rows, width, title=title)
    below = []
    if any(not tr.finite_ok and tr.finite.valid_ok for i in idx for tr in report.layers[i].tensors):
        below.append(Text(f"{PAD}{BAD}: NaN/Inf in padding rows only; the number is the error on valid rows",
                          style="dim"))
    if dropped:
        below.append(Text(f"columns not shown at width {width}: {', '.join(dropped)} (see --json)", style="dim"))
    hidden = len(report.layers) - len(idx)
    if hidden:
        bad = [lr.layer for j, lr in enumerate(report.layers) if j not in idx and not lr]
        within = hidden - len(bad)
        what = f"{within} within tolerance" + (f", {len(bad)} out of tolerance (layers {_span(bad)})" if bad else "")
        below.append(Text(f"{hidden} more layers not shown ({what}); --layers all shows every layer", style="dim"))
    return t, below


def _span(xs) -> str:
    xs = sorted(xs)
    if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs[:12])) + (", …" if len(xs) > 12 else "")


def calibration_table(report) -> Table:
    """Per layer: the candidate's row error against the float64 golden, the twin's noise, what was allowed."""
    cal = report.policy.calibration or {}
    t = Table(title=f"calibrated: row error vs float64 golden (relative L2), worst tensor per layer; twin: "
                    f"{cal.get('twin')}", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for c in ("layer", "tensor", "candidate", "twin noise", "allowed", "ratio", "numerics"):
        t.add_column(c, justify="left" if c == "tensor" else "right", no_wrap=True)
    for lr in report.layers:
        cands = [x for x in lr.tensors if x.calib is not None and x.calib.rows]
        if not cands:
            continue
        w = max(cands, key=lambda x: x.calib.cand_error / x.calib.allowed if x.calib.allowed else float("inf"))
        k = w.calib
        num = "-" if lr.numerics is None else ("ok" if lr.numerics else Text("broken ✗", style="red"))
        ratio = f"{k.max_ratio:.2g}x"
        t.add_row(str(lr.layer), w.tensor, fmt_error(k.cand_error), fmt_error(k.noise), fmt_error(k.allowed),
                  Text(ratio + " ✗", style="red") if not k else ratio, num)
    return t


def final_table(report, width: int = 120):
    token_text = report.token_text
    logits = report.final.tensor("logits")
    bad = set(logits.failing_samples) if logits is not None else set()

    marked = False

    def show(ids, other):
        """The top 5 ids, each marked DIFFERS when it is not in the other side's top 5."""
        nonlocal marked
        ids, other = ids[:5], set(other[:5])
        words = [(f"{i}:{token_repr(token_text.get(str(i)))}" if token_text else str(i))
                 + (DIFFERS if i not in other else "") for i in ids]
        marked = marked or any(i not in other for i in ids)
        return Text(" ".join(words))

    errs = dict(report.final.sample_max_abs)
    t = Table(title="final logits and top ids", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              width=None)
    narrow = width < 60  # one column of top ids, reference above candidate
    t.add_column("sample", justify="right", no_wrap=True)
    t.add_column("logits\nmax abs" if narrow else "logits max abs", justify="right", no_wrap=True)
    if narrow:
        t.add_column("top ids: reference,\ncandidate", overflow="fold")
    else:
        t.add_column("reference top", overflow="fold")
        t.add_column("candidate top", overflow="fold")
    for s, r, c in report.final.top:
        err = fmt_error(errs.get(s))
        cells = [str(s), Text(err + " " + BAD, style="red") if s in bad else Text(err + "  ")]
        cells += [Text.assemble("ref  ", plain(show(r, c)), "\ncand ", plain(show(c, r)))] if narrow else \
            [plain(show(r, c)), plain(show(c, r))]
        t.add_row(*cells)
    if marked:
        t.caption, t.caption_justify = f"{DIFFERS}: not in the other side's top 5", "left"
    return t


def _metrics_lines(tr) -> Text:
    """Every metric of one tensor, as words (the -v view)."""
    if tr.level == "none":
        return plain(f"{tr.tensor}: not compared ({tr.note or 'no values'})")
    if tr.level == "stats":
        head = (f"{tr.tensor} (stats level, {tr.compared} statistics): largest statistic error "
                f"{_num(tr.max_abs)}, {tr.n_bad} statistics out of tolerance")
        extra = f"; would pass with atol >= {_num(tr.needed.atol)}" if tr.n_bad else ""
        return Text(head + extra + ("" if tr else f"  {BAD}"), style="" if tr else "red")
    s = (f"{tr.tensor} ({tr.level} level, {tr.compared} values): max abs {_num(tr.max_abs)}, max rel "
         f"{_num(tr.max_rel)}, mean abs {_num(tr.mean_abs)}, cosine {_num(tr.cosine)}, largest row error "
         f"{_num(tr.max_row_rel)} of the row norm, " +
         (f"{tr.calib.bad_rows} of {tr.calib.rows} rows beyond {tr.calib.factor:g}x the twin's noise (largest "
          f"ratio {_num(tr.calib.max_ratio)})" if tr.calib is not None else f"{tr.n_bad} out of tolerance"))
    if tr.worst:
        s += (f", worst at sample {tr.worst[0]} pos {tr.worst[1]} channel {tr.worst[2]}"
              f" (tolerance there {_num(tr.worst_bound)})")
    n = tr.needed
    s += (f"; would pass with --noise-factor {_num(tr.calib.min_factor)}" if tr.calib is not None else
          f"; would pass with atol >= {_num(n.atol)}, rtol >= {_num(n.rtol)}, ntol >= {_num(n.ntol)} "
          f"or row_rtol >= {_num(n.row_rtol)}")
    if not tr.finite_ok:
        f = tr.finite
        s += (f"; non-finite: {f.cand_only} finite only in the candidate, {f.ref_only} only in "
              f"the reference, padding {f.pad_ref} vs {f.pad_cand}")
    if tr.bit_identical:
        s += "; bit-identical"
    return Text(s + ("" if tr else f"  {BAD}"), style="" if tr else "red")


def verbose_lines(report) -> list:
    """-v: every metric per tensor of the failing layer (on a pass: of the layer with the largest error), each
    tensor's metrics a line of fields: whole off a terminal, folded at its phrases ("; ", ", ") on one."""
    fb = report.first_break
    target = None
    if fb is not None and fb.stage == "layer":
        target = next((lr for lr in report.layers if lr.layer == fb.layer), None)
    elif report.layers:
        vals = [layer_max(lr) for lr in report.layers]
        target = report.layers[max(range(len(vals)), key=lambda i: -1.0 if vals[i] is None or math.isnan(vals[i])
                                   else vals[i])]
    parts = []
    if target is not None:
        why = "the first break's layer" if fb is not None and fb.stage == "layer" else "the largest error"
        parts.append(Text(f"layer {target.layer} ({why}), every metric per tensor:", style="bold"))
        parts += [Fields(_metrics_lines(tr), METRIC_SEPS, indent=4) for tr in target.tensors]
        if target.cache.detail:
            parts.append(plain(f"cache: {target.cache.detail}", style="red"))
    if report.final is not None and (fb is None or fb.stage == "final"):
        parts.append(Text("final stage, every metric per tensor:", style="bold"))
        parts += [Fields(_metrics_lines(tr), METRIC_SEPS, indent=4) for tr in report.final.tensors]
    return parts


METRIC_SEPS = ("; ", ", ")  # a -v metric line folds between its clauses, then between its metrics


def first_break_panel(report):
    fb = report.first_break
    line = report.line(fb)
    body = [plain(line, style="bold red")]
    if fb.message and fb.message not in line and fb.message.split(": ", 1)[-1] not in line:
        body.append(plain(fb.message))
    if fb.sublayer:
        body.append(Text(f"stage {fb.stage}, sub-layer {fb.sublayer}, kind {fb.kind}"
                         + (f", query heads {', '.join(map(str, fb.heads))}" if fb.heads else "")
                         + (f", KV heads {', '.join(map(str, fb.kv_heads))}" if fb.kv_heads else "")))
    if report.diagnosis:
        body.append(plain("hint: " + report.diagnosis, style="yellow"))
    return Panel(Group(*body), title="first break", border_style="red")


def prefill_lines(report) -> list:
    """A line of fields for each side whose prefill reused a cache or took more than one step (its ``prefill`` in
    the JSON): ``candidate prefill (budget 32 tokens a step, shared): sample 0: 64 from cache + 6 computed, 1 step;
    …``."""
    lines = []
    for side, d in (("reference", report.ref), ("candidate", report.cand)):
        p = d.get("prefill") or {}
        rows = p.get("samples") or ()
        if not any(o["from_cache"] or o["steps"] > 1 for o in rows):
            continue
        per = {"step": " a step, shared", "sample": " of each sample a step"}.get(p.get("budget_per"), "")
        budget = f" (budget {p['token_budget']} tokens{per})" if p.get("token_budget") else ""
        lines.append(Fields(Text(f"{side} prefill{budget}: " + "; ".join(
            f"sample {o['sample']}: {o['from_cache']} from cache + {o['computed']} computed, {o['steps']} step"
            + ("" if o["steps"] == 1 else "s") for o in rows)), ("; ",)))
    return lines


def report_parts(report, width: int = 120, which: str = "auto", verbose: bool = False):
    """The human report as (renderable, unwrapped) pairs; unwrapped parts are lines of fields (``print_line``)."""
    yield Fields(header_text(report), ("  ",)), True
    if report.calibration:
        yield Text(f"rule: {report.calibration}", style="dim"), True
    for line in prefill_lines(report):
        yield line, True
    for n in report.notes:
        if n.startswith("MODEL IDENTITY DIFFERS"):
            yield plain(n, style="bold yellow"), True
    if report.layers:
        table, below = layer_table(report, width, which)
        yield table, False
        for line in below:
            yield line, True
        if report.policy.calibration:
            yield calibration_table(report), False
        spark = sparkline([layer_max(lr) for lr in report.layers])
        yield Text(f"error growth (max abs per layer, log scale): {spark}"), True
    if report.final is not None:
        yield final_table(report, width), False
    if verbose:
        for line in verbose_lines(report):
            yield line, True
    if report.first_break is not None:
        yield first_break_panel(report), False
    for n in report.inconclusive:
        yield plain("INCONCLUSIVE: " + n, style="bold yellow"), True
    for n in report.notes:
        yield plain("note: " + n, style="yellow"), True
    for n in report.skipped:
        yield plain("not checked: " + n, style="dim"), True
    yield Fields(verdict_text(report), (" | ",)), True


def print_report(console, report, which: str = "auto", verbose: bool = False) -> None:
    """The whole human report. The header, the verdict and the notes are lines of ``Fields``."""
    for part, unwrapped in report_parts(report, console.width, which, verbose):
        if unwrapped:
            print_line(console, part)
        else:
            console.print(part)


# -- ledger ---------------------------------------------------------------------------------------

def ledger_renderable(ledgers, model_name: str, chunk_size: int = 0):
    parts = []
    n = len(ledgers)
    for i, lg in enumerate(ledgers):
        which = (f"prefill call {i + 1} of {n}" if n > 1 else "one prefill call")
        if chunk_size:
            which += f" (chunked: shapes of its first chunk of up to {chunk_size} tokens)"
        t = Table(title=plain(f"shape ledger (contract §2.8) — model {model_name}, {which}, input rectangle "
                             f"{list(lg.rect)}"), title_justify="left")
        t.add_column("object")
        t.add_column("shape")
        for name, shape in lg.rows:
            t.add_row(name, str(list(shape)) if isinstance(shape, tuple) else shape)
        t.add_row("KV cache, all layers (scalars)", f"{lg.cache_scalars}  ({lg.formula})")
        for seq, tok, hs, zs in lg.finals:
            t.add_row(f"final h_b, sequence {seq} (token {tok})", f"{list(hs)} -> logits {list(zs)}")
        parts.append(t)
    return Group(*parts)


# -- inspect --------------------------------------------------------------------------------------

def _words(d) -> str:
    """A metadata dict as words: 'dtype int8, scales per-token' (never a Python repr)."""
    if isinstance(d, dict):
        return ", ".join(f"{k.replace('_', ' ')} {_words(v)}" for k, v in d.items() if v not in (None, "", [], {}))
    if isinstance(d, (list, tuple)):
        return "[" + ", ".join(_words(x) for x in d) + "]"
    return str(d)


def print_inspect(console, s: dict) -> None:
    """`inspect`'s human summary: header lines, samples, per-layer statistics, final ids, values if asked."""
    for line in _inspect_header(s):
        print_line(console, line, ("  ", ", "))
    console.print(_samples_table(s))
    t, dropped = _layer_stats_table(s, console.width)
    console.print(t)
    if dropped:
        print_line(console, Text(f"columns not shown at width {console.width}: "
                                 f"{', '.join(d.replace(chr(10), ' ') for d in dropped)} (inspect --json - has them)",
                                 style="dim"))
    if s.get("routing"):
        console.print(_routing_table(s["routing"]))
    console.print(_final_ids_table(s))
    for line in s.get("levels_note") or ():
        print_line(console, plain(line, style="yellow"))
    if "values" in s:
        for line in _values_lines(s["values"], console.width):  # piped: COLUMNS, else 120
            print_line(console, line)


def _inspect_header(s: dict):
    """The trace, model, run, fault, reuse, tolerance, invariant and reproducibility lines."""
    m, run = s["model"], s["run"]
    a = m.get("args") or {}
    eng = run.get("engine") or {}
    yield plain(f"{s['file']}  (format {s['format_version']}, level {s['level']}, rectangle {s['rectangle'][0]} "
                f"samples x {s['rectangle'][1]} columns)", style="bold")
    yield plain(f"model {m['source']}: d={a.get('dim')} L={a.get('n_layers')} H_q={a.get('n_heads')} "
                f"H_kv={a.get('n_kv_heads')} d_h={a.get('head_dim')} |V|={a.get('vocab_size')}  "
                f"weights {str(m.get('weights_digest'))[:23]}…"
                + (f"  adapter {m['adapter'].get('id')}" if m.get("adapter") else ""))
    yield plain(f"run {run.get('origin')}: engine {eng.get('name')}, batching {eng.get('batching')}, "
                f"kernel {eng.get('kernel')}, dtype {eng.get('dtype')}, cache: {_words(run.get('layout')) or 'default'}")
    rec = s.get("record") or {}
    fault = run.get("fault") or rec.get("fault")
    if fault:
        yield plain(f"fault injected: {_words(fault)}", style="red")
    for o in rec.get("reuse") or ():
        what = "reused" if o.get("hit") else "not reused"
        yield plain(f"sample {o.get('sample')}: prefix of {o.get('prefix_len')} {what}"
                    + (" (FORCED)" if o.get("forced") else "") + (f" ({o['reason']})" if o.get("reason") else ""),
                    style="red" if o.get("forced") else "")
    if s.get("tolerance"):
        yield plain(f"declared tolerance: {_words(s['tolerance'])}")
    for v in rec.get("invariant_violations") or ():
        yield plain(f"cache invariant violation: {v}", style="red")
    rep = s.get("repro") or {}
    if rep:
        yield Text(f"torch {rep.get('torch')}, numpy {rep.get('numpy')}, h5py {rep.get('h5py')}, "
                   f"device {rep.get('device')}, threads {rep.get('threads')}, deterministic "
                   f"{rep.get('deterministic_algorithms')}", style="dim")
    prov = s.get("provenance") or {}
    if prov:  # the command line is foreign text: plain, never markup
        yield plain(f"recorded by prefill-diff {prov.get('version')} at {prov.get('time')}: {prov.get('argv')}",
                    style="dim")


def _routing_table(rows: list) -> Table:
    """A mixture of experts' routing per layer: tokens each expert took, and the token nearest a flip."""
    t = Table(title="routing (tokens per expert; the smallest router margin: the token nearest a flip)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, just in (("layer", "right"), ("tokens per expert", "left"), ("smallest margin", "right"),
                       ("at", "left")):
        t.add_column(name, justify=just)
    for r in rows:
        low = r.get("nearest_flip") or {}
        t.add_row(str(r["layer"]), " ".join(map(str, r["tokens_per_expert"])),
                  "-" if not low else f"{low['margin']:.3g}",
                  "" if not low else f"sample {low['sample']} pos {low['position']} experts {low['experts']}")
    return t


def _samples_table(s: dict) -> Table:
    samples = Table(title="samples", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    samples.add_column("sample", justify="right", no_wrap=True)
    samples.add_column("length", justify="right", no_wrap=True)
    samples.add_column("tokens")
    for x in s["samples"]:
        toks = x["text"] if x.get("text") else " ".join(map(str, x["token_ids"][:16])) + (
            " …" if len(x["token_ids"]) > 16 else "")
        samples.add_row(str(x["sample"]), str(x["length"]), plain(toks))
    return samples


def _layer_stats_table(s: dict, width: int):
    """(table, dropped column names) of every layer's statistics, fitted to ``width``."""
    cols = [("layer", "right", 0), ("tensor", "left", 0), ("min", "right", 1), ("max", "right", 1),
            ("mean", "right", 2), ("l2", "right", 3), ("nonfinite\nvalid/pad", "right", 0),
            ("cache\nlength", "right", 4)]
    rows = []
    for row in s["layers"]:
        first = True
        for name, st in row["tensors"].items():
            nf = f"{st['nonfinite']}/{st['pad_nonfinite']}"
            rows.append([Text(str(row["layer"]) if first else ""), plain(name), Text(_num(st["min"])),
                         Text(_num(st["max"])), Text(_num(st["mean"])), Text(_num(st["l2"])),
                         Text(nf + " " + BAD, style="red") if nf != "0/0" else Text(nf + "  "),
                         Text(",".join(map(str, row["cache_lengths"])) if first else "")])
            first = False
    return fitted_table(cols, rows, width,
                        title="per-layer statistics over valid cells (non-finite counts: valid/padding)")


def _final_ids_table(s: dict) -> Table:
    final = Table(title="final: the position the logits were gathered at (its token id), and the top ids",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    final.add_column("sample", justify="right", no_wrap=True)
    final.add_column("gathered at", justify="right", no_wrap=True)
    final.add_column("top ids", overflow="fold")
    for f in s["final"]:
        ids = f["top_ids"][:5]
        shown = " ".join(f"{i}:{token_repr(t)}" for i, t in zip(ids, f["top_text"])) if f.get("top_text") else \
            " ".join(map(str, ids))
        pos = f.get("gathered_position", f.get("gathered_token"))
        at = f"pos {pos}" + ("" if f.get("gathered_id") is None else f" (id {f['gathered_id']})")
        final.add_row(str(f["sample"]), at, plain(shown))
    return final


def _values_lines(v: dict, width: int | None = None):
    """`inspect --sample`: the values asked for, one line per position; given a width, in blocks of as many
    channels as fit it, each under its own channel header."""
    where = f"{v['tensor']}" + (f", layer {v['layer']}" if v.get("layer") is not None else "") + \
        f", sample {v['sample']}"
    rows = "position" + ("" if v["shape"][0] == 1 else "s")
    yield Text(f"values of {where} ({v['kind']}, {v['dtype']}, {v['shape'][0]} {rows} x {v['shape'][1]} channels; "
               f"showing channels {_span(v['channels'])}):")
    n = len(v["channels"])
    per = n if width is None else max((width - 12) // 11, 1)  # a line: 2 + 9 + 2 columns, then 11 per channel
    for lo in range(0, n, per):
        chans = v["channels"][lo:lo + per]
        yield Text(f"  {v['row_name']:>9}  " + " ".join(f"{'ch ' + str(c):>10}" for c in chans), style="dim")
        for pos, row in zip(v["rows"], v["head"]):
            yield Text(f"  {pos:>9}  " + " ".join(f"{x:>10.4g}" for x in row[lo:lo + per]))


# -- prefill-diff cache

def human_size(n: int) -> str:
    """Bytes in binary units: 0 B, 12 KiB, 513 MiB, 1.1 GiB."""
    x, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            break
        x /= 1024
    return f"{x:.0f} {unit}" if unit == "B" or x >= 10 else f"{x:.1f} {unit}"


def _ago(seconds: float) -> str:
    for span, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= span:
            n = int(seconds // span)
            return f"{n} {unit}{'' if n == 1 else 's'} ago"
    return "just now"


def cache_label(item) -> str:
    """An item as people know it: its kind and source file name (else its digest), or its name in models/."""
    if item.source_sha256 is None:
        return f"{item.kind} {item.name}"
    name = item.source.replace("\\", "/").rsplit("/", 1)[-1] if item.source else f"sha256 {item.source_sha256[:12]}…"
    return f"{item.kind} {name}"


def cache_where(listing) -> Text:
    """The line that says where the cache is, or that it is off or empty."""
    if listing.root is None:
        return Text("the model cache is off (--model-cache off or PREFILL_DIFF_CACHE=off): nothing is stored")
    n = len(listing.items)
    what = "empty" if not n else f"{n} item{'' if n == 1 else 's'}, {human_size(listing.total)}"
    return plain(f"model cache {listing.root}: {what}")


def cache_table(listing, now: float, width: int):
    """One row per item: kind, source, size, last used, state (and owner, when not all are yours); a total row.
    Returns (table, dropped columns)."""
    cols = [("kind", "left", 0), ("source", "left", 0), ("size", "right", 0), ("last used", "left", 2),
            ("state", "left", 0), ("owner", "left", 1)]
    rows = []
    for it in listing.items:
        source = cache_label(it).split(" ", 1)[1]
        if it.source_sha256 is None and len(source) > 16:  # a temporary directory: .tmp-<uuid>
            source = source[:14] + "…"
        state = Text(it.state, style="" if it.state == "intact" else "yellow")
        rows.append([Text(it.kind), plain(source), Text(human_size(it.size)), Text(_ago(max(0.0, now - it.used))),
                     state, plain(it.owner or "you")])
    rows.append([Text("total", style="bold"), Text(""), Text(human_size(listing.total), style="bold"), Text(""),
                 Text(""), Text("")])
    if all(it.owner is None for it in listing.items):
        cols.pop()
        rows = [r[:-1] for r in rows]
    return fitted_table(cols, rows, width, show_edge=False)


def cache_notes(listing):
    """A line for every item that is not an intact entry of the current user's: what it is, and why."""
    for it in listing.items:
        if it.why:
            yield plain(f"{cache_label(it)} {it.why}", style="yellow")
        if it.owner is not None:
            yield plain(f"{cache_label(it)} is owned by {it.owner}, not by you: prune does not remove it", style="dim")


def pruned_lines(pruned, max_size: int | None):
    """What prune removed (or would) and kept, and what the cache holds after it."""
    verb = "would remove" if pruned.dry_run else "removed"
    for d in pruned.decisions:
        word = Text(verb if d.removed else "kept", style="green" if d.removed else "yellow")
        yield Text.assemble(word, " ", plain(f"{cache_label(d.item)} ({human_size(d.item.size)}): {d.why}"))
    n = sum(d.removed for d in pruned.decisions)
    where = visible(pruned.found.root)
    if n == 0:
        yield plain(f"nothing to remove; the model cache {where} holds {human_size(pruned.left)}")
    else:
        freed, holds = ("would free", "would hold") if pruned.dry_run else ("freed", "holds")
        yield plain(f"{freed} {human_size(pruned.freed)}; the model cache {where} {holds} {human_size(pruned.left)}")
    if max_size is not None and pruned.left > max_size:
        yield Text(f"the cache stays larger than --max-size {human_size(max_size)}: what is left is in use, being "
                   "written, another user's or not made by prefill-diff (see above)", style="yellow")


def cache_json_item(item, why: str | None = None) -> dict:
    """An item as JSON: its fields, ``used`` as UTC ISO 8601, ``why`` as prune decided it when given."""
    d = dataclasses.asdict(item)
    d["paths"] = list(item.paths)
    d["used"] = datetime.datetime.fromtimestamp(item.used, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if why is not None:
        d["why"] = why
    return d
