"""--plot: max abs error per layer and sub-layer, log scale, with the tolerance line (matplotlib)."""
from __future__ import annotations

from ..engine.errors import PrefillDiffError
from .report import Report

SERIES = (("attn_update", "attention update"), ("mlp_update", "MLP update"), ("layer_output", "layer output"),
          ("cache_keys", "cache keys"), ("cache_values", "cache values"))


def plot_errors(report: Report, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PrefillDiffError("--plot needs matplotlib: pip install 'prefill-diff[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    layers = [lr.layer for lr in report.layers]
    floor = 1e-12
    for name, label in SERIES:
        ys = [(lr.tensor(name).max_abs if lr.tensor(name) is not None else None) for lr in report.layers]
        if any(y is not None for y in ys):
            ax.plot(layers, [max(y, floor) if y is not None else float("nan") for y in ys], marker="o", label=label)
    atol = report.policy.kinds["residual"].atol
    ax.axhline(atol, color="red", linestyle="--", label=f"atol {atol:g} ({report.policy.name})")
    if report.first_break is not None and report.first_break.layer is not None:
        ax.axvline(report.first_break.layer, color="grey", linestyle=":", label="first break")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("max abs error")
    ax.set_title(f"{report.ref.get('origin')} vs {report.cand.get('origin')}: {report.verdict}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)
