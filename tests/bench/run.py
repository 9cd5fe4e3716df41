"""Run the benchmarks: python tests/bench/run.py [BENCH ...|all] [--smoke]

Each benchmark prints ratios measured side by side in this one process, with the machine, thread count
and sizes. --smoke runs seconds-long sizes (the test suite does this, to keep the benchmarks working);
the numbers in docs/performance.md come from the full sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_calibrate  # noqa: E402
import bench_compare  # noqa: E402
import bench_decode  # noqa: E402
import bench_engine  # noqa: E402
import bench_failfast  # noqa: E402
import bench_llamacpp  # noqa: E402
import bench_model_cache  # noqa: E402
import bench_ops  # noqa: E402
import bench_record  # noqa: E402
import bench_startup  # noqa: E402
import bench_vllm  # noqa: E402

BENCHES = {"record": bench_record.run, "compare": bench_compare.run, "engine": bench_engine.run,
           "failfast": bench_failfast.run, "calibrate": bench_calibrate.run,
           "llamacpp": bench_llamacpp.run, "startup": bench_startup.run, "model_cache": bench_model_cache.run,
           "vllm": bench_vllm.run, "decode": bench_decode.run, "ops": bench_ops.run}


def machine() -> dict:
    import torch
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024 // 1024
    except OSError:
        pass
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "memory_gib": mem,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python tests/bench/run.py", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="BENCH",
                    help=f"one or more of {', '.join(BENCHES)}, or all (the default)")
    ap.add_argument("--smoke", action="store_true", help="seconds-long sizes, to check that the benchmarks run")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in (*BENCHES, "all")]
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHES)} or all")
    names = list(BENCHES) if not args.names or "all" in args.names else args.names
    smoke = args.smoke
    out = {"machine": machine(), "smoke": smoke}
    print(json.dumps({"machine": out["machine"], "smoke": smoke}, indent=2), flush=True)
    for n in names:
        out[n] = BENCHES[n](smoke=smoke)
        print(json.dumps({n: out[n]}, indent=2), flush=True)
    return out


if __name__ == "__main__":
    main()
