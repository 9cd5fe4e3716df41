"""The full level: every value of a residual-stream state, over the cells both sides computed.

One sample row of each trace is read at a time (one HDF5 chunk each, into reused buffers, the next
pair read ahead on a background thread: Context.rows); its
aligned cells go through verify.metrics, its padding cells are counted for non-finite values. In a
calibrated comparison the candidate's, twin's and golden's rows also feed check (1).
"""
from __future__ import annotations

import numpy as np

from ..dumps.reader import LayerView
from . import wording
from .context import Context
from .results import Accumulator, TensorResult
from .tolerance import Tolerance


def compare_full_state(ctx: Context, r: LayerView, c: LayerView, name: str, tol: Tolerance) -> TensorResult:
    """State ``name`` of one layer, both sides at the full level."""
    rd, cd = r.state(name), c.state(name)
    if rd.shape[2] != cd.shape[2]:
        return TensorResult(tensor=name, level="full", tol=tol,
                            shape_detail=wording.width_differs(name, rd.shape[2], cd.shape[2]))
    acc = Accumulator(tol, ctx.equal_nan)
    heads = ctx.ref.args.get("n_heads") if name == "attn_heads" else None
    cal = ctx.calib_acc(heads)
    gd, td = ctx.calib_datasets(r.layer, name)
    pad_r = pad_c = 0
    pad_by, by_phase = [], None
    for rs, cs, rrow, crow, grow, trow in ctx.rows(rd, cd, gd, td):
        cells = ctx.align.cells[rs]
        a, b = rrow[cells.ref_cols], crow[cells.cand_cols]
        dec = ctx.decoded(rs, cs, cells.ref_cols, cells.cand_cols)
        if dec is not None:  # a side decoded: the prompt's rows and the response's, apart
            by_phase = by_phase or {"prefill": 0.0, "decode": 0.0}
            err = np.abs(a.astype(np.float64) - b)
            for phase, rows in (("prefill", ~dec), ("decode", dec)):
                if rows.any():
                    by_phase[phase] = max(by_phase[phase], float(err[rows].max()))
        if cal is not None:
            cal.add(b, a if trow is None else trow[cells.ref_cols], grow[cells.ref_cols], rs, cells.tokens)
        acc.add(a, b, rs, cells.tokens, heads)
        nr = int((~np.isfinite(rrow[cells.ref_pad])).sum()) if cells.ref_pad.size else 0
        nc = int((~np.isfinite(crow[cells.cand_pad])).sum()) if cells.cand_pad.size else 0
        if nc != nr:
            acc.p.bad_samples.setdefault(rs, None)
            pad_by.append((rs, nr, nc))
        pad_r, pad_c = pad_r + nr, pad_c + nc
    return acc.result(name, "full", pad_ref=pad_r, pad_cand=pad_c, pad_by_sample=pad_by, by_phase=by_phase,
                      calib=None if cal is None else cal.result())
