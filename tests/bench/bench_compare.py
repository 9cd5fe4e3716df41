"""Benchmark 2: streaming compare. `compare` of two full traces (>= 1 GiB each) against a bare h5py+numpy
pass over the same datasets (read one chunk at a time, np.abs(a - b).max()), and peak memory (RSS) of the
compare with a trace twice as large.

    python tests/bench/run.py compare [--smoke]

Traces are written through the public Recorder with random data (the engine is not what is measured);
the candidate is the reference plus noise inside the float32 tolerance, so every value is compared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

FULL = dict(samples=4, cols=1024, width=1024, heads=4, head_dim=64, layers=12)  # ~1.06 GiB per trace
SMOKE = dict(samples=2, cols=64, width=64, heads=2, head_dim=16, layers=2)
STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")


def write_trace(path: str, cfg: dict, layers: int, noise: float, seed: int = 0) -> int:
    from prefill_diff.dumps.recorder import Recorder
    S, C, W, H, D = cfg["samples"], cfg["cols"], cfg["width"], cfg["heads"], cfg["head_dim"]
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((S, C, W), dtype=np.float32)
    kv = rng.standard_normal((S, H, C, D), dtype=np.float32)
    noise_rng = np.random.default_rng(seed + 1)
    meta = {"model": {"args": {"dim": W, "n_layers": layers, "n_heads": H, "n_kv_heads": H, "head_dim": D,
                               "vocab_size": 64}}, "engine": {"dtype": "float32"}}
    with Recorder(path, "full", force=True) as rec:
        rec.begin([list(range(1, C + 1))] * S, C, meta)
        for s in range(S):
            rec.inputs(s, 0, np.arange(1, C + 1), np.ones(C), np.arange(C), np.arange(C))
        for layer in range(layers):
            for name in STATES:
                x = base + np.float32(layer)
                if noise:
                    x = x + noise * noise_rng.standard_normal(x.shape, dtype=np.float32)
                for s in range(S):
                    rec.state(layer, name, s, 0, x[s])
            for s in range(S):
                rec.cache(layer, s, kv[s], kv[s], np.arange(C))
            rec.layer_done(layer)
        for s in range(S):
            rec.final(s, base[s, -1], base[s, -1, :64], C - 1, C - 1)
    return os.path.getsize(path)


def bare_pass(a: str, b: str) -> float:
    """The floor: read every dataset of both files one chunk at a time and take np.abs(a - b).max()."""
    worst = 0.0
    with h5py.File(a) as fa, h5py.File(b) as fb:
        names = []
        fa.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.ndim >= 3 else None)
        for n in names:
            da, db = fa[n], fb[n]
            for s in range(da.shape[0]):
                worst = max(worst, float(np.abs(da[s] - db[s]).max()))
    return worst


def our_compare(a: str, b: str) -> bool:
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.verify.report import compare_traces
    with Trace(a) as ra, Trace(b) as rb:
        return bool(compare_traces(ra, rb))


def drop_caches() -> bool:
    """Evict the page cache (root only), so the next pass reads from disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed_rounds(ref: str, cand: str, repeats: int, cold: bool):
    """Interleaved bare and compare passes; per-round ratio bare_time / compare_time."""
    t_bare, t_ours, ratios, ok = [], [], [], None
    for _ in range(repeats):  # interleaved: drift on a shared machine hits both alike
        if cold and not drop_caches():
            return None
        t0 = time.perf_counter()
        bare_pass(ref, cand)
        t_bare.append(time.perf_counter() - t0)
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        ok = our_compare(ref, cand)
        t_ours.append(time.perf_counter() - t0)
        ratios.append(t_bare[-1] / t_ours[-1])
    return t_bare, t_ours, ratios, ok


def peak_rss_mib(a: str, b: str) -> float:
    """Peak RSS (VmHWM: ru_maxrss would carry the parent's peak across exec) of `prefill-diff compare`."""
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "try:\n    cli(['compare', sys.argv[1], sys.argv[2], '-q'])\nexcept SystemExit: pass\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code, a, b], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def run(smoke: bool = False) -> dict:
    cfg = SMOKE if smoke else FULL
    repeats = 2 if smoke else 5
    with tempfile.TemporaryDirectory(dir=os.environ.get("PREFILL_DIFF_BENCH_DIR")) as d:
        ref, cand = os.path.join(d, "ref.h5"), os.path.join(d, "cand.h5")
        size = write_trace(ref, cfg, cfg["layers"], 0.0) + write_trace(cand, cfg, cfg["layers"], 1e-7)
        os.sync()  # no background writeback of the fresh files competing with the timed passes
        t_bare, t_ours, ratios, ok = timed_rounds(ref, cand, repeats, cold=False)
        cold = None if smoke else timed_rounds(ref, cand, 3, cold=True)
        rss1 = peak_rss_mib(ref, cand)
        ref2, cand2 = os.path.join(d, "ref2.h5"), os.path.join(d, "cand2.h5")
        size2 = write_trace(ref2, cfg, 2 * cfg["layers"], 0.0) + write_trace(cand2, cfg, 2 * cfg["layers"], 1e-7)
        rss2 = peak_rss_mib(ref2, cand2)
    layer_mib = cfg["samples"] * cfg["cols"] * (len(STATES) * cfg["width"] + 2 * cfg["heads"] * cfg["head_dim"]) \
        * 4 / 2 ** 20
    out = {"config": f"{cfg['layers']} layers x {cfg['samples']} samples x {cfg['cols']} columns x d={cfg['width']}, "
                     f"two traces of {size / 2 ** 31:.2f} GiB each",
           "verdict": "pass" if ok else "fail",
           "warm: bare numpy pass (GiB/s)": size / min(t_bare) / 2 ** 30,
           "warm: compare (GiB/s)": size / min(t_ours) / 2 ** 30,
           "warm: compare / bare throughput (median of rounds)": float(np.median(ratios)),
           "warm: rounds": [round(x, 2) for x in ratios]}
    if cold is None:
        out["cold"] = "not measured (smoke size, or evicting the page cache needs root)"
    else:
        out.update({"cold: bare numpy pass (GiB/s)": size / min(cold[0]) / 2 ** 30,
                    "cold: compare (GiB/s)": size / min(cold[1]) / 2 ** 30,
                    "cold: compare / bare throughput (median of rounds)": float(np.median(cold[2])),
                    "cold: rounds": [round(x, 2) for x in cold[2]]})
    return {**out,
            "peak RSS, 1x traces (MiB)": rss1, "peak RSS, 2x traces (MiB)": rss2,
            "one layer of tensors, both traces (MiB)": 2 * layer_mib,
            "targets": "throughput >= 0.7x bare; RSS below 3 layers + interpreter, not growing with trace size"}


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
