"""Survey: how far each preset lands from `reference`, and how far each fault does.

    python tests/bench/tolerances.py [--model synthetic|seed-2.8|smollm2|hf:DIR]

For every preset it prints the policy the defaults pick, the largest max-abs error over all layers and
tensors, the largest row error relative to the row norm, the logits error, and the smallest ntol that
would have passed with the policy's atol and rtol. The default policies in verify/tolerance.py must sit
above every non-fault row and below every fault row.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.presets import PRESETS
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces


def _ntol_without_rows(t) -> float:
    """min_ntol is measured on rows the row rule did not accept; with the rule on it understates."""
    return float("nan") if t.rows_by_row_rule else t.needed.ntol


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--presets", default="")
    a = ap.parse_args(argv)
    spec = ModelSpec(a.model)
    names = a.presets.split(",") if a.presets else [p for p in PRESETS if p != "reference"]
    with tempfile.TemporaryDirectory() as d:
        ref = record_side(prepare_side("reference", spec), os.path.join(d, "ref.h5"))
        print(f"model {a.model}")
        print(f"{'preset':24s} {'verdict':7s} {'policy':20s} {'max_abs':>9s} {'row_rel':>9s} {'logits':>9s} "
              f"{'need_ntol':>9s}  first break")
        print(f"{'':62s}(row_rel: largest relative L2 error of one row; need_ntol: with row_rtol off)")
        for i, name in enumerate(names):
            try:
                path = record_side(prepare_side(name, spec), os.path.join(d, f"{i}.h5"))
            except Exception as e:  # a preset the model cannot run (e.g. transformers without the extra)
                print(f"{name:24s} skipped: {e}")
                continue
            with Trace(ref) as r, Trace(path) as c:
                rep = compare_traces(r, c)
            vals = [t for lr in rep.layers for t in lr.tensors] + list(rep.final.tensors if rep.final is not None else ())
            mx = max((t.max_abs for t in vals), default=0.0)
            need = max((t.needed.ntol if not t.row_rtol else _ntol_without_rows(t) for t in vals), default=0.0)
            row = max((t.max_row_rel for t in vals), default=0.0)
            lg = rep.final.tensor("logits").max_abs if rep.final is not None else float("nan")
            fb = "" if rep.first_break is None else rep.verdict_line().split(" | ", 1)[1]
            print(f"{name:24s} {rep.verdict:7s} {rep.policy.name:20s} {mx:9.2e} {row:9.2e} {lg:9.2e} {need:9.2e}  {fb}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
