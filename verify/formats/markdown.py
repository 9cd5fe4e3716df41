"""Markdown: the report for a GitHub step summary or a pull-request comment (a pure function, like JUnit).

The verdict line, the first break (its line, its message and the hint), the per-layer table (the rows and
columns the caller shows, with ✗ beside every value out of tolerance and the cache check), the final logits
and top ids, then INCONCLUSIVE lines, notes and checks not done. Text that comes from a trace, a config, a
prompt or a file name is escaped by ``md``, so it cannot add markup, break a table or start a heading.
"""
from __future__ import annotations

import math
import re

from ...engine.shared.untrusted import visible
from .. import wording
from ..bitwise import percent
from ..op_replay import replay_lines
from ..report import Report

BAD = "✗"  # an out-of-tolerance value, as the terminal marks it
# characters that make markup anywhere in a line (emphasis, code, links, tables, strikethrough, math, headings and
# issue links), escaped with a backslash; & < > become entities (no HTML, no autolinks)
_INLINE = re.compile(r"([\\`*_\[\]|~$#])")
_LEADING = re.compile(r"^([-+=]|\d+[.)])")  # a list item, a setext underline or a numbered item


def md(text) -> str:
    """Foreign text as literal Markdown on one line: control characters and newlines as visible escapes
    (\\x0a, \\x1b), ``& < >`` as entities, markup characters backslash-escaped (a ``|`` cannot end a table
    cell, a backtick cannot open code, a ``#`` cannot start a heading, a leading ``-`` or ``1.`` a list, leading
    spaces a code block)."""
    s = visible(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _INLINE.sub(r"\\\1", s)
    if s[:1].isspace():
        return f"&#{ord(s[0])};" + s[1:]
    return _LEADING.sub(lambda m: m.group(1)[:-1] + "\\" + m.group(1)[-1], s)


def to_markdown(report: Report, shown=None, columns=None) -> str:
    """The report in Markdown. shown: indices into report.layers to show (None: all); columns: the tensors
    of the layer table, in order (None: every tensor the layers have)."""
    parts = [_head(report)]
    if report.first_break is not None:
        parts.append(_first_break(report))
    if report.layers:
        parts.append(_layer_table(report, list(range(len(report.layers))) if shown is None else list(shown),
                                  columns))
    if report.final is not None:
        parts.append(_final_table(report))
    phases = wording.phase_line(report.layers)
    if phases:
        parts.append(md(phases))
    if report.logprobs is not None:
        parts.append("\n".join(f"- {md(line.strip())}" for line in wording.logprob_lines(report.logprobs,
                                                                                 token_text_of(report))))
    if report.exact is not None:
        parts.append("\n".join(f"- {md(line)}" for line in wording.exact_lines(report.exact)))
    if report.replay is not None:
        parts.append(_replay_table(report.replay))
    lines = ([f"- **INCONCLUSIVE:** {md(n)}" for n in report.inconclusive] + [f"- note: {md(n)}" for n in report.notes]
             + [f"- not checked: {md(n)}" for n in report.skipped])
    if lines:
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _replay_table(replay) -> str:
    """--replay-ops as a table: per layer and op, the share bitwise equal in the candidate's own forward and when fed
    the reference's input, and what that makes of the op; then the causes and what was not replayed."""
    rows = ["| layer | op | own forward | replayed | verdict |", "|---|---|---|---|---|"]
    for layer, ops in replay.layers:
        for o in ops:
            own = "" if o.own is None else percent(o.own.share)
            rows.append(f"| {layer} | {md(o.name)} | {own} | {percent(o.replayed.share)} | {o.verdict} |")
    notes = [line for line in replay_lines(replay) if not line.startswith(f"replay on {replay.engine}, layer")]
    return "\n".join(rows) + ("\n\n" + "\n".join(f"- {md(n)}" for n in notes) if notes else "")


def token_text_of(report: Report):
    """A token id's text under the model's tokenizer (None without one)."""
    return (lambda i: report.token_text.get(str(int(i)))) if report.token_text else None


def _head(report: Report) -> str:
    def side(d: dict) -> str:
        where = d.get("file") or ("in memory" if d.get("in_memory") else "trace not kept")
        return f"{md(d.get('origin'))} ({md(where)}, {md(d.get('level'))} level{md(wording.truncated(d))})"
    # hard line breaks as a trailing backslash (CommonMark), not two trailing spaces, which pipes and editors drop
    lines = [f"### prefill-diff: {'PASSED' if report else 'FAILED'}", "",
             f"**{md(report.verdict_line())}**", "",
             f"reference: {side(report.ref)}\\\ncandidate: {side(report.cand)}\\\npolicy: {md(report.policy.name)}"]
    if report.calibration:
        lines[-1] += f"\\\nrule: {md(report.calibration)}"
    return "\n".join(lines)


def _first_break(report: Report) -> str:
    fb = report.first_break
    line = report.line(fb)
    lines = ["#### First break", "", f"**{md(line)}**"]
    if fb.message and fb.message not in line and fb.message.split(": ", 1)[-1] not in line:
        lines += ["", md(fb.message)]
    if report.diagnosis:
        lines += ["", f"> hint: {md(report.diagnosis)}"]
    return "\n".join(lines)


def fmt_error(x) -> str:
    """An error figure as the report tables show it: two significant digits, "0", "-" when absent."""
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.1e}" if x else "0"


