"""--plot: error per layer and sub-layer, log scale, with the allowed error and every out-of-tolerance point.

The dashed lines are the allowed error of the rule the verdict used. Fixed rule — top panel: max abs error
per layer for each series and, dashed in the same colour, the allowed error floor ``atol + ntol·rms`` of the
reference row with the smallest RMS (``bound_floor`` in the JSON): every element of that tensor may differ
at least this much, so a point below its dashed line surely passes. Elements of larger rows, or large
elements (rtol·|ref|), are allowed more, so a point above the line may still pass. Bottom panel: the largest
relative row error ||c - r|| / ||r||, with the row rule's threshold when the policy sets one. Calibrated rule
— the top panel shows max abs error only (no absolute bound applies); the bottom panel shows each series'
largest row error against the float64 golden ||c - g|| / ||g|| and, dashed, what was allowed at its worst
row (K x the twin's noise + floor). Every point that broke the rule is circled in red, so the picture
agrees with the verdict.

Exact zeros are not values on a log scale: they are drawn on a marked baseline ("exact 0") below the
lowest decade shown, never at an arbitrary tiny number. The first break is labelled; a cache length or
position break is marked at its layer. The legend sits beside the axes, off the data.
"""
from __future__ import annotations

import math

from ...dumps.schema import TENSOR
from ...engine.shared.errors import PrefillDiffError
from ...engine.shared.untrusted import visible
from ..report import Report

# the tensors drawn, each labelled by its words in the vocabulary
SERIES = tuple((n, TENSOR[n].words) for n in ("attn_update", "mlp_update", "layer_output", "cache_keys",
                                               "cache_values"))


def allowed_max_abs(t) -> float | None:
    """The smallest allowed error of any element, atol + ntol·rms(smallest reference row) (None: stats level, or
    a calibrated comparison, which bounds rows, not elements)."""
    return None if t.level in ("none", "stats") or t.calib is not None else t.bound_floor


def plot_data(report: Report) -> dict:
    """What the plot draws, as plain numbers: per series (label, layers, max abs, allowed, row error, the
    allowed row error, layers out of tolerance); exact zeros stay 0 here (drawn on the baseline). In a
    calibrated comparison the row error is against the float64 golden and its allowance K x noise + floor."""
    out = {}
    for name, label in SERIES:
        rows = [(lr.layer, lr.tensor(name)) for lr in report.layers
                if lr.tensor(name) is not None and lr.tensor(name).level != "none"]
        if not rows:
            continue
        cal = all(t.calib is not None for _, t in rows)
        out[name] = {"label": label, "layers": [i for i, _ in rows],
                     "max_abs": [float(t.max_abs) for _, t in rows],
                     "allowed": [allowed_max_abs(t) for _, t in rows],
                     "max_row_rel": [float(t.calib.max_cand_error if cal else t.max_row_rel) for _, t in rows],
                     "allowed_row": [float(t.calib.allowed) if cal else None for _, t in rows],
                     "stats": any(t.level == "stats" for _, t in rows),
                     "broken": [i for i, t in rows if not t]}
    return out


def baseline(values) -> float:
    """Where exact zeros are drawn: one decade below the smallest positive finite value (1 if none)."""
    pos = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return 10.0 ** (math.floor(math.log10(min(pos))) - 1) if pos else 1.0


def cache_breaks(report: Report) -> list[tuple[int, str]]:
    return [(lr.layer, "cache length" if not lr.cache.lengths_ok else "cache positions") for lr in report.layers
            if not (lr.cache.lengths_ok and lr.cache.positions_ok)]


def plot_errors(report: Report, path: str) -> None:
    try:  # matplotlib is optional and slow to import: only --plot loads it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PrefillDiffError("--plot needs matplotlib: pip install 'prefill-diff[plot]'") from None
    data = plot_data(report)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    panels = ((ax, "max_abs"), (ax2, "max_row_rel"))
    floors = {}
    for a, key in panels:
        vals = [v for s in data.values() for v in s[key]]
        vals += [v for s in data.values() for v in s["allowed" if key == "max_abs" else "allowed_row"]]
        floors[key] = baseline(vals)
    _series(ax, panels, data, floors, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    # the row rule is the fixed rule's; a calibrated verdict bounds rows by the twin's noise instead
    row_rtol = 0.0 if report.policy.calibration else report.policy.kinds["residual"].row_rtol
    if row_rtol > 0:
        ax2.axhline(row_rtol, color="red", linestyle="--", label=f"row_rtol {row_rtol:g} (residual)")
    for a, key in panels:
        a.set_yscale("log")
        _zero_baseline(a, [v for s in data.values() for v in s[key]], floors[key])
    _breaks(report, ax, ax2)
    _labels(report, data, ax, ax2, row_rtol)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)


