"""What the recorder keeps of every tensor besides (or instead of) its values: per-sample statistics (count,
finite count, min, max, sum, sum of squares) and a checksum, computed slab by slab as the tensor arrives, and
the final logits' top ids.

A CPU tensor is reduced with numpy on a zero-copy view, or in one pass by the compiled kernels
(dumps/kernels.py); a tensor on an accelerator is reduced there. Does not import torch: a tensor is used
through its own methods, and torch is taken from ``sys.modules`` when one is given.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from . import kernels
from .schema import STAT_COLUMNS

_MASK64 = (1 << 64) - 1


def is_torch(x) -> bool:
    return hasattr(x, "detach") and hasattr(x, "dtype") and str(x.dtype).startswith("torch.")


def source_dtype(x) -> str:
    return str(x.dtype).replace("torch.", "") if is_torch(x) else np.dtype(x.dtype).name


def to_numpy(x) -> np.ndarray:
    """Host copy of a tensor; bfloat16 becomes float32 (exact), other float dtypes are kept."""
    if is_torch(x):
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            if x.device.type != "cpu":
                return x.float().cpu().numpy()
            return widen_bfloat16(x.view(sys.modules["torch"].int16).numpy())  # numpy: no torch thread pool
        return x.cpu().numpy()
    return np.asarray(x)


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def slab_stats(x) -> tuple:
    """(count, finite, min, max, sum, sumsq, checksum) of a 2-D slab (rows, width).

    The slab is reduced in blocks of rows of about 1 MiB, which stay in the L2 cache across the passes
    over them (min, max, row sums, a dot for the sum of squares, the checksum); the finite count is only
    computed when sum or sumsq is not finite. The checksum is the wrapped int64 sum, row by row, of the
    data's 8-byte words (each row zero-padded to a multiple of 8 bytes), so it composes over any split into
    rows: equal data gives equal checksums. A differing checksum alone is never a failure. With the compiled
    kernels (dumps/kernels.py), a float32, float64 or bfloat16 slab is reduced in one pass instead.

    A CPU tensor is reduced with numpy on a zero-copy view: torch's reductions fan out to its thread
    pool, and on an oversubscribed machine each of the ~40 small reductions per layer waits for a
    descheduled thread (27-78 ms against 3 ms per state of 4 x 256 x 1024 at load 6). A tensor
    on an accelerator is reduced there.
    """
    n = math.prod(x.shape)
    if n == 0:
        return 0, 0, np.inf, -np.inf, 0.0, 0.0, 0
    if is_torch(x):
        torch = sys.modules["torch"]  # x is a torch tensor, so torch is already imported
        if x.device.type != "cpu":
            return _torch_stats(x.detach().contiguous(), n, torch)
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, widened block by block (exact)
            return _array_stats(np.ascontiguousarray(x.detach().view(torch.int16).numpy()), n, bfloat16=True)
        x = x.detach().numpy()  # a strided tensor is copied by numpy below, not by torch's thread pool
    return _array_stats(np.ascontiguousarray(x), n)


_BLOCK = 1 << 18  # values reduced together: 1 MiB of float32, which stays in the L2 cache across the passes


_HAS_VECDOT = hasattr(np, "vecdot")


_SUM_ROW = 1024  # row sums in the block's float dtype over at most about this many values, then float64


def widen_bfloat16(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 values given as their 16-bit patterns (int16 or uint16), as float32: exact, since a bfloat16
    is the top half of the float32 with the same value. ``out`` (uint32, the same size) is filled and
    returned viewed as float32; without it a new array is made."""
    u = bits.view(np.uint16)
    if out is None:
        out = np.empty(u.shape, dtype=np.uint32)
    else:
        out = out.reshape(u.shape)
    np.copyto(out, u)
    np.left_shift(out, 16, out=out)
    return out.view(np.float32)


def _sum_row(size: int, width: int) -> int:
    """How many values one row sum of a block of ``size`` values adds: _SUM_ROW or the largest power of two
    dividing the block below it (the block is contiguous: its rows need not be the tensor's), else the width.
    The rounding error of a sum grows with the values it adds in its dtype; short rows are slower."""
    c = int(np.gcd(size, _SUM_ROW))
    return c if c >= 64 else width