def _cell(tr) -> str:
    if tr is None or tr.level == "none":
        return "-"
    value = "shape" if tr.shape_detail is not None else fmt_error(tr.max_abs) if tr.finite_ok else "NaN"
    return value if tr else f"{value} {BAD}"


def _cache_cell(lr) -> str:
    c = lr.cache
    return f"length {BAD}" if not c.lengths_ok else f"positions {BAD}" if not c.positions_ok else "ok"


def _layer_table(report: Report, shown: list, columns) -> str:
    names = list(columns) if columns is not None else list(dict.fromkeys(t.tensor for lr in report.layers
                                                                         for t in lr.tensors))
    stats = [n for n in names if any((t := lr.tensor(n)) is not None and t.level == "stats" for lr in report.layers)]
    title = f"#### Per-layer max abs error ({BAD}: out of tolerance)"
    if stats:
        title += f"; {md(', '.join(stats))}: largest error of the statistics min, max, mean, rms (stats level)"
    rows = ["| layer | " + " | ".join(md(n) for n in names) + " | cache |",
            "|" + "---:|" * (len(names) + 2)]
    prev = None
    for i in shown:
        if prev is not None and i != prev + 1:
            rows.append("| … |" + " |" * (len(names) + 1))
        lr = report.layers[i]
        rows.append(f"| {lr.layer} | " + " | ".join(_cell(lr.tensor(n)) for n in names) + f" | {_cache_cell(lr)} |")
        prev = i
    out = [title, "", *rows]
    hidden = len(report.layers) - len(shown)
    if hidden:
        bad = [lr.layer for j, lr in enumerate(report.layers) if j not in shown and not lr]
        what = f"{hidden - len(bad)} within tolerance" + (
            f", {len(bad)} out of tolerance (layers {wording.span(bad)})" if bad else "")
        out += ["", f"{wording.count(hidden, 'more layer')} not shown ({what}); `--layers all` shows every layer"]
    return "\n".join(out)


def _final_table(report: Report) -> str:
    logits = report.final.tensor("logits")
    bad = set()
    if logits is not None and not logits:  # a calibrated break names its samples by rows
        bad = set(logits.bad_samples) | set(logits.calib.bad_samples if logits.calib is not None else ())
    errs = dict(report.final.sample_max_abs)
    text = report.token_text or {}

    def ids(xs) -> str:
        return " ".join(md(f"{i}:{repr(text[str(i)])}" if str(i) in text else i) for i in list(xs)[:5])
    rows = ["#### Final logits and top ids", "", "| sample | logits max abs | reference top | candidate top |",
            "|---:|---:|---|---|"]
    for s, r, c in report.final.top:
        err = fmt_error(errs.get(s)) + (f" {BAD}" if s in bad else "")
        rows.append(f"| {s} | {err} | {ids(r)} | {ids(c)} |")
    return "\n".join(rows)
