"""Names and version of the trace format; docs/trace-format.md is the prose contract."""

FORMAT_NAME = "prefill-diff-trace"
FORMAT_VERSION = "1.1"  # 1.1: tensor-parallel rank traces (meta.parallel, dataset placement attributes)
READABLE_MAJOR = (1,)  # the reader accepts any 1.x; a newer minor only adds optional items

LEVELS = ("full", "sampled", "stats")

# Per-layer residual-stream states, in the order they are computed (seed §2.3-§2.4).
STATES = ("layer_input", "attn_update", "attn_heads", "mid", "mlp_update", "layer_output")
REQUIRED_STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")
CACHE_TENSORS = ("keys", "values")

# Columns of every stats row: over the sample's valid cells, then over its computed padding cells.
STAT_COLUMNS = ("count", "finite", "min", "max", "mean", "l2", "pad_count", "pad_finite")

META_LIMIT = 16 * 1024 * 1024  # bytes of JSON a reader will parse from one attribute


def layer_group(layer: int) -> str:
    return f"layers/{layer:03d}"
