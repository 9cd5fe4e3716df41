"""The sampled level's subset, declared by the trace: which token indices (evenly spaced, first and last
included) and which channels (drawn by a seed) are kept, and the gathering of those values."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np

from .reductions import is_torch, to_numpy, widen_bfloat16

def select_tokens(length: int, k: int) -> list[int]:
    """The sampled level's token indices: k evenly spaced over the prompt, first and last included."""
    if length <= k:
        return list(range(length))
    return sorted({round(i * (length - 1) / (k - 1)) for i in range(k)})


@functools.lru_cache(maxsize=64)
def select_channels(width: int, k: int, seed: int) -> np.ndarray:
    """The sampled level's channels of a ``width``-wide tensor: k drawn by ``seed``, sorted (read-only: the
    same array serves every layer)."""
    ch = np.arange(width) if width <= k else np.sort(np.random.default_rng(seed).choice(width, k, replace=False))
    ch.flags.writeable = False
    return ch


def gather(x, rows: np.ndarray, channels: np.ndarray, heads: int | None = None) -> np.ndarray:
    """x[rows][:, channels] as numpy (bfloat16 widened, exact): of a (T, width) tensor, or with ``heads`` of
    a cache tensor's slots (heads, T, head_dim) -> (T, heads·head_dim). Only the gathered values are copied
    (a CPU tensor by numpy, see slab_stats; one on an accelerator is brought over whole)."""
    bf16 = is_torch(x) and x.device.type == "cpu" and str(x.dtype) == "torch.bfloat16"
    a = x.detach().view(sys.modules["torch"].int16).numpy() if bf16 else to_numpy(x)
    if heads is None:
        got = a[rows[:, None], channels]
    else:
        D = a.shape[2]
        got = a[channels // D, rows[:, None], channels % D]  # slot row r, channel c = head·D + d
    return widen_bfloat16(got) if bf16 else got


@dataclass
class Sampled:
    """One tensor's sampled values at one layer, kept in memory until the layer is written."""
    values: np.ndarray  # (S, P, K), NaN where no token was recorded
    channels: np.ndarray  # (K,) the sampled channels of a ``width``-wide tensor
    width: int
    source_dtype: str
