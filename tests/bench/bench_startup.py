"""Start-up: `prefill-diff run reference batched-left` against `python -c "import torch"` (issue 18: <= 1.5x).

Both commands run as fresh processes, alternately, in a scratch directory; medians of wall-clock seconds.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

TORCH = [sys.executable, "-c", "import torch"]
RUN = [sys.executable, "-c", "from prefill_diff.cli.main import main; main()", "run", "reference", "batched-left"]


def _seconds(cmd: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def run(smoke: bool = False) -> dict:
    rounds = 1 if smoke else 5
    torch_s, run_s = [], []
    load_before = _load()
    with tempfile.TemporaryDirectory() as cwd:
        _seconds(TORCH, cwd)  # warm the page cache for both, unmeasured
        _seconds(RUN, cwd)
        for _ in range(rounds):
            torch_s.append(_seconds(TORCH, cwd))
            run_s.append(_seconds(RUN, cwd))
    t, r = statistics.median(torch_s), statistics.median(run_s)
    return {"rounds": rounds, "import torch (s, median)": round(t, 3), "run reference batched-left (s, median)":
            round(r, 3), "run / import torch (medians)": round(r / t, 2),
            "load average (1, 5, 15 min) before, after": (load_before, _load()), "cpus": os.cpu_count()}
