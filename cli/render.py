"""Rich renderables for people. Functions return renderables; only commands print."""
from __future__ import annotations

import math

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..engine.untrusted import visible

COLUMNS = (("layer_input", "R_in"), ("cache_keys", "K"), ("cache_values", "V"), ("attn_update", "attn"),
           ("mid", "U"), ("mlp_update", "mlp"), ("layer_output", "R_out"))
SPARK = "▁▂▃▄▅▆▇█"


def plain(text, style: str = "") -> Text:
    """Foreign text (trace metadata, prompts, token text, notes, file names) as a renderable: never parsed as
    rich markup, control characters and bidirectional overrides shown as escapes (\\x1b, \\u202e)."""
    return Text(visible(text), style=style)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.1e}" if x else "0"


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def sparkline(values) -> str:
    """Max abs error per layer on a log scale; · for exact agreement."""
    logs = [math.log10(v) for v in values if v and v > 0 and math.isfinite(v)]
    if not logs:
        return "·" * len(values)
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
    vals = [t.max_abs for t in lr.tensors if t.level != "none"]
    if any(not t.finite_ok for t in lr.tensors):
        return float("nan")
    return max(vals) if vals else None


def verdict_text(report) -> Text:
    style = "bold green" if report else "bold red"
    return plain(report.verdict_line(), style=style)


def report_renderable(report, token_text: dict | None = None):
    parts = []
    parts.append(plain(f"reference: {report.ref.get('origin')} ({report.ref.get('file') or 'not kept'}, "
                      f"{report.ref.get('level')})  "
                      f"candidate: {report.cand.get('origin')} ({report.cand.get('file') or 'not kept'}, "
                      f"{report.cand.get('level')})  policy: {report.policy.name}", style="dim"))
    if report.layers:
        parts.append(layer_table(report))
        spark = sparkline([layer_max(lr) for lr in report.layers])
        parts.append(Text(f"error growth (max abs per layer, log scale): {spark}"))
    if report.final is not None:
        parts.append(final_table(report, token_text))
    if report.first_break is not None:
        fb = report.first_break
        body = [plain(report.verdict_line(), style="bold red"), plain(fb.message)]
        if fb.sublayer:
            body.append(plain(f"stage {fb.stage}, sub-layer {fb.sublayer}, kind {fb.kind}"
                             + (f", query heads {list(fb.heads)}" if fb.heads else "")))
        if report.diagnosis:
            body.append(plain("hint: " + report.diagnosis, style="yellow"))
        parts.append(Panel(Group(*body), title="first break", border_style="red"))
    for n in report.inconclusive:
        parts.append(plain("INCONCLUSIVE: " + n, style="bold yellow"))
    for n in report.notes:
        parts.append(plain("note: " + n, style="yellow"))
    for n in report.skipped:
        parts.append(plain("not checked: " + n, style="dim"))
    parts.append(verdict_text(report))
    return Group(*parts)


def layer_table(report) -> Table:
    t = Table(title="per-layer max abs error (red: out of tolerance)", title_justify="left", box=box.SIMPLE_HEAD,
              padding=(0, 1), pad_edge=False)
    t.add_column("layer", justify="right", no_wrap=True)
    for _, label in COLUMNS:
        t.add_column(label, justify="right", no_wrap=True, min_width=7)
    for lr in report.layers:
        row = [f"[green]{lr.layer}[/]" if lr else f"[bold red]{lr.layer}[/]"]
        for name, _ in COLUMNS:
            tr = lr.tensor(name)
            if tr is None:
                row.append("-")
                continue
            cell = _fmt(tr.max_abs) if tr.finite_ok else "NaN"
            row.append(f"[red]{cell}[/]" if not tr else cell)
        t.add_row(*row)
    return t


