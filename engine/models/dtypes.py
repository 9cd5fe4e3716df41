"""The torch dtype of each precision name (engine/shared/precisions.py), for every engine that makes tensors."""
from __future__ import annotations

import torch

from ..shared.precisions import ACT_DTYPES, FP8_DTYPES

# fp8 as vLLM stores it; a KV cache of ours divides by the layer's scale before the cast (engine/native/kv_cache.py)
FP8_TORCH = dict(zip(FP8_DTYPES, (torch.float8_e4m3fn, torch.float8_e5m2)))
_TORCH = {**dict(zip(ACT_DTYPES, (torch.float64, torch.float32, torch.bfloat16, torch.float16))), "int8": torch.int8,
          **FP8_TORCH}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]
