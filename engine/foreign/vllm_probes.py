"""What vLLM's kernels do that the worker must know, taught by the kernels themselves: where the cache kernel
puts each (slot, head, dim) of a block, and how the kernels round float32 results to bfloat16.

The paged cache's layout inside a block is the kernel's business and differs by dtype and instruction set
(the float32 path stores keys transposed, bfloat16 on AMX is packed). ``learn_layout`` lets the kernel
teach it: it writes index-coded keys and values into a scratch block, one bit of each index per pass, and
reads back where each (slot, head, dim) landed. The same probe serves any kernel with the signature of
``cpu_attn_reshape_and_cache``. ``learn_rounding`` runs the rotary kernel on bfloat16 inputs and compares its
result with both ways of rounding the exact one.

Like the worker, this file runs in vLLM's environment and imports only torch and numpy (and vLLM's cache kernel
inside ``attention_layout``, called once vLLM runs): the worker loads it
by its path (engine/foreign/vllm_worker.py ``_beside``); prefill-diff's tests import it as a module.
"""
from __future__ import annotations

import math

import numpy as np
import torch


# -- the cache layout, taught by the kernel --------------------------------------------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns, as integers (any 1-, 2- or 4-byte dtype)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def learn_layout(write, block_size: int, n_heads: int, head_dim: int, dtype: torch.dtype):
    """Where the kernel ``write(keys, values, key_cache, value_cache, slots)`` puts each (slot, head, dim) of a
    block: two maps (keys, values) of shape (block_size, n_heads, head_dim) holding indices into one block's
    key (value) region viewed as a flat (n_heads * block_size * head_dim) vector.

    The region views are those vLLM's CPU backend hands the kernel: a [blocks, heads, 2 * block_size, dim]
    view of the cache, split in two along dim 2. Each pass writes 1.0 or 2.0 (exact in every float format)
    by one bit of every element's index into block 1 (so that slot numbers count from the block's start);
    the map must be a bijection, else the kernel is not one this probe understands."""
    n = block_size * n_heads * head_dim
    code = torch.arange(n, dtype=torch.int64).reshape(block_size, n_heads, head_dim)
    slots = torch.arange(block_size, dtype=torch.int64) + block_size
    one, two = _patterns(write, block_size, n_heads, head_dim, dtype)
    seen = {w: torch.zeros(n, dtype=torch.int64) for w in ("k", "v")}
    written = {w: torch.ones(n, dtype=torch.bool) for w in ("k", "v")}
    for j in range(max(1, math.ceil(math.log2(n)))):
        cache = torch.zeros((2, n_heads, 2 * block_size, head_dim), dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        x = (1.0 + ((code >> j) & 1)).to(torch.float32)
        write(x, x, kc, vc, slots)
        for which, region in (("k", kc[1]), ("v", vc[1])):
            raw = _bits(region.reshape(-1).clone())
            written[which] &= (raw == one) | (raw == two)
            seen[which] |= ((raw == two).to(torch.int64) << j)
    maps = {}
    for which in ("k", "v"):
        where = torch.nonzero(written[which]).flatten()
        if where.numel() != n:
            raise RuntimeError(f"the cache kernel wrote {where.numel()} elements of a block for {n}")
        inv = torch.full((n,), -1, dtype=torch.int64)
        inv[seen[which][where]] = where
        if (inv < 0).any():
            raise RuntimeError("the cache kernel's layout is not a bijection of (slot, head, dim)")
        maps[which] = inv.reshape(block_size, n_heads, head_dim)
    return maps["k"], maps["v"]


FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def attention_layout(attn, block_size: int, n_heads: int, head_dim: int, cache_dtype, src_dtype):
    """A vLLM attention layer's cache layout, taught by its own cache kernel (vLLM's, imported here: the worker
    calls this once vLLM runs), and how its elements read back as floats (an fp8 cache: its bytes as the fp8
    format, times the layer's scale): (key layout, value layout, dequantise(x, scale))."""
    from vllm import _custom_ops as ops
    kv_dtype = getattr(attn, "kv_cache_dtype", None) or getattr(attn.impl, "kv_cache_dtype", "auto")

    def write(k, v, kc, vc, slots):  # src_dtype: what attention hands the kernel
        ops.cpu_attn_reshape_and_cache(k.to(src_dtype), v.to(src_dtype), kc, vc, slots, attn.isa, 1.0, 1.0, kv_dtype)
    f = FP8.get(kv_dtype)
    dq = (lambda x, scale: x.view(f).to(torch.float32) * scale) if f else (lambda x, scale: x.to(torch.float32))
    lk, lv = learn_layout(write, block_size, n_heads, head_dim, cache_dtype)
    return lk, lv, dq


def _patterns(write, block_size, n_heads, head_dim, dtype):
    """The stored bit patterns of 1.0 and 2.0: one block written all 1.0, then all 2.0."""
    out = []
    for value in (1.0, 2.0):
        cache = torch.zeros((2, n_heads, 2 * block_size, head_dim), dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        x = torch.full((block_size, n_heads, head_dim), value)
        write(x, x, kc, vc, torch.arange(block_size, dtype=torch.int64) + block_size)
        vals = torch.unique(_bits(kc[1].reshape(-1).clone()))
        vals = [int(v) for v in vals if int(v) != 0]
        if len(vals) != 1:
            raise RuntimeError(f"the cache kernel stored {value} as {len(vals)} different patterns")
        out.append(vals[0])
    return out


def read_cache(region: torch.Tensor, blocks, n: int, layout, as_float) -> np.ndarray:
    """Positions 0..n-1 of one sequence from a cache region view [blocks, heads, block_size, dim], through its
    block table row ``blocks`` and the learned ``layout``: (heads, n, dim) float32."""
    block_size, n_heads, head_dim = layout.shape
    need = -(-n // block_size)
    flat = region[torch.as_tensor(list(blocks[:need]), dtype=torch.int64)].reshape(need, -1)
    got = flat[:, layout.reshape(-1)].reshape(need * block_size, n_heads, head_dim)[:n]
    return as_float(got).permute(1, 0, 2).contiguous().numpy()


# -- how the kernels round to bfloat16, taught by the rotary embedding ---------------------------------

def _truncate(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 toward zero: the upper 16 bits."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def learn_rounding(rotate, cos_sin: torch.Tensor, head_size: int, neox: bool) -> str:
    """How the kernel ``rotate(positions, query, key) -> (query, key)`` rounds its float32 result to bfloat16:
    ``nearest`` (to nearest even, as torch does), ``truncate`` (toward zero: the upper 16 bits, as vLLM's x86
    CPU kernels do where AVX512-BF16 is missing), ``other``, or ``unknown`` (too few elements told them apart).

    ``cos_sin`` is the kernel's table [positions, rotary_dim] (cos half, then sin half), which vLLM's kernels
    read in the query's dtype. The float32 result is recomputed from those bfloat16 inputs: a product of two
    bfloat16 values is exact in float32, so the two ways of rounding differ only in the final conversion."""
    g = torch.Generator().manual_seed(0)
    n, r = 256, cos_sin.shape[-1]
    pos = torch.randint(1, cos_sin.shape[0], (n,), generator=g)
    q = torch.randn(n, head_size, generator=g).to(torch.bfloat16)
    dev = cos_sin.device
    got, _ = rotate(pos.to(dev), q.clone().to(dev), q.clone().to(dev))
    got = got.reshape(n, head_size)[:, :r].cpu()
    cos, sin = cos_sin[pos.to(dev)].cpu().to(torch.bfloat16).float().chunk(2, dim=-1)
    x = q[:, :r].float()
    x1, x2 = (x[:, :r // 2], x[:, r // 2:]) if neox else (x[:, 0::2], x[:, 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    exact = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    near, down = exact.to(torch.bfloat16), _truncate(exact)
    tells = near != down
    if int(tells.sum()) < 32:
        return "unknown"
    for name, want in (("nearest", near), ("truncate", down)):
        if float((got[tells] == want[tells]).float().mean()) >= 0.95:
            return name
    return "other"


def model_rounding(model, dtype) -> str | None:
    """The bfloat16 rounding of a vLLM model's own rotary kernel; None when the model does not compute in
    bfloat16 or has no rotary embedding this probe reads."""
    if dtype != torch.bfloat16:
        return None
    try:
        rope = model.model.layers[0].self_attn.rotary_emb
        return learn_rounding(rope, rope.cos_sin_cache, int(rope.head_size), bool(rope.is_neox_style))
    except Exception:  # a model whose rotary embedding differs: the trace says so instead of guessing
        return "unknown"
