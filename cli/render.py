"""Rich renderables for the CLI's own views: the §2.8 ledger, `inspect`'s summary and the model cache's listing
(the report's terminal format is ``verify/formats/terminal.py``; the text rules are ``verify/formats/text.py``).
"""
from __future__ import annotations

import dataclasses
import datetime

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..engine.shared.untrusted import visible
from ..verify.formats.text import BAD, fitted_table, num, plain, print_line, span, token_repr


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
            rows.append([Text(str(row["layer"]) if first else ""), plain(name), Text(num(st["min"])),
                         Text(num(st["max"])), Text(num(st["mean"])), Text(num(st["l2"])),
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
               f"showing channels {span(v['channels'])}):")
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
    for length, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= length:
            n = int(seconds // length)
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
