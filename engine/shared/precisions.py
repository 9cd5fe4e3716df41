"""Every precision prefill-diff names, declared once: a shared leaf (it imports nothing of ours), so the engine,
the trace format (dumps/schema.py re-exports these) and the verdict all read the same lists."""

FLOATS = ("float64", "float32", "bfloat16", "float16")  # activation dtypes an engine may run
FP8 = ("fp8_e4m3", "fp8_e5m2")  # KV caches only
CACHE_DTYPES = FLOATS + ("int8",) + FP8  # what a KV cache may store
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp64": "float64", "double": "float64"}  # short names people write, for "did you mean"
PRECISION_ORDER = ("fp8_e5m2", "fp8_e4m3", "int8", "float16", "bfloat16", "float32", "float64")  # coarsest first
