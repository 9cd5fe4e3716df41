"""Benchmark 2: streaming compare. `compare` of two full traces (>= 1 GiB each) against a bare h5py+numpy
pass over the same datasets (read one chunk at a time, np.abs(a - b).max()) and against just reading the
files' bytes, warm and cold (page cache evicted with posix_fadvise before each pass), in interleaved
rounds; the machine load beside each ratio; and peak memory (RSS) of the compare with a trace twice as
large.

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


def our_compare(a: str, b: str, fast: bool = True) -> bool:
    """`compare` of the two files; fast=False: without the compiled kernels and without mapping the files (numpy
    metrics over rows read into buffers by the read-ahead thread, as when the kernels did not build or
    PREFILL_DIFF_NATIVE=0 and PREFILL_DIFF_MMAP=0 are set), to show what they give."""
    from prefill_diff.dumps import chunks, kernels, reader
    from prefill_diff.verify.report import compare_traces
    saved = kernels._MODULE, chunks.MMAP
    if not fast:
        kernels._MODULE, chunks.MMAP = None, False
    try:
        with reader.Trace(a) as ra, reader.Trace(b) as rb:
            return bool(compare_traces(ra, rb))
    finally:
        kernels._MODULE, chunks.MMAP = saved


def pure_read(paths) -> int:
    """The ceiling: every byte of the files read into one reused buffer, nothing computed."""
    buf, n = bytearray(8 << 20), 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while k := os.readv(fd, [buf]):
                n += k
        finally:
            os.close(fd)
    return n


def evict(paths, tries: int = 3) -> float:
    """Drop the files from the page cache (posix_fadvise DONTNEED: no root needed for files one can open;
    dirty pages are written first, and pages still under writeback stay, hence a few tries). Returns the
    fraction of sampled pages that are then not cached, probed with preadv(RWF_NOWAIT), which fails
    instead of reading from disk."""
    cold = 0.0
    for _ in range(tries):
        cold = _evict_once(paths)
        if cold == 1.0:
            break
    return cold


def _evict_once(paths) -> float:
    cold = probed = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size, page = os.fstat(fd).st_size, bytearray(4096)
            for off in range(0, size, max(size // 64, 4096)):
                probed += 1
                try:
                    os.preadv(fd, [page], off, os.RWF_NOWAIT)
                except BlockingIOError:
                    cold += 1
        finally:
            os.close(fd)
    return cold / max(probed, 1)


def timed_rounds(ref: str, cand: str, repeats: int, cold: bool) -> dict:
    """Interleaved rounds of the bare pass, compare (with and without its compiled kernels and mapping) and the pure read
    (evicted before each when cold); per round, compare's throughput over the bare pass's and over the pure
    read's; the load beside them."""
    times = {"bare": [], "compare": [], "numpy, read": [], "read": []}
    evicted, ok, load = [], None, [os.getloadavg()[0]]
    passes = {"bare": lambda: bare_pass(ref, cand), "compare": lambda: our_compare(ref, cand),
              "numpy, read": lambda: our_compare(ref, cand, fast=False), "read": lambda: pure_read((ref, cand))}
    for _ in range(repeats):  # interleaved: drift on a shared machine hits all three alike
        for name, fn in passes.items():
            if cold:
                evicted.append(evict((ref, cand)))
            t0 = time.perf_counter()
            got = fn()
            times[name].append(time.perf_counter() - t0)
            ok = got if name == "compare" else ok
        load.append(os.getloadavg()[0])
    t = {k: np.asarray(v) for k, v in times.items()}
    return {"times": times, "ok": ok, "load": load, "evicted": evicted,
            "vs_bare": t["bare"] / t["compare"], "vs_read": t["read"] / t["compare"],
            "fast_gain": t["numpy, read"] / t["compare"]}


def _summary(kind: str, r: dict, size: int) -> dict:
    load = f"load {min(r['load']):.1f}-{max(r['load']):.1f} on {os.cpu_count()} CPUs"
    out = {f"{kind}: {k} (GiB/s, best round)": size / min(r["times"][k]) / 2 ** 30 for k in r["times"]}
    out.update({f"{kind}: compare / bare throughput (median of rounds)": f"{np.median(r['vs_bare']):.2f}x ({load})",
                f"{kind}: compare / pure read throughput (median of rounds)":
                    f"{np.median(r['vs_read']):.2f}x ({load})",
                f"{kind}: rounds, compare / bare": [round(float(x), 2) for x in r["vs_bare"]],
                f"{kind}: compare / compare without kernels or mapping (numpy metrics, rows read ahead into "
                f"buffers; median of rounds)": f"{np.median(r['fast_gain']):.2f}x ({load})"})
    if r["evicted"]:
        who = "as root" if os.geteuid() == 0 else "as a normal user"
        out[f"{kind}: eviction"] = (f"posix_fadvise(DONTNEED) {who}: {min(r['evicted']):.0%}-{max(r['evicted']):.0%} "
                                    "of probed pages not cached before each pass")
    return out


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
        warm = timed_rounds(ref, cand, repeats, cold=False)
        cold = timed_rounds(ref, cand, 1 if smoke else 3, cold=True)
        rss1 = peak_rss_mib(ref, cand)
        ref2, cand2 = os.path.join(d, "ref2.h5"), os.path.join(d, "cand2.h5")
        size2 = write_trace(ref2, cfg, 2 * cfg["layers"], 0.0) + write_trace(cand2, cfg, 2 * cfg["layers"], 1e-7)
        rss2 = peak_rss_mib(ref2, cand2)
    layer_mib = cfg["samples"] * cfg["cols"] * (len(STATES) * cfg["width"] + 2 * cfg["heads"] * cfg["head_dim"]) \
        * 4 / 2 ** 20
    out = {"config": f"{cfg['layers']} layers x {cfg['samples']} samples x {cfg['cols']} columns x d={cfg['width']}, "
                     f"two traces of {size / 2 ** 31:.2f} GiB each",
           "verdict": "pass" if warm["ok"] and cold["ok"] else "fail",
           **_summary("warm", warm, size), **_summary("cold", cold, size)}
    return {**out,
            "peak RSS, 1x traces (MiB)": rss1, "peak RSS, 2x traces (MiB)": rss2,
            "one layer of tensors, both traces (MiB)": 2 * layer_mib,
            "targets": "warm >= 1.0x bare and >= 0.5x pure read; cold >= 1.0x bare; RSS below 3 layers + "
                       "interpreter, not growing with trace size"}


if __name__ == "__main__":
    print(json.dumps(run("--smoke" in sys.argv), indent=2))
