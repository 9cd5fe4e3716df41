"""--calibrate: measure the reference's own rounding noise against a float64 run of the same path.

Like torch._dynamo's accuracy check (which compares both results with a float64 golden run), the
candidate is allowed a declared multiple K of the reference's error, per layer and tensor, measured in
units of the row RMS (the error of a matmul or norm scales with its vectors, not with one element):

    |cand - ref| <= K·n(l, t)·rms(ref row) + K·eps(dtype)·|ref|,   n(l, t) = max |ref - ref64| / rms(ref64 row)

so "noise" is measured on this model, these prompts and this machine instead of guessed.
"""
from __future__ import annotations

import numpy as np

from ..dumps.reader import Trace
from ..engine.errors import ConfigError
from .report import compare_traces
from .tolerance import KINDS, Policy, Tolerance

_EPS = {"float32": float(np.finfo(np.float32).eps), "bfloat16": 2.0 ** -7, "float16": float(np.finfo(np.float16).eps)}


def calibrated_policy(ref: Trace, ref64: Trace, factor: float) -> Policy:
    if not factor > 0:
        raise ConfigError(f"--calibrate takes a positive multiple (got {factor})")
    dtype = ref.meta.get("engine", {}).get("dtype", "float32")
    if dtype not in _EPS:
        raise ConfigError(f"--calibrate measures the reference against float64, so the reference must be less "
                          f"precise (got reference dtype {dtype})")
    exact = Policy("exact", {k: Tolerance(0.0, 0.0) for k in KINDS})
    golden = compare_traces(ref64, ref, exact)
    rtol = factor * _EPS[dtype]
    per_layer = {}
    for layer, tensors in [(lr.layer, lr.tensors) for lr in golden.layers] + [(None, golden.final.tensors)]:
        for t in tensors:
            per_layer[(layer, t.tensor)] = Tolerance(0.0, rtol, factor * t.min_ntol)
    return Policy(f"calibrated: {factor:g} x reference error vs float64", {k: Tolerance(0.0, rtol) for k in KINDS},
                  per_layer=per_layer, calibration={"factor": factor, "reference_dtype": dtype,
                                                    "golden": "float64", "rtol": rtol})
