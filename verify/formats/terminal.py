"""The report's terminal format: the header, the per-layer table, the calibration table, the final logits, the
-v metrics, the first break's panel, the notes and the verdict, as rich renderables fitted to a width (the
rules of ``text.py``)."""
from __future__ import annotations

import math

from rich import box
from rich.panel import Panel
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ...dumps.schema import LAYER_TENSORS
from ..op_replay import replay_lines
from ..wording import exact_lines, logprob_lines, phase_line, truncated
from .markdown import fmt_error, token_text_of
from .text import BAD, Fields, fitted_table, num, plain, print_line, span, token_repr

# Per-layer table columns: tensor name (the one name used by the verdict, JSON and inspect), header
# (the same name folded at its underscore), priority (lower is dropped last when the width is short).
COLUMNS = tuple((t.name, t.header, t.priority) for t in LAYER_TENSORS if t.header is not None)
SPARK = "▁▂▃▄▅▆▇█"
DIFFERS = "*"  # marks a top id that is not in the other side's top 5
NEIGHBOURS = 2  # --layers auto: layers shown on each side of the first break
AUTO_ALL = 12  # --layers auto: tables of at most this many layers are shown whole


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
        return f"{d.get('origin')} ({where}, {d.get('level')} level{truncated(d)})"
    return plain(f"reference: {side(report.ref)}  candidate: {side(report.cand)}  policy: {report.policy.name}",
                 style="dim")


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
        what = f"{within} within tolerance" + (f", {len(bad)} out of tolerance (layers {span(bad)})" if bad else "")
        below.append(Text(f"{hidden} more layers not shown ({what}); --layers all shows every layer", style="dim"))
    return t, below




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
                f"{num(tr.max_abs)}, {tr.n_bad} statistics out of tolerance")
        extra = f"; would pass with atol >= {num(tr.needed.atol)}" if tr.n_bad else ""
        return Text(head + extra + ("" if tr else f"  {BAD}"), style="" if tr else "red")
    s = (f"{tr.tensor} ({tr.level} level, {tr.compared} values): max abs {num(tr.max_abs)}, max rel "
         f"{num(tr.max_rel)}, mean abs {num(tr.mean_abs)}, cosine {num(tr.cosine)}, largest row error "
         f"{num(tr.max_row_rel)} of the row norm, " +
         (f"{tr.calib.bad_rows} of {tr.calib.rows} rows beyond {tr.calib.factor:g}x the twin's noise (largest "
          f"ratio {num(tr.calib.max_ratio)})" if tr.calib is not None else f"{tr.n_bad} out of tolerance"))
    if tr.worst:
        s += (f", worst at sample {tr.worst[0]} pos {tr.worst[1]} channel {tr.worst[2]}"
              f" (tolerance there {num(tr.worst_bound)})")
    n = tr.needed
    s += (f"; would pass with --noise-factor {num(tr.calib.min_factor)}" if tr.calib is not None else
          f"; would pass with atol >= {num(n.atol)}, rtol >= {num(n.rtol)}, ntol >= {num(n.ntol)} "
          f"or row_rtol >= {num(n.row_rtol)}")
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
        phases = phase_line(report.layers)
        if phases:
            yield plain(phases), True
    if report.final is not None:
        yield final_table(report, width), False
    for line in logprob_lines(report.logprobs, token_text_of(report)):
        yield plain(line), True
    for line in exact_lines(report.exact, verbose) if report.exact is not None else ():
        yield plain(line, style="dim" if line.startswith("not compared") else ""), True
    for line in replay_lines(report.replay) if report.replay is not None else ():
        yield plain(line), True
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
