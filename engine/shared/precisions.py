"""Every precision prefill-diff names, declared once: a shared leaf (it imports nothing of ours), so the engine,
the trace format and the verdict all import these lists from here, by these names."""

ACT_DTYPES = ("float64", "float32", "bfloat16", "float16")  # activation dtypes an engine may run
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # KV caches only
CACHE_DTYPES = ACT_DTYPES + ("int8",) + FP8_DTYPES  # what a KV cache may store
# short names people write, for "did you mean": a dtype's letters and bits (the tolerance policies accept these as
# names too), then C's words
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64",
                 "half": "float16", "float": "float32", "double": "float64"}
PRECISION_ORDER = ("fp8_e5m2", "fp8_e4m3", "int8", "float16", "bfloat16", "float32", "float64")  # coarsest first
WEIGHT_QUANTS = ("none", "int8")  # a weight quantisation an engine may apply on request
INT8_SCALES = ("per-token", "per-head")  # an int8 KV cache's scales: one per token and head, or per head and write