def _series(ax, panels, data: dict, floors: dict, colours) -> None:
    """Each series on both panels (zeros on the baseline, broken points circled) and its dashed allowed error;
    the legend names only the dashed lines that were drawn."""
    drawn = set()
    for k, s in enumerate(data.values()):
        colour = colours[k % len(colours)]
        for a, key in panels:
            zero = floors[key]
            ys = [v if v > 0 else zero for v in s[key]]
            a.plot(s["layers"], ys, marker="o", color=colour, label=s["label"] if key == "max_abs" else None)
            zs = [(i, zero) for i, v in zip(s["layers"], s[key]) if v == 0]
            if zs:
                a.scatter(*zip(*zs), marker="o", s=40, facecolors="white", edgecolors=colour, zorder=3)
            bad = [(i, y) for i, y in zip(s["layers"], ys) if i in s["broken"]]
            if bad:
                a.scatter(*zip(*bad), s=160, facecolors="none", edgecolors="red", linewidths=2, zorder=4)
        for (a, _), key in zip(panels, ("allowed", "allowed_row")):
            allowed = [(i, v) for i, v in zip(s["layers"], s[key]) if v is not None and v > 0 and math.isfinite(v)]
            if allowed:
                a.plot(*zip(*allowed), linestyle="--", linewidth=1, color=colour, alpha=0.8)
                drawn.add(key)
    if "allowed" in drawn:
        ax.plot([], [], linestyle="--", color="grey", label="allowed error floor\natol + ntol·rms (dashed)")
    if "allowed_row" in drawn:
        ax.plot([], [], linestyle="--", color="grey", label="allowed row error at the\nworst row: K x twin noise\n"
                                                            "+ floor (dashed, lower panel)")
    ax.scatter([], [], s=160, facecolors="none", edgecolors="red", linewidths=2, label="out of tolerance")


def _zero_baseline(a, values, zero: float) -> None:
    """The exact-zero baseline of one log-scale panel, outside its data range, labelled "exact 0"."""
    from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation  # deferred with matplotlib itself
    if not any(v == 0 for v in values):
        return
    a.axhspan(zero / 2.5, zero * 2.5, color="0.92", zorder=0)
    a.axhline(zero, color="0.6", linewidth=0.8, zorder=1)
    lo, hi = a.get_ylim()
    a.set_ylim(zero / 2.5, max(hi, zero * 20))
    if all(v == 0 for v in values):
        a.annotate("every series is exactly 0 at every layer", xy=(0.5, 0.5), xycoords="axes fraction",
                   ha="center", fontsize="small", color="0.4")
    base = LogFormatterSciNotation()
    base.set_axis(a.yaxis)
    a.yaxis.set_major_formatter(FuncFormatter(
        lambda v, pos: "exact 0" if math.isclose(v, zero) else ("" if v < zero * 3 else base(v, pos))))
    a.yaxis.set_minor_formatter(FuncFormatter(lambda v, pos: ""))


def _breaks(report: Report, ax, ax2) -> None:
    """The first break's layer, labelled, and every cache break's."""
    fb = report.first_break
    if fb is not None and fb.layer is not None:
        kind = fb.kind.replace("_", " ")
        what = fb.tensor if fb.kind == "value" else kind if fb.kind.startswith("cache") or fb.tensor is None \
            else f"{fb.tensor} {kind}"
        for a in (ax, ax2):
            a.axvline(fb.layer, color="red", linestyle=":", linewidth=1.2)
        ax.annotate(f"first break: layer {fb.layer} {what}", xy=(fb.layer, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(0, 3), textcoords="offset points", va="bottom", ha="center", fontsize="small", color="red",
                    annotation_clip=False,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="red", alpha=0.9), zorder=5)
    for i, (layer, what) in enumerate(cache_breaks(report)):
        ax.axvline(layer, color="purple", linestyle="-.", linewidth=1.2,
                   label="cache break" if i == 0 else None)
        ax.annotate(what, xy=(layer, 0.0), xycoords=("data", "axes fraction"), xytext=(4, 4),
                    textcoords="offset points", fontsize="small", color="purple",
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="purple", alpha=0.9), zorder=5)


def _labels(report: Report, data: dict, ax, ax2, row_rtol: float) -> None:
    """Title (origins, verdict, the rule), axis labels and the legends beside the axes."""
    from matplotlib.ticker import MaxNLocator  # deferred with matplotlib itself
    fb = report.first_break
    res = report.policy.kinds["residual"]
    stats = any(s["stats"] for s in data.values())
    cal = report.policy.calibration
    origins = f"{report.ref.get('origin')} vs {report.cand.get('origin')}"
    rule = (f"calibrated: row error vs float64 golden <= {cal['factor']:g}x the {cal['precision']} twin's noise"
            if cal else f"{report.policy.name}: atol {res.atol:g} + rtol {res.rtol:g}·|ref| + ntol {res.ntol:g}·rms")
    ax.set_title(visible(f"{origins}: {report.verdict} ({rule})").replace("$", r"\$"),  # no mathtext
                 fontsize="medium", pad=22 if fb is not None and fb.layer is not None else 6)
    ax.set_ylabel("max abs error" + (" (of statistics)" if stats else ""))
    ax2.set_ylabel("max ||c - g|| / ||g|| per row\n(g: float64 golden)" if cal else "max ||c - r|| / ||r|| per row")
    ax2.set_xlabel("layer")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if row_rtol > 0:
        ax2.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