def final_table(report, token_text: dict | None = None) -> Table:
    t = Table(title="final logits and top ids", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("sample", "logits max abs", "reference top", "candidate top"):
        t.add_column(c)
    logits = report.final.tensor("logits")
    bad = set(logits.bad_samples) if logits is not None else set()

    def show(ids):
        ids = ids[:5]
        if token_text:
            return " ".join(f"{i}:{token_text.get(str(i), '?')!r}" for i in ids)
        return " ".join(map(str, ids))

    errs = dict(report.final.sample_max_abs)
    for s, r, c in report.final.top:
        err = _fmt(errs.get(s))
        t.add_row(str(s), f"[red]{err}[/]" if s in bad else err, plain(show(r)), plain(show(c)))
    return t


def ledger_renderable(ledgers, model_name: str):
    parts = []
    for i, lg in enumerate(ledgers):
        t = Table(title=plain(f"shape ledger (seed §2.8) — model {model_name}, prefill call {i + 1} of "
                              f"{len(ledgers)}, input rectangle {list(lg.rect)}"), title_justify="left")
        t.add_column("object")
        t.add_column("shape")
        for name, shape in lg.rows:
            t.add_row(name, str(list(shape)) if isinstance(shape, tuple) else shape)
        t.add_row("KV cache, all layers (scalars)", f"{lg.cache_scalars}  ({lg.formula})")
        for seq, tok, hs, zs in lg.finals:
            t.add_row(f"final h_b, sequence {seq} (token {tok})", f"{list(hs)} -> logits {list(zs)}")
        parts.append(t)
    return Group(*parts)


def inspect_renderable(s: dict):
    m, run = s["model"], s["run"]
    a = m.get("args") or {}
    eng = run.get("engine") or {}
    head = [plain(f"{s['file']}  (format {s['format_version']}, level {s['level']}, rectangle {s['rectangle']})",
                 style="bold"),
            plain(f"model {m['source']}: d={a.get('dim')} L={a.get('n_layers')} H_q={a.get('n_heads')} "
                 f"H_kv={a.get('n_kv_heads')} d_h={a.get('head_dim')} |V|={a.get('vocab_size')}  "
                 f"weights {str(m.get('weights_digest'))[:23]}…"
                 + (f"  adapter {m['adapter']['id']}" if m.get("adapter") else "")),
            plain(f"run {run.get('origin')}: engine {eng.get('name')}, batching {eng.get('batching')}, "
                 f"kernel {eng.get('kernel')}, dtype {eng.get('dtype')}, cache {run.get('layout')}")]
    rec = s.get("record") or {}
    facts = []
    if run.get("fault") or rec.get("fault"):
        facts.append(f"fault injected: {run.get('fault') or rec.get('fault')}")
    for o in rec.get("reuse") or ():
        what = "reused" if o.get("hit") else "not reused"
        facts.append(f"sample {o.get('sample')}: prefix of {o.get('prefix_len')} {what}"
                     + (" (FORCED)" if o.get("forced") else "") + (f" ({o['reason']})" if o.get("reason") else ""))
    if s.get("tolerance"):
        facts.append(f"declared tolerance: {s['tolerance']}")
    if rec.get("invariant_violations"):
        facts.append("cache invariant violations: " + "; ".join(rec["invariant_violations"]))
    head += [plain(f, style="red" if "violation" in f or "fault" in f or "FORCED" in f else "")
             for f in facts]
    rep = s.get("repro") or {}
    if rep:
        head.append(plain(f"torch {rep.get('torch')}, numpy {rep.get('numpy')}, h5py {rep.get('h5py')}, "
                         f"device {rep.get('device')}, threads {rep.get('threads')}, deterministic "
                         f"{rep.get('deterministic_algorithms')}", style="dim"))
    samples = Table(title="samples", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("sample", "length", "tokens"):
        samples.add_column(c)
    for x in s["samples"]:
        toks = x["text"] if x.get("text") else " ".join(map(str, x["token_ids"][:16])) + (
            " …" if len(x["token_ids"]) > 16 else "")
        samples.add_row(str(x["sample"]), str(x["length"]), plain(toks))
    layers = Table(title="per-layer statistics (valid cells; nonfinite counts valid/padding)", title_justify="left",
                   box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("layer", "tensor", "min", "max", "mean", "l2", "nonfin", "cache len"):
        layers.add_column(c, justify="right" if c not in ("tensor",) else "left", no_wrap=True)
    for row in s["layers"]:
        first = True
        for name, st in row["tensors"].items():
            nf = f"{st['nonfinite']}/{st['pad_nonfinite']}"
            layers.add_row(str(row["layer"]) if first else "", plain(name), _g(st["min"]), _g(st["max"]),
                           _g(st["mean"]), _g(st["l2"]), f"[red]{nf}[/]" if nf != "0/0" else nf,
                           ",".join(map(str, row["cache_lengths"])) if first else "")
            first = False
    final = Table(title="final: gathered token and top ids", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for c in ("sample", "gathered token", "top ids"):
        final.add_column(c)
    for f in s["final"]:
        ids = f["top_ids"][:5]
        shown = " ".join(f"{i}:{t!r}" for i, t in zip(ids, f["top_text"])) if f.get("top_text") else \
            " ".join(map(str, ids))
        final.add_row(str(f["sample"]), str(f["gathered_token"]), plain(shown))
    parts = head + [samples, layers, final]
    if "values" in s:
        v = s["values"]
        parts.append(plain(f"values ({v['dtype']}, shape {v['shape']}, first 8 channels):"))
        for p, row in zip(v["positions"], v["head"]):
            parts.append(Text(f"  pos {p}: " + " ".join(f"{x:.4g}" for x in row)))
    return Group(*parts)
