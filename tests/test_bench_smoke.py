"""The benchmarks keep working: each runs at its seconds-long smoke size (numbers are not asserted here;
they live in docs/performance.md, measured side by side at full size)."""
from __future__ import annotations

import pytest
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # the benchmarks' smoke runs


def test_benchmarks_run_at_smoke_size():
    sys.path.insert(0, str(Path(__file__).parent / "bench"))
    import run
    out = run.main(["--smoke"])
    assert out["machine"]["cpus"] >= 1
    assert out["record"]["stats trace / none (median of rounds)"] > 0
    assert out["compare"]["verdict"] == "pass"
    assert out["compare"]["peak RSS, 1x traces (MiB)"] > 0
    assert out["engine"]["eager: logits max abs difference"] < 1e-4
    assert out["failfast"]["first break layer, layers compared, stopped early"] == (0, 1, True)
    assert out["calibrate"]["verdicts"] == [("pass", "pass", "calibrated")]
    # "calibrated" above: the golden and the twin were recorded (a ratio of one smoke-size round, whose first run
    # pays the warm-up, says nothing either way)
    assert out["calibrate"]["calibrated_run_s"] > 0 and out["calibrate"]["ratio_median"] > 0
    assert out["llamacpp"]["capture / plain (median of rounds)"] > 0
    assert out["llamacpp"]["logits max abs, capture vs plain"] < 1e-4
    assert out["startup"]["run / import torch (medians)"] > 1  # the run imports torch, then does more
    assert out["model_cache"]["second, cached (s, median)"] > 0 and out["model_cache"]["cache size (MiB)"] > 0
    assert out["decode"]["decode / one prefill, bare (median of rounds)"] > 0
    assert out["decode"]["ms per decode step, bare"] > 0
    assert out["ops"]["record"]["reference"]["ops / full, bytes"] > 1  # the op level keeps the layer level's states too
    assert out["ops"]["record"]["transformers"]["ops / full, seconds (median of rounds)"] > 0
    assert out["ops"]["compare"]["verdicts"] == {"tolerance": "pass", "exact": "fail"}  # the engines' bits differ
    assert out["ops"]["replay"]["ops replayed"] > 0
    assert out["ops"]["replay"]["replay / recording (median of rounds)"] > 0
    assert out["vllm"]["record_over_bare"] > 0 and out["vllm"]["decode_capture_over_bare_generate"] > 0
    assert out["vllm"]["agreement"]["vllm-decode"]["verdict"] == "pass" and out["vllm"]["agreement"]["vllm"]["verdict"] == "pass"


def test_rounding_like_vllms_cpu_kernels_is_measured_on_the_built_in_model():
    """tests/bench/rounding.py: our engine with RoPE and attention rounded toward zero, as vLLM's x86 CPU kernels
    round without AVX512-BF16, is judged against a twin that rounds to nearest: noisier than the twin, and on the
    built-in model within the rule (docs/performance.md has SmolLM2, where it is not)."""
    sys.path.insert(0, str(Path(__file__).parent / "bench"))
    import rounding
    out = rounding.run("synthetic")
    assert out["rule"].startswith("calibrated"), out
    assert 1.2 < max(out["max_ratio_per_layer"]) < 4 and out["verdict_line"].startswith("PASSED"), out
