"""--plot: error per layer and sub-layer, log scale, with every out-of-tolerance point marked (matplotlib).

The element rule's bound (atol + rtol·|ref| + ntol·rms(row)) differs from element to element, so no single
horizontal line can stand for it; instead each point that broke tolerance is circled in red, so the picture
always agrees with the verdict. A second panel shows the largest relative row error, ||c - r|| / ||r||, the
scale-free view of the same data, with the row rule's threshold when the policy sets one.
"""
from __future__ import annotations

from ..engine.errors import PrefillDiffError
from ..engine.untrusted import visible
from .report import Report

SERIES = (("attn_update", "attention update"), ("mlp_update", "MLP update"), ("layer_output", "layer output"),
          ("cache_keys", "cache keys"), ("cache_values", "cache values"))
FLOOR = 1e-12  # exact zeros drawn here on the log scale


def plot_data(report: Report) -> dict:
    """What the plot draws: per series (label, layers, max abs, max row rel, layers out of tolerance)."""
    out = {}
    for name, label in SERIES:
        rows = [(lr.layer, lr.tensor(name)) for lr in report.layers if lr.tensor(name) is not None]
        if not rows:
            continue
        out[name] = {"label": label, "layers": [i for i, _ in rows],
                     "max_abs": [max(t.max_abs, FLOOR) for _, t in rows],
                     "max_row_rel": [max(t.max_row_rel, FLOOR) for _, t in rows],
                     "broken": [i for i, t in rows if not t]}
    return out


def plot_errors(report: Report, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PrefillDiffError("--plot needs matplotlib: pip install 'prefill-diff[plot]'") from None
    data = plot_data(report)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for s in data.values():
        for a, key in ((ax, "max_abs"), (ax2, "max_row_rel")):
            line, = a.plot(s["layers"], s[key], marker="o", label=s["label"])
            bad = [(i, y) for i, y in zip(s["layers"], s[key]) if i in s["broken"]]
            if bad:
                a.scatter(*zip(*bad), s=160, facecolors="none", edgecolors="red", linewidths=2, zorder=3)
    ax.scatter([], [], s=160, facecolors="none", edgecolors="red", linewidths=2, label="out of tolerance")
    row_rtol = report.policy.kinds["residual"].row_rtol
    if row_rtol > 0:
        ax2.axhline(row_rtol, color="red", linestyle="--", label=f"row_rtol {row_rtol:g} (residual)")
    if report.first_break is not None and report.first_break.layer is not None:
        for a in (ax, ax2):
            a.axvline(report.first_break.layer, color="grey", linestyle=":")
    res = report.policy.kinds["residual"]
    origins = visible(f"{report.ref.get('origin')} vs {report.cand.get('origin')}").replace("$", r"\$")  # no mathtext
    ax.set_title(f"{origins}: {report.verdict} "
                 f"({report.policy.name}: atol {res.atol:g} + rtol {res.rtol:g}·|ref| + ntol {res.ntol:g}·rms)",
                 fontsize="medium")
    ax.set_yscale("log")
    ax.set_ylabel("max abs error")
    ax.legend(fontsize="small")
    ax2.set_yscale("log")
    ax2.set_ylabel("max ||c - r|| / ||r|| per row")
    ax2.set_xlabel("layer")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    if row_rtol > 0:
        ax2.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)