def _row_dots(m: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
    """Each row's dot product with ``v`` (None: with itself, its sum of squares), in m's dtype (per row: one dot
    of the whole block in float32 was off by 3.6e-5 on 2^18 values near 3e3). One dot per row, not a matrix-
    vector product: OpenBLAS threads those over a block, and a BLAS thread waiting for a busy core stalls the
    whole call on a loaded machine (verify/metrics.py found the same)."""
    if v is None:
        return np.vecdot(m, m) if _HAS_VECDOT else np.einsum("ij,ij->i", m, m)  # vecdot: numpy >= 2.0, faster
    return np.vecdot(m, v) if _HAS_VECDOT else np.einsum("ij,j->i", m, v)


def _array_stats(a: np.ndarray, n: int, bfloat16: bool = False) -> tuple:
    """slab_stats of a C-contiguous array (rows first); ``bfloat16``: ``a`` holds bfloat16 bit patterns. One pass
    of the compiled kernel (dumps/kernels.py) for float32, float64 and bfloat16, else _numpy_stats; the numpy
    code also takes over when a sum is not finite (it counts the finite values, and sums float32 values
    whose sums overflowed again in float64)."""
    k = kernels.compiled()
    rows = a.reshape(a.shape[0], -1)
    if k is not None and (bfloat16 or a.dtype in kernels.FLOAT_TYPES) and rows.strides[1] == rows.itemsize \
            and (k.unaligned_ok or rows.flags.aligned):
        lo, hi, s, ss, chk = k.stats(rows, bfloat16)
        if math.isfinite(s) and math.isfinite(ss):
            return n, n, lo, hi, s, ss, chk
    return _numpy_stats(a, n, bfloat16)


def _numpy_stats(a: np.ndarray, n: int, bfloat16: bool = False) -> tuple:
    """slab_stats of a C-contiguous array (rows first); ``bfloat16``: ``a`` holds bfloat16 bit patterns.

    float32 and float64 blocks are reduced as they are: row sums and rows' sums of squares by one dot per row
    (rows of up to _SUM_ROW values, see _sum_row), in their dtype, added in float64. float16 and bfloat16
    blocks are widened to float32 first (exact), other dtypes to float64."""
    rows = a.reshape(a.shape[0], -1)
    R, W = rows.shape
    step = max(1, _BLOCK // W)
    buf = np.empty(min(R, step) * W, dtype=np.uint32) if bfloat16 else None  # reused by every block

    def blocks():
        """(bits, values) per block of rows: values float32 or float64."""
        for i in range(0, R, step):
            blk = rows[i:i + step]
            if bfloat16:
                yield blk, widen_bfloat16(blk, buf[:blk.size])
            elif blk.dtype in (np.float32, np.float64):
                yield blk, blk
            else:
                yield blk, blk.astype(np.float32 if blk.dtype == np.float16 else np.float64)

    mins, maxs, s, ss, chk = [], [], 0.0, 0.0, 0
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, or float32 sums past 3.4e38
        for blk, v in blocks():
            f = v.reshape(-1)
            mins.append(f.min())
            maxs.append(f.max())
            m = f.reshape(-1, _sum_row(f.size, W))
            s += float(_row_dots(m, np.ones(m.shape[1], dtype=f.dtype)).sum(dtype=np.float64))
            ss += float(_row_dots(m).sum(dtype=np.float64))
            chk += _numpy_checksum(blk)
        finite = n
        if not (np.isfinite(s) and np.isfinite(ss)):
            finite = sum(int(np.isfinite(v).sum()) for _, v in blocks())
            if finite == n:  # finite values whose float32 sums overflowed: summed again in float64
                s, ss = 0.0, 0.0
                for _, v in blocks():
                    f = v.reshape(-1).astype(np.float64)
                    s, ss = s + float(f.sum()), ss + float(np.dot(f, f))
    return n, finite, float(np.min(mins)), float(np.max(maxs)), s, ss, _signed64(chk)


def _rearranged(t, fn):
    """``fn`` (a numpy reshape or copy) applied to a CPU tensor's data by numpy, not by torch's thread pool
    (see slab_stats); a bfloat16 tensor's bits are rearranged and viewed as bfloat16 again."""
    if is_torch(t) and str(t.dtype) == "torch.bfloat16":
        torch = sys.modules["torch"]
        return torch.from_numpy(fn(t.detach().view(torch.int16).numpy())).view(torch.bfloat16)
    return fn(to_numpy(t))


def _slots(t, T: int, width: int):
    """A cache tensor (n_kv_heads, T, head_dim) as rows of slots (T, n_kv_heads·head_dim), copied by numpy for a
    CPU tensor (bfloat16 stays bfloat16: its checksum is of its own bits)."""
    if is_torch(t) and t.device.type != "cpu":
        return t.swapaxes(0, 1).reshape(T, width)
    return _rearranged(t, lambda a: np.ascontiguousarray(a.swapaxes(0, 1)).reshape(T, width))


def slot_rows(t, T: int, H: int, D: int):
    """A cache tensor (n_kv_heads, T, head_dim) as rows with the statistics and checksum of its slots (T,
    n_kv_heads·head_dim): the slots themselves without a copy where the tensor is a view of a (T, n_kv_heads,
    head_dim) array (how the engine's cache hands them); its own (H·T, D) rows, without a copy where it is
    contiguous, when a head_dim row is whole 8-byte words (a slot's checksum is then the sum of its heads'
    rows'); else the slots, copied."""
    if is_torch(t) and t.device.type == "cpu" and t.swapaxes(0, 1).is_contiguous():
        return _rearranged(t, lambda a: a.swapaxes(0, 1).reshape(T, H * D))
    itemsize = t.element_size() if is_torch(t) else np.dtype(t.dtype).itemsize
    if D * itemsize % 8:
        return _slots(t, T, H * D)
    if is_torch(t) and t.device.type != "cpu":
        return t.reshape(H * T, D)
    return _rearranged(t, lambda a: a.reshape(H * T, D))


def top_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, largest first, ties by lower id, NaN last: the first k of a stable
    sort of -z, found by a partition (a full sort of a 32000-word vocabulary cost 3.5 ms per sample)."""
    neg = -z.astype(np.float64)
    if k >= neg.size:
        return np.argsort(neg, kind="stable")[:k]
    kth = neg[np.argpartition(neg, k - 1)[:k]].max()
    if np.isnan(kth):  # fewer than k numbers: the NaNs' order is the sort's
        return np.argsort(neg, kind="stable")[:k]
    cand = np.flatnonzero(neg <= kth)  # every id that may be among the k, ties at the k-th value included
    return cand[np.argsort(neg[cand], kind="stable")[:k]]


def _torch_stats(xc, n: int, torch) -> tuple:
    flat = (xc if xc.dtype in (torch.float32, torch.float64) else xc.float()).view(-1)
    mn, mx = flat.aminmax()
    v = [float(t) for t in (mn, mx, flat.sum(), torch.dot(flat, flat))]
    finite = n if np.isfinite(v[2]) and np.isfinite(v[3]) else int(flat.isfinite().sum())
    return n, finite, v[0], v[1], v[2], v[3], _torch_checksum(xc, torch)


def _words_per_row(row_bytes: int) -> int:
    return -(-row_bytes // 8)


def _torch_checksum(x, torch) -> int:
    rows = x.reshape(x.shape[0], -1)
    row_bytes = rows.shape[1] * rows.element_size()
    if row_bytes % 8 == 0:
        return int(rows.view(torch.int64).sum())
    raw = rows.view(torch.uint8)
    pad = _words_per_row(row_bytes) * 8 - row_bytes
    return int(torch.nn.functional.pad(raw, (0, pad)).view(torch.int64).sum())


def _numpy_checksum(a: np.ndarray) -> int:
    rows = a.reshape(a.shape[0], -1)
    row_bytes = rows.shape[1] * rows.itemsize
    raw = rows.view(np.uint8)
    if row_bytes % 8:
        raw = np.pad(raw, ((0, 0), (0, _words_per_row(row_bytes) * 8 - row_bytes)))
    return int(np.ascontiguousarray(raw).view(np.int64).sum(dtype=np.int64))


class RunningStats:
    """Running per-sample statistics of one tensor: valid cells and computed padding cells."""

    def __init__(self, n_samples: int):
        # per sample, Python floats (a numpy row's element-wise updates cost several times more, per call)
        self.valid = [[0.0, 0.0, math.inf, -math.inf, 0.0, 0.0] for _ in range(n_samples)]  # count, finite,
        self.pad = [[0.0, 0.0] for _ in range(n_samples)]  # count, finite          min, max, sum, sumsq
        self.checksum = [0] * n_samples

    def add(self, s: int, st: tuple, padding: bool = False) -> None:
        if padding:
            p = self.pad[s]
            p[0] += st[0]
            p[1] += st[1]
            return
        row = self.valid[s]
        row[0] += st[0]
        row[1] += st[1]
        row[2] = min(row[2], float(st[2])) if st[2] == st[2] else math.nan  # a NaN minimum stays NaN
        row[3] = max(row[3], float(st[3])) if st[3] == st[3] else math.nan
        row[4] += st[4]
        row[5] += st[5]
        self.checksum[s] = _signed64(self.checksum[s] + st[6])

    def table(self) -> np.ndarray:
        """Rows of STAT_COLUMNS."""
        return stat_tables([self])[0]


def stat_tables(stats: list) -> np.ndarray:
    """The rows of STAT_COLUMNS of several tensors' RunningStats, (tensors, samples, columns), computed together (a
    table per tensor was a dozen small numpy calls, for 16 tensors a layer)."""
    v = np.array([st.valid for st in stats], dtype=np.float64)
    out = np.empty(v.shape[:2] + (len(STAT_COLUMNS),))
    out[..., :4] = v[..., :4]
    with np.errstate(invalid="ignore"):
        np.divide(v[..., 4], np.maximum(v[..., 0], 1), out=out[..., 4])
        np.sqrt(v[..., 5], out=out[..., 5])
    out[..., 6:] = np.array([st.pad for st in stats], dtype=np.float64)
    out[v[..., 0] == 0, 2:6] = np.nan  # no valid cell: no minimum, maximum, mean or norm
    return out
