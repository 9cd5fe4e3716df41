"""vLLM's bfloat16 on an x86 CPU without AVX512-BF16, emulated by our engine (docs/performance.md).

vLLM's x86 CPU kernels convert float32 to bfloat16 by truncation (toward zero) where AVX512-BF16 is
missing; torch, and so our twin, rounds to nearest. This records our engine in bfloat16 with those
kernels' two conversions -- RoPE computed in float32 and rounded toward zero, attention computed in
float32 on the bfloat16 inputs and its output rounded toward zero (``--rope-only``: the first alone) --
and compares it with the float32 reference under the calibrated rule, which measures the noise of a
twin that rounds to nearest. It needs no vLLM: it shows what rounding alone does to the verdict.

    python tests/bench/rounding.py [--model smollm2] [--rope-only] [--out DIR]

Prints, as JSON: the verdict line, and per layer the largest calibrated ratio (candidate error over the
twin's noise; the rule allows 4).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile


def truncate(x):
    """float32 -> bfloat16 toward zero: the upper 16 bits."""
    import torch
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@contextlib.contextmanager
def rounding_toward_zero(attention: bool = True):
    """Our engine's bfloat16 RoPE (and, with ``attention``, its attention output) rounded as vLLM's x86 CPU
    kernels round without AVX512-BF16; float32 and float64 runs are untouched."""
    import torch

    from prefill_diff.engine.native import model, prefill
    rope, kernel = model.apply_rope, prefill.ForwardStep._kernel

    def apply_rope(x, cos, sin):
        if x.dtype != torch.bfloat16:
            return rope(x, cos, sin)
        return truncate(rope(x.float(), cos.float(), sin.float()))

    def _kernel(self, layer, q_rot, keys, values, mask):
        if q_rot.dtype != torch.bfloat16:
            return kernel(self, layer, q_rot, keys, values, mask)
        return truncate(kernel(self, layer, q_rot.float(), keys.float(), values.float(), mask))

    model.apply_rope = prefill.apply_rope = apply_rope
    if attention:
        prefill.ForwardStep._kernel = _kernel
    try:
        yield
    finally:
        model.apply_rope = prefill.apply_rope = rope
        prefill.ForwardStep._kernel = kernel


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefill_diff", *map(str, args)], capture_output=True, text=True)


def run(model: str = "smollm2", attention: bool = True, out: str | None = None) -> dict:
    from prefill_diff.cli.main import cli
    with tempfile.TemporaryDirectory() as tmp:
        d = out or tmp
        os.makedirs(d, exist_ok=True)
        ref, cand, config = (os.path.join(d, n) for n in ("ref.h5", "emulated.h5", "bf16.toml"))
        done = _cli("record", "reference", "--model", model, "-o", ref, "--force", "--twin-of", "bfloat16")
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        with open(config, "w") as f:
            f.write('[run]\ndtype = "bfloat16"\n')
        with rounding_toward_zero(attention), contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON only
            try:
                cli(["record", config, "--model", model, "-o", cand, "--force"], prog_name="prefill-diff")
            except SystemExit as e:
                if e.code:
                    raise
        done = _cli("compare", ref, cand, "--json", "-")
        if done.returncode not in (0, 1):
            raise RuntimeError(done.stderr[-2000:] or done.stdout[-2000:])
        rep = json.loads(done.stdout)
    ratios = [max((t.get("calibrated") or {}).get("max_ratio") or 0.0 for t in lr["tensors"].values())
              for lr in rep["layers"]]
    return {"model": model, "rounded_toward_zero": "rope and attention" if attention else "rope",
            "verdict_line": rep["verdict_line"], "rule": rep["rule"].split(" (")[0],
            "max_ratio_per_layer": [round(r, 2) for r in ratios]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python tests/bench/rounding.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="model source (default: smollm2)")
    ap.add_argument("--rope-only", action="store_true", help="round only RoPE toward zero")
    ap.add_argument("--out", help="keep ref.h5 and emulated.h5 here")
    a = ap.parse_args()
    print(json.dumps(run(a.model, not a.rope_only, a.out), indent=2))
