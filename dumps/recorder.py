"""Recorder: the public API through which any engine writes a conforming trace.

Example (any engine; tensors may be torch tensors or numpy arrays)::

    from prefill_diff.dumps import Recorder

    meta = {"model": {"args": {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                               "vocab_size": 96, "rope_theta": 10000.0, "norm_eps": 1e-5}},
            "engine": {"name": "my-engine", "dtype": "float32"}}
    with Recorder("trace.h5", level="full") as rec:
        rec.begin(samples=[[5, 6, 7], [8, 9]], n_cols=3, meta=meta)
        for s in range(2):                       # one trace row per sample, columns as laid out
            rec.inputs(s, 0, ids[s], valid[s], positions[s], token_index[s])   # each (columns,)
        for layer in range(n_layers):
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                for s in range(2):
                    rec.state(layer, name, s, 0, x[name][s])          # (columns, dim)
            for s in range(2):
                rec.state(layer, "attn_heads", s, 0, o[s])            # optional: (columns, n_heads·head_dim)
                rec.cache(layer, s, keys[s], values[s], cache_positions[s])  # (n_kv_heads, T, head_dim), (T,)
            rec.layer_done(layer)
        for s in range(2):
            rec.final(s, norm_last[s], logits[s], column=last_col[s], token_index=last_tok[s])  # (dim,), (vocab,)
    # leaving the block closes the file and renames it into place; an exception removes it

``meta`` (a JSON object; docs/trace-format.md has the full table):

    required
      model.args.dim, .n_layers, .n_heads, .n_kv_heads, .head_dim, .vocab_size   positive integers, n_heads a
          multiple of n_kv_heads; they fix every shape below and decide whether two traces are comparable
      engine.dtype   the activation dtype, one of float64, float32, float16, bfloat16: picks the default
          tolerance policy (the coarser side's), so a bfloat16 engine that says float32 fails on noise
    required when layout.key_rotation is "pre"
      model.rope_inv_freq   head_dim/2 inverse frequencies: the reader rotates pre-RoPE keys with them
    optional (compared or shown when present)
      model.args.hidden_dim, .norm_eps, .rope_theta, .rope_scaling (table), .hidden_act, .qkv_bias,
          .o_bias, .mlp_bias, .qk_norm, .norm_placement, .norm_scale, .sliding_window, .layer_types,
          .attention_multiplier, .embedding_multiplier, .residual_multiplier, .logits_scaling, .lm_head_bias,
          .tie_embeddings, .arch
          the model's identity: a difference is an identity break
      model.source, model.spec, model.weights_digest ("sha256:..."), model.adapter ({id, digest, rank})
      engine.name, .kernel, .batching, .chunk_size
      layout.kind, .dtype (the KV-cache dtype, picks the cache tolerance), .key_rotation ("post": keys as
          attention used them, the default; "pre": before RoPE), .page_size
      side.origin (shown as the side's name), tolerance (a declared policy), record (reuse decisions,
          invariant violations, fault, quantized_weights_digest), repro, texts, token_text
      provenance (version, argv, time): written by ``begin`` unless given
      every one of model, side, engine, layout, tolerance, record, repro, run, token_text, provenance is a JSON
          object

States (``state(layer, name, ...)``), per layer: layer_input R_l, attn_update (the attention output after
the output projection), mid U_l = R_l + attn_update, mlp_update, layer_output R_l+1 (all (columns, dim),
required), and attn_heads: concat(O) before the output projection, (columns, n_heads·head_dim), optional,
which lets a break name the query heads. ``cache`` (required for every layer and sample): keys after RoPE
(unless layout.key_rotation is "pre") and values, in logical order, (n_kv_heads, T, head_dim), with the
position of each slot (T,). ``final`` (required for every sample): the final-norm output at the gathered
position (dim,) and its raw logits (vocab_size,).

``begin`` refuses a meta without a required key, and ``inputs``/``state``/``cache``/``final`` a tensor of the
wrong shape, naming what is expected (RecorderError). ``close`` refuses a trace with a sample whose
``final`` was never called, or a layer without a required state or cache, and removes the file.

The file is written under a temporary name beside the target and renamed only when
complete and closed, so an interrupted run never leaves a file a reader accepts.
This module does not import torch: tensors are used through their own methods.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from ..engine.shared.errors import INTERRUPT, PrefillDiffError
from ..engine.shared.untrusted import check_name_length, partial_sibling
from . import native
from .provenance import provenance
from . import metacheck
from . import schema as sc
from .schema import (ACT_DTYPES, FORMAT_NAME, FORMAT_VERSION, LEVELS, REQUIRED_STATES, STAT_COLUMNS, STATES,
    layer_group)

_MASK64 = (1 << 64) - 1
# HDF5 1.8 object formats and newer carry checksums on every metadata block, so damaged metadata is
# detected instead of being followed (the 1.6-compatible default can send the library into a loop on a
# corrupted file); "v110" as the newest keeps files readable by HDF5 1.10 tools such as Debian's h5dump.
LIBVER = ("v108", "v110")
_PARTIAL: set = set()  # temporary files of this process not yet renamed into place
_COMPLETED: list = []  # traces this process moved into place (what an interrupt must not call "not kept")


def _check_interrupt() -> None:
    """Python may deliver a Ctrl-C's KeyboardInterrupt inside a garbage-collector callback, where it is
    printed and dropped; the CLI's handler also sets a flag, checked at every layer and before a trace is
    moved into place, so an interrupted recording is never completed."""
    if INTERRUPT["seen"]:
        raise KeyboardInterrupt


def _text(obj, key: str, value: str) -> None:
    """A string attribute stored fixed-length, inline in its (checksummed) object header.

    Variable-length strings live in HDF5's global heap, which has no checksum: a damaged heap can send
    the library into an endless loop when the attribute is read (found by fuzzing the reader).
    """
    obj.attrs[key] = np.bytes_(value.encode("utf-8"))


class _Kind(NamedTuple):
    """What a new dataset or attribute of one kind is made from (low-level h5py objects, reusable)."""
    file_type: object  # h5py.h5t.TypeID as stored
    memory_type: object  # h5py.h5t.TypeID of the numpy data (attributes)
    space: object  # h5py.h5s.SpaceID
    dcpl: object  # h5py.h5p.PropDCID (datasets; None for attributes)


@functools.lru_cache(maxsize=64)
def _creation(dtype: str, shape: tuple, maxshape: tuple | None, chunks: tuple | None, fill: str | None) -> _Kind:
    """(datatype, dataspace, creation property list) of a new dataset, made once per kind: what h5py's
    create_dataset sets (chunks, fill value; no time stamps, attribute order not tracked)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if chunks is not None:
        dcpl.set_chunk(chunks)
    if fill is not None:
        dcpl.set_fill_value(np.array(float(fill) if fill == "nan" else int(fill)))
    dcpl.set_obj_track_times(False)
    dcpl.set_attr_creation_order(0)
    unlimited = None if maxshape is None else tuple(h5py.h5s.UNLIMITED if m is None else m for m in maxshape)
    return _Kind(file_type=h5py.h5t.py_create(np.dtype(dtype), logical=1), memory_type=None,
                 space=h5py.h5s.create_simple(shape, unlimited), dcpl=dcpl)


def _new_dataset(group, rel: str, data: np.ndarray, shape: tuple, fill=None, chunks=None,
                 maxshape=None) -> h5py.h5d.DatasetID:
    """A new dataset ``rel`` (its parent group exists) of ``shape`` holding ``data``: what
    ``group.create_dataset(rel, shape, data=data, fillvalue=fill, chunks=chunks, maxshape=maxshape)`` makes,
    through h5py's low-level API in a quarter of the time (a layer has 18 small datasets, 26 at the
    sampled level). ``group``: an h5py group or its low-level id (a bare name in the group it is made in
    skips a path lookup per dataset). ``fill``: an integer or NaN."""
    if data.shape != tuple(shape):
        raise RecorderError(f"internal: {rel} holds shape {data.shape}, the format says {tuple(shape)}")
    key = None if fill is None else ("nan" if np.isnan(fill) else str(int(fill)))
    kind = _creation(data.dtype.str, data.shape, maxshape, chunks, key)
    gid = group.id if isinstance(group, h5py.Group) else group
    dsid = h5py.h5d.create(gid, rel.encode("ascii"), kind.file_type, kind.space, dcpl=kind.dcpl)
    dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
    return dsid


def _leaf(el) -> str:
    """The last part of an element's path: its name inside its own group."""
    return el.path.rpartition("/")[2]


@functools.lru_cache(maxsize=1)
def _group_plists() -> tuple:
    """(link, group) creation property lists of a new group, made once: what h5py's create_group passes for an
    ASCII name (no time stamps, link order not tracked)."""
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_ASCII)
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return lcpl, gcpl


def _new_group(parent, name: str) -> h5py.h5g.GroupID:
    """A new group ``name`` under ``parent`` (a low-level id): what ``create_group`` makes, without its checks."""
    lcpl, gcpl = _group_plists()
    return h5py.h5g.create(parent, name.encode("ascii"), lcpl=lcpl, gcpl=gcpl)


@functools.lru_cache(maxsize=64)
def _attr_kind(dtype: str, shape: tuple) -> _Kind:
    """The types and dataspace of a new attribute, made once per kind, as h5py's attrs.create makes them."""
    dt = np.dtype(dtype)
    return _Kind(file_type=h5py.h5t.py_create(dt, logical=True), memory_type=h5py.h5t.py_create(dt),
                 space=h5py.h5s.create_simple(shape), dcpl=None)


def _new_attr(oid, name: str, value) -> None:
    """Attribute ``name`` = ``value`` on a new object (low-level id) that has no such attribute yet: what
    ``obj.attrs[name] = value`` writes, without its checks for an attribute to replace. A str is stored as
    _text stores it (fixed-length UTF-8)."""
    data = np.asarray(np.bytes_(value.encode("utf-8")) if isinstance(value, str) else value)
    kind = _attr_kind(data.dtype.str, data.shape)
    attr = h5py.h5a.create(oid, name.encode("ascii"), kind.file_type, kind.space)
    attr.write(data, mtype=kind.memory_type)
    attr.close()


def remove_partial_files() -> list:
    """Delete this process's unfinished temporary traces (after an interrupt); returns their paths."""
    gone = []
    for tmp in list(_PARTIAL):
        try:
            os.unlink(tmp)
            gone.append(str(tmp))
        except FileNotFoundError:
            pass
        _PARTIAL.discard(tmp)
    return gone


def n_completed() -> int:
    """How many traces this process has finished so far (a start index for ``completed_traces``)."""
    return len(_COMPLETED)


def completed_traces(start: int = 0) -> list:
    """Traces this process finished and moved into place (from the ``start``-th on) that are still there."""
    return [p for p in _COMPLETED[start:] if os.path.exists(p)]


class TraceExistsError(PrefillDiffError):
    """The target trace exists and --force was not given."""


def _renameat2_noreplace(src: str, dst: str) -> bool:
    """rename(src, dst) failing if dst exists (Linux renameat2 RENAME_NOREPLACE); False if unavailable here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_NOREPLACE = -100, 1
    if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), dst)
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def place(tmp, path, force: bool) -> None:
    """Move a finished trace into place atomically. Without ``force`` it never replaces a file, not even one
    that appeared while this trace was recorded (two `record`s to one path at once): a hard link to the target
    fails if the target exists (then the temporary name is removed); where hard links are not supported,
    renameat2(RENAME_NOREPLACE); where neither is, a check just before the rename (the one window left)."""
    tmp, path = str(tmp), str(path)
    if force:
        os.replace(tmp, path)
        return
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system
            if not _renameat2_noreplace(tmp, path):
                if os.path.exists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
            return
        os.unlink(tmp)
    except FileExistsError:
        raise TraceExistsError(f"{path} appeared while this trace was being recorded (another process writing "
                               "the same path?); it was not replaced and this trace was not kept; pass --force to "
                               "overwrite") from None


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


class RecorderError(PrefillDiffError):
    """The recorder was called out of order or with inconsistent data."""


REQUIRED_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
ENGINE_DTYPES = ACT_DTYPES
OBJECT_KEYS = ("model", "side", "engine", "layout", "tolerance", "record", "repro", "run", "token_text",
               "provenance")


def check_meta_as_read(meta: dict, n_samples: int | None = None, lengths=None) -> None:
    """Refuse metadata the trace's own reader would refuse (dumps/metacheck.py, on the JSON it is stored as):
    the write side and the read side check one schema, so a recorded trace always opens."""
    try:
        stored = json.loads(json.dumps(meta, sort_keys=True, default=str))
        metacheck.check_meta(stored)
        if n_samples is not None:
            metacheck.check_meta_against_file(stored, n_samples, lengths)
    except metacheck.MetaError as e:
        raise RecorderError(f"the trace's metadata breaks its schema, so its reader would refuse it: {e}") from None


def check_meta(meta) -> dict:
    """The trace metadata an engine passes to ``begin``; returns model.args. Raises RecorderError naming the
    first missing or invalid required key."""
    if not isinstance(meta, dict):
        raise RecorderError(f"meta must be a dict (a JSON object), got {type(meta).__name__}")
    for key in OBJECT_KEYS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise RecorderError(f"meta.{key} must be a dict (a JSON object), got {type(meta[key]).__name__}")
    args = (meta.get("model") or {}).get("args")
    if not isinstance(args, dict):
        raise RecorderError("meta.model.args is required: a dict with " + ", ".join(REQUIRED_ARGS) +
                            " (the model's sizes; see the Recorder docstring)")
    for key in REQUIRED_ARGS:
        v = args.get(key)
        if v is None:
            raise RecorderError(f"meta.model.args.{key} is required (a positive integer; required: "
                                f"{', '.join(REQUIRED_ARGS)})")
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise RecorderError(f"meta.model.args.{key} must be a positive integer (got {v!r})")
    if args["n_heads"] % args["n_kv_heads"]:
        raise RecorderError(f"meta.model.args.n_heads must be a multiple of n_kv_heads (got n_heads="
                            f"{args['n_heads']}, n_kv_heads={args['n_kv_heads']})")
    dtype = (meta.get("engine") or {}).get("dtype")
    if dtype is None:
        raise RecorderError("meta.engine.dtype is required: the engine's activation dtype, one of "
                            f"{', '.join(ENGINE_DTYPES)} (it picks the tolerance policy)")
    if dtype not in ENGINE_DTYPES:
        raise RecorderError(f"meta.engine.dtype must be one of {', '.join(ENGINE_DTYPES)} (got {dtype!r})")
    if (meta.get("layout") or {}).get("key_rotation", "post") not in ("post", "pre"):
        raise RecorderError(f"meta.layout.key_rotation must be 'post' or 'pre' "
                            f"(got {meta['layout']['key_rotation']!r})")
    if (meta.get("layout") or {}).get("key_rotation") == "pre":
        inv = (meta.get("model") or {}).get("rope_inv_freq")
        if not isinstance(inv, (list, tuple)) or len(inv) != args["head_dim"] // 2:
            raise RecorderError(f"meta.model.rope_inv_freq is required with layout.key_rotation 'pre': "
                                f"{args['head_dim'] // 2} numbers (head_dim/2), got {str(inv)[:40]}")
    return args


def _shape(x) -> tuple:
    return tuple(map(int, x.shape))


def _want(what: str, x, expected: tuple) -> None:
    """x must have shape ``expected`` (None: any length)."""
    got = _shape(x)
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        shown = "(" + ", ".join("T" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") \
            + ")"
        raise RecorderError(f"{what} has shape {got}, expected {shown}")


def _is_torch(x) -> bool:
    return hasattr(x, "detach") and hasattr(x, "dtype") and str(x.dtype).startswith("torch.")


def source_dtype(x) -> str:
    return str(x.dtype).replace("torch.", "") if _is_torch(x) else np.dtype(x.dtype).name


def to_numpy(x) -> np.ndarray:
    """Host copy of a tensor; bfloat16 becomes float32 (exact), other float dtypes are kept."""
    if _is_torch(x):
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
    kernels (dumps/native.py), a float32, float64 or bfloat16 slab is reduced in one pass instead.

    A CPU tensor is reduced with numpy on a zero-copy view: torch's reductions fan out to its thread
    pool, and on an oversubscribed machine each of the ~40 small reductions per layer waits for a
    descheduled thread (27-78 ms against 3 ms per state of 4 x 256 x 1024 at load 6). A tensor
    on an accelerator is reduced there.
    """
    n = math.prod(x.shape)
    if n == 0:
        return 0, 0, np.inf, -np.inf, 0.0, 0.0, 0
    if _is_torch(x):
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
    of the compiled kernel (dumps/native.py) for float32, float64 and bfloat16, else _numpy_stats; the numpy
    code also takes over when a sum is not finite (it counts the finite values, and sums float32 values
    whose sums overflowed again in float64)."""
    k = native.kernels()
    rows = a.reshape(a.shape[0], -1)
    if k is not None and (bfloat16 or a.dtype in native.FLOAT_TYPES) and rows.strides[1] == rows.itemsize \
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
    if _is_torch(t) and str(t.dtype) == "torch.bfloat16":
        torch = sys.modules["torch"]
        return torch.from_numpy(fn(t.detach().view(torch.int16).numpy())).view(torch.bfloat16)
    return fn(to_numpy(t))


def _slots(t, T: int, width: int):
    """A cache tensor (n_kv_heads, T, head_dim) as rows of slots (T, n_kv_heads·head_dim), copied by numpy for a
    CPU tensor (bfloat16 stays bfloat16: its checksum is of its own bits)."""
    if _is_torch(t) and t.device.type != "cpu":
        return t.swapaxes(0, 1).reshape(T, width)
    return _rearranged(t, lambda a: np.ascontiguousarray(a.swapaxes(0, 1)).reshape(T, width))


def _slot_rows(t, T: int, H: int, D: int):
    """A cache tensor (n_kv_heads, T, head_dim) as rows with the statistics and checksum of its slots (T,
    n_kv_heads·head_dim): the slots themselves without a copy where the tensor is a view of a (T, n_kv_heads,
    head_dim) array (how the engine's cache hands them); its own (H·T, D) rows, without a copy where it is
    contiguous, when a head_dim row is whole 8-byte words (a slot's checksum is then the sum of its heads'
    rows'); else the slots, copied."""
    if _is_torch(t) and t.device.type == "cpu" and t.swapaxes(0, 1).is_contiguous():
        return _rearranged(t, lambda a: a.swapaxes(0, 1).reshape(T, H * D))
    itemsize = t.element_size() if _is_torch(t) else np.dtype(t.dtype).itemsize
    if D * itemsize % 8:
        return _slots(t, T, H * D)
    if _is_torch(t) and t.device.type != "cpu":
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


class _Stats:
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
        return _stat_tables([self])[0]


def _stat_tables(stats: list) -> np.ndarray:
    """The rows of STAT_COLUMNS of several tensors' _Stats, (tensors, samples, columns), computed together (a
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


def _gather(x, rows: np.ndarray, channels: np.ndarray, heads: int | None = None) -> np.ndarray:
    """x[rows][:, channels] as numpy (bfloat16 widened, exact): of a (T, width) tensor, or with ``heads`` of
    a cache tensor's slots (heads, T, head_dim) -> (T, heads·head_dim). Only the gathered values are copied
    (a CPU tensor by numpy, see slab_stats; one on an accelerator is brought over whole)."""
    bf16 = _is_torch(x) and x.device.type == "cpu" and str(x.dtype) == "torch.bfloat16"
    a = x.detach().view(sys.modules["torch"].int16).numpy() if bf16 else to_numpy(x)
    if heads is None:
        got = a[rows[:, None], channels]
    else:
        D = a.shape[2]
        got = a[channels // D, rows[:, None], channels % D]  # slot row r, channel c = head·D + d
    return widen_bfloat16(got) if bf16 else got


@dataclass
class _Sampled:
    """One tensor's sampled values at one layer, kept in memory until the layer is written."""
    values: np.ndarray  # (S, P, K), NaN where no token was recorded
    channels: np.ndarray  # (K,) the sampled channels of a ``width``-wide tensor
    width: int
    source_dtype: str


@dataclass
class _LayerBuffers:
    """What a layer accumulates in memory and ``flush`` writes, one dataset write each: creating a few
    hundred small datasets and writing them piecemeal (per sample, by fancy index) was most of what the
    stats and sampled levels cost. Kept after the layer is written: a later prefill call that
    reaches the same layer adds to them and the layer is rewritten whole."""
    positions: np.ndarray | None = None  # (S, T) cache positions, -1 past a sample's length
    lengths: np.ndarray | None = None  # (S,) cache lengths
    heads: tuple = ()  # (n_kv_heads, head_dim) of the cache, for the cache group's attributes
    tensors: dict = field(default_factory=dict)  # "keys"/"values" -> dataset (full level, written in place)
    sampled: dict = field(default_factory=dict)  # tensor name -> _Sampled (sampled level)
    routing: dict = field(default_factory=dict)  # ids, weights, margin (and logits at the full level) -> (S, C, ...)
    routing_source: str | None = None  # the router logits' dtype in the engine


class Recorder:
    """Writes one trace. ``begin``, then ``inputs``/``state``/``cache``/``layer_done``, ``final``, ``close``."""

    def __init__(self, path, level: str = "full", *, force: bool = False, compression: str | None = None,
                 topk: int = 10, sample_tokens: int = 8, sample_channels: int = 32, sample_seed: int = 0,
                 in_memory: bool = False):
        if level not in LEVELS:
            raise RecorderError(f"level must be one of {', '.join(LEVELS)} (got {level!r})")
        if compression not in (None, "none", "gzip"):
            raise RecorderError(f"compression must be 'none' or 'gzip' (got {compression!r}; lzf is not "
                                "readable by h5dump)")
        self.level, self.topk = level, topk
        self.compression = None if compression in (None, "none") else compression
        self.sample_tokens, self.sample_channels, self.sample_seed = sample_tokens, sample_channels, sample_seed
        self.path = Path(path) if path is not None else None
        self.in_memory, self.force = in_memory, force
        if in_memory or path is None:
            self.in_memory, self.tmp = True, None
            self.f = h5py.File(f"mem-{secrets.token_hex(6)}.h5", "w", driver="core", backing_store=False,
                               libver=LIBVER)
        else:
            try:
                check_name_length(self.path, "the trace")
                if self.path.exists() and not force:
                    raise TraceExistsError(f"{self.path} exists; pass --force to overwrite it")
                if self.path.is_dir():
                    raise RecorderError(f"{self.path} is a directory")
            except OSError as e:
                raise RecorderError(f"cannot write {self.path}: {e.strerror}") from None
            self.tmp = Path(partial_sibling(self.path))
            _PARTIAL.add(self.tmp)  # registered before it exists, so an interrupt at any moment can remove it
            try:
                self.f = h5py.File(self.tmp, "w", libver=LIBVER)
            except OSError as e:
                _PARTIAL.discard(self.tmp)
                raise RecorderError(f"cannot write {self.path}: {e}") from None
        _text(self.f, "format", FORMAT_NAME)
        _text(self.f, "format_version", FORMAT_VERSION)
        _text(self.f, "level", level)
        self.f.attrs["complete"] = 0
        self._stats: dict[int, dict[str, _Stats]] = {}  # layer -> tensor name -> its statistics so far
        self._closed = False
        self.n_samples = None
        self._ds = {}
        self._seen: set = set()  # (layer, state name) and (layer, "cache") recorded
        self._groups: dict[int, h5py.Group] = {}  # layer -> its group, created on first use
        self._reuse: dict = {}  # layer_output slabs of layer _reuse_layer: identity -> (root tensor, statistics)
        self._reuse_layer: int | None = None
        self._small: dict[tuple, object] = {}  # (layer, element path, name) -> h5py DatasetID written so far
        self._layers: dict[int, _LayerBuffers] = {}
        self._dirty: set = set()  # layers with something not yet written
        self._final: dict | None = None  # FINAL element name -> its array, made on the first final()
        self._final_sources: dict = {}  # norm_last, logits -> the source dtype
        self._cells: dict = {}  # sampled level: (sample, col, T) -> the rows and slots of its sampled tokens

    # -- context manager: close on success, remove on error ---------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def _write(self, ds, sel, x) -> None:
        """ds[sel] = x. (A writer thread overlapping compute was measured and did not pay on a 2-core CPU:
        torch already keeps both cores busy; see docs/performance.md.)"""
        self._put(ds, sel, x)

    def _put(self, ds, sel, x) -> None:
        """Write; a selection that is exactly one uncompressed chunk goes straight to the file (twice as fast)."""
        arr = to_numpy(x)
        chunk = ds.chunks
        if (not self.compression and chunk is not None and arr.shape == chunk[1:] and arr.dtype == ds.dtype
                and all((s.start or 0) == 0 for s in sel[1:]) and chunk[0] == 1):
            ds.id.write_direct_chunk((sel[0],) + (0,) * (len(chunk) - 1), np.ascontiguousarray(arr))
        else:
            ds[sel] = arr

    def _kw(self, chunks):
        kw = {"chunks": chunks}
        if self.compression:
            kw.update(compression="gzip", compression_opts=1, shuffle=True)
        return kw

    def begin(self, samples, n_cols: int, meta: dict) -> None:
        """Declare the samples (full logical token ids) and the width of the stored rectangle."""
        S = len(samples)
        if S == 0 or n_cols < 1:
            raise RecorderError(f"a trace needs at least one sample and one column (got {S}, {n_cols})")
        self.args = {k: int(v) for k, v in check_meta(meta).items() if k in REQUIRED_ARGS}
        if any(len(s) == 0 for s in samples):
            raise RecorderError("every sample needs at least one token (got an empty sample)")
        self.n_samples, self.n_cols = S, n_cols
        self.lengths = np.array([len(s) for s in samples], dtype=np.int64)
        nmax = int(self.lengths.max())
        ids = np.full((S, nmax), -1, dtype=np.int64)
        for i, s in enumerate(samples):
            ids[i, :len(s)] = s
        self.dims = {"S": S, "C": n_cols, "N": nmax, "dim": self.args["dim"], "vocab": self.args["vocab_size"],
                     "H": self.args["n_kv_heads"], "D": self.args["head_dim"], "stat": len(STAT_COLUMNS)}
        margs = meta["model"]["args"]
        if margs.get("n_experts"):  # a mixture of experts: its routing's sizes (metacheck'd below)
            self.dims.update(A=int(margs.get("n_active_experts") or 0), E=int(margs["n_experts"]))
        sc.TOKEN_IDS.create(self.f, self.dims, data=ids)
        sc.LENGTHS.create(self.f, self.dims, data=self.lengths)
        self._inputs = {name: np.full(el.shape_for(self.dims), el.fill, dtype=el.dtype)  # written by flush
                        for name, el in sc.INPUTS.items()}
        self._roots_dirty = True  # inputs or final outputs changed since the last flush
        self.valid = np.zeros((S, n_cols), dtype=bool)
        self.tok = np.full((S, n_cols), -1, dtype=np.int64)
        self.meta = {**meta, "provenance": meta.get("provenance") or provenance()}
        check_meta_as_read(self.meta)
        self._write_meta()
        self._sampled_toks = [select_tokens(int(n), self.sample_tokens) for n in self.lengths]
        self._slot_of_tok = []  # per sample: token index -> sampled slot, -1 if not sampled
        for n, toks in zip(self.lengths, self._sampled_toks):
            m = np.full(int(n), -1, dtype=np.int64)
            m[toks] = np.arange(len(toks))
            self._slot_of_tok.append(m)
        self._ds = {}
        if self.tmp is not None:
            self._check_space()
        if self.level == "sampled":
            P = max(len(t) for t in self._sampled_toks)
            st = np.full((S, P), -1, dtype=np.int64)
            for i, t in enumerate(self._sampled_toks):
                st[i, :len(t)] = t
            self.dims["P"] = P
            sc.SAMPLED_TOKENS.create(self.f, self.dims, data=st)
            self.f[sc.SAMPLED_GROUP].attrs[sc.ATTR_SEED] = self.sample_seed

    def size_estimate(self) -> int:
        """Bytes this trace will take, from its sizes alone (an upper bound: every state at every cell, the
        cache at every slot, in float64 where the run is float64): what the file system must have free."""
        d, S, C, N = self.dims["dim"], self.dims["S"], self.dims["C"], self.dims["N"]
        item = 8 if (self.meta.get("engine") or {}).get("dtype") == "float64" else 4
        width = max(d, self.args["n_heads"] * self.args["head_dim"])
        if self.level == "full":
            per_layer = len(STATES) * S * C * width + 2 * S * self.dims["H"] * N * self.dims["D"] + \
                S * C * self.dims.get("E", 0)
        else:  # statistics and checksums; sampled rows of a few tokens and channels
            per_layer = (len(STATES) + 2) * S * (self.sample_tokens * self.sample_channels + 64)
        return int(1.1 * item * (self.args["n_layers"] * per_layer + 2 * S * self.dims["vocab"] + 8 * S * C)) + (1 << 20)

    def _check_space(self) -> None:
        """Refuse to start a trace its file system has no room for: HDF5 cannot recover from a full disk (it
        crashes the process after the failed write), so the space is checked before the first array."""
        where = os.path.dirname(os.path.abspath(self.tmp))
        try:
            st = os.statvfs(where)
        except OSError:
            return  # a file system that does not say: the write itself will tell
        free, need = st.f_bavail * st.f_frsize, self.size_estimate()
        if need > free:
            raise RecorderError(f"not enough space for the trace {self.path}: it needs about {_mib(need)}, and its "
                                f"file system ({where}) has {_mib(free)} free")

    def _group(self, layer: int) -> h5py.Group:
        g = self._groups.get(layer)
        if g is None:  # made once per layer by this recorder (the first makes the layers group too)
            g = self._groups[layer] = h5py.Group(_new_group(self.f.id, layer_group(layer)))
        return g

    def _buffers(self, layer: int) -> _LayerBuffers:
        self._dirty.add(layer)
        if layer not in self._layers:
            self._layers[layer] = _LayerBuffers()
        return self._layers[layer]

    def _write_meta(self):
        _text(self.f, "meta", json.dumps(self.meta, sort_keys=True, default=str))

    def _need_begin(self):
        if self.n_samples is None:
            raise RecorderError("begin() must be called before writing tensors")

    def inputs(self, sample: int, col: int, ids, valid, positions, token_index) -> None:
        """The physical cells one prefill call laid out for a sample, from column ``col``: four (T,) arrays."""
        self._need_begin()
        self._where(sample, col, valid, "inputs")
        T = _shape(valid)[0]
        for what, x in (("ids", ids), ("positions", positions), ("token_index", token_index)):
            _want(f"inputs(sample {sample}) {what}", x, (T,))
        v = to_numpy(valid).astype(bool)
        sl = np.s_[sample, col:col + T]
        inp = self._inputs
        inp["input_ids"][sl] = to_numpy(ids)
        inp["valid_mask"][sl] = v
        inp["computed"][sl] = 1
        inp["positions"][sl] = to_numpy(positions)
        inp["token_index"][sl] = to_numpy(token_index)
        self.valid[sl], self.tok[sl] = v, to_numpy(token_index)
        self._cells = {}
        self._roots_dirty = True

    def _where(self, sample, col, x, what) -> None:
        """sample in range, x has rows, and its T rows fit from column col."""
        if not 0 <= int(sample) < self.n_samples:
            raise RecorderError(f"{what}: sample {sample} out of range (begin declared {self.n_samples} samples)")
        if len(_shape(x)) < 1:
            raise RecorderError(f"{what}: expected an array with one row per column, got a scalar")
        T = _shape(x)[0]
        if col < 0 or col + T > self.n_cols:
            raise RecorderError(f"{what}: columns {col}..{col + T - 1} of sample {sample} are outside the "
                                f"{self.n_cols} columns begin declared")

    def _layer(self, layer: int, what: str) -> None:
        if not 0 <= int(layer) < self.args["n_layers"]:
            raise RecorderError(f"{what}: layer {layer} out of range (meta.model.args.n_layers = "
                                f"{self.args['n_layers']})")

    def _stat(self, layer: int, name: str) -> _Stats:
        """The running statistics of a layer's tensor, kept for the whole run: a layer written and then reached
        again is rewritten with every sample's statistics, not only the later ones."""
        self._dirty.add(layer)
        per_layer = self._stats.setdefault(layer, {})
        if name not in per_layer:
            per_layer[name] = _Stats(self.n_samples)
        return per_layer[name]

    def state(self, layer: int, name: str, sample: int, col: int, x) -> None:
        """One sample's cells [col, col + T) of a residual-stream state: (T, dim), attn_heads (T, n_heads·head_dim)."""
        self._need_begin()
        if name not in STATES:
            raise RecorderError(f"state name must be one of {', '.join(STATES)} (got {name!r})")
        width = self.args["n_heads"] * self.args["head_dim"] if name == "attn_heads" else self.args["dim"]
        shape = _shape(x)
        if not (0 <= layer < self.args["n_layers"] and 0 <= sample < self.n_samples and len(shape) == 2
                and shape[1] == width and 0 <= col and col + shape[0] <= self.n_cols):  # the checks, with messages
            self._layer(layer, f"state {name}")
            self._where(sample, col, x, f"layer {layer} {name}")
            _want(f"layer {layer} {name} of sample {sample}", x, (None, width))
        self._seen.add((layer, name))
        T = shape[0]
        v = self.valid[sample, col:col + T]
        st = self._stat(layer, name)
        idx = None if T and v.all() else np.flatnonzero(v)  # every cell valid: no search for the first and last
        if idx is None or idx.size:
            a, b = (0, T) if idx is None else (int(idx[0]), int(idx[-1]) + 1)
            st.add(sample, self._slab(layer, name, x if a == 0 and b == T else x[a:b]))
            if a > 0:
                st.add(sample, self._slab(layer, name, x[:a]), padding=True)
            if b < T:
                st.add(sample, self._slab(layer, name, x[b:]), padding=True)
        else:
            st.add(sample, self._slab(layer, name, x), padding=True)
        if self.level == "full":
            ds = self._state_ds(layer, name, x)
            self._write(ds, np.s_[sample, col:col + T], x)
        elif self.level == "sampled":
            cells = self._sampled_cells((sample, col, T), sample, self.tok[sample, col:col + T], v)
            self._write_sampled(layer, name, sample, cells, x)

    def _slab(self, layer: int, name: str, x) -> tuple:
        """slab_stats(x), except that layer l's layer_output statistics serve layer l+1's layer_input when the
        engine hands both the very same torch tensor (one state in six): the same root tensor object,
        offset, shape and strides, and its version counter unchanged (an in-place change in between bumps it;
        only writes that bypass it, through ``.data`` or a numpy alias, would go unseen)."""
        if name not in ("layer_output", "layer_input") or not _is_torch(x):
            return slab_stats(x)
        root = x if x._base is None else x._base
        key = (id(root), x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version)
        if name == "layer_input":
            hit = self._reuse.get(key) if self._reuse_layer == layer - 1 else None
            return hit[1] if hit is not None and hit[0] is root else slab_stats(x)
        if self._reuse_layer != layer:
            self._reuse, self._reuse_layer = {}, layer
        st = slab_stats(x)
        self._reuse[key] = (root, st)  # the reference keeps the root alive: its id and memory are not reused
        return st

    def _sampled_cells(self, key: tuple, sample: int, toks, valid) -> tuple:
        """(rows, slots): which of T rows (token indices ``toks``, ``valid``) are sampled tokens of ``sample``, and
        their slots; the same for every tensor of a prefill call, so kept under ``key`` until ``inputs``
        changes the cells."""
        got = self._cells.get(key)
        if got is None:
            m = self._slot_of_tok[sample]
            rows = np.flatnonzero(valid & (toks >= 0) & (toks < m.shape[0]))
            slots = m[toks[rows]]
            keep = slots >= 0
            got = self._cells[key] = (rows[keep], slots[keep])
        return got

    def _write_sampled(self, layer, name, sample, cells: tuple, x, heads: int | None = None):
        """The declared (token, channel) subset of one sample's rows (``cells``: _sampled_cells): x (T, width), or
        with ``heads`` a cache tensor (heads, T, head_dim) whose rows are its slots (T, heads·head_dim)."""
        rows, slots = cells
        if rows.size == 0:
            return
        buf = self._sampled_buffer(layer, name, x, x.shape[1] if heads is None else heads * x.shape[2])
        buf.values[sample, slots] = _gather(x, rows, buf.channels, heads)

    def _state_ds(self, layer, name, x):
        key = (layer, name)
        if key not in self._ds:
            dims = {**self.dims, "W": x.shape[1]}
            ds = sc.STATE.create(self._group(layer), dims, name, to_numpy(x[:0]).dtype,
                                 **self._kw((1, self.n_cols, x.shape[1])))
            _text(ds, sc.ATTR_SOURCE_DTYPE, source_dtype(x))
            self._ds[key] = ds
        return self._ds[key]

    def _sampled_buffer(self, layer, name, x, width: int) -> _Sampled:
        sampled = self._buffers(layer).sampled
        if name not in sampled:
            width = int(width)
            ch = select_channels(width, self.sample_channels, self.sample_seed)
            shape = sc.SAMPLED.shape_for({**self.dims, "K": len(ch)})
            sampled[name] = _Sampled(np.full(shape, np.nan, dtype=to_numpy(x[:0]).dtype), ch, width, source_dtype(x))
        return sampled[name]

    def routing(self, layer: int, sample: int, col: int, ids, weights, margin, scale, logits=None) -> None:
        """One sample's routing at cells [col, col + T) of a layer whose MLP has experts: the chosen experts
        (T, k) by descending router probability, their weights (T, k) as they scale the experts' outputs, the
        router's margin (T,) (its k-th minus its (k+1)-th logit), the RMS of its logits (T,) and its logits
        (T, E), kept at the full level."""
        self._need_begin()
        self._layer(layer, "routing")
        A, E = self.dims.get("A"), self.dims.get("E")
        if A is None:
            raise RecorderError("routing() needs meta.model.args.n_experts and n_active_experts (a mixture of "
                                "experts); this model declares none")
        T = _shape(ids)[0] if len(_shape(ids)) == 2 else -1
        self._where(sample, col, ids, f"layer {layer} routing")
        _want(f"layer {layer} routing ids of sample {sample}", ids, (T, A))
        _want(f"layer {layer} routing weights of sample {sample}", weights, (T, A))
        _want(f"layer {layer} routing margin of sample {sample}", margin, (T,))
        _want(f"layer {layer} routing scale of sample {sample}", scale, (T,))
        if logits is not None:
            _want(f"layer {layer} router logits of sample {sample}", logits, (T, E))
        idx = to_numpy(ids).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= E):
            raise RecorderError(f"layer {layer} routing ids of sample {sample} must be experts in [0, {E}) (got "
                                f"{int(idx.min())}..{int(idx.max())})")
        buf = self._buffers(layer)
        self._seen.add((layer, "routing"))
        if not buf.routing:
            for name in ("ids", "weights", "margin", "scale") + (("logits",) if self.level == "full" else ()):
                el = sc.ROUTING[name]
                buf.routing[name] = np.full(el.shape_for(self.dims), el.fill, dtype=el.dtype or np.float64)
        r = buf.routing
        r["ids"][sample, col:col + T] = idx
        r["weights"][sample, col:col + T] = to_numpy(weights).astype(np.float64)
        r["margin"][sample, col:col + T] = to_numpy(margin).astype(np.float64)
        r["scale"][sample, col:col + T] = to_numpy(scale).astype(np.float64)
        if "logits" in r and logits is not None:
            z = to_numpy(logits)
            if r["logits"].dtype != z.dtype and buf.routing_source is None:
                r["logits"] = r["logits"].astype(z.dtype)
            r["logits"][sample, col:col + T] = z
            buf.routing_source = source_dtype(logits)

    def cache(self, layer: int, sample: int, keys, values, positions) -> None:
        """One sample's logical cache at a layer: keys and values (n_kv_heads, T, head_dim), positions (T,)."""
        self._need_begin()
        self._layer(layer, "cache")
        if not 0 <= int(sample) < self.n_samples:
            raise RecorderError(f"cache: sample {sample} out of range (begin declared {self.n_samples} samples)")
        if len(_shape(positions)) != 1:
            raise RecorderError(f"layer {layer} cache positions of sample {sample} have shape {_shape(positions)}, "
                                "expected (T,)")
        T = _shape(positions)[0]
        for what, t in (("keys", keys), ("values", values)):
            _want(f"layer {layer} cache {what} of sample {sample}", t,
                  (self.args["n_kv_heads"], T, self.args["head_dim"]))
        self._seen.add((layer, "cache"))
        pos = to_numpy(positions).astype(np.int64)
        H, D = keys.shape[0], keys.shape[2]
        lc = self._buffers(layer)
        if lc.positions is None:
            dims = {**self.dims, "T": int(self.lengths.max())}
            lc.positions = np.full(sc.CACHE_POSITIONS.shape_for(dims), sc.CACHE_POSITIONS.fill, dtype=np.int64)
            lc.lengths = np.full(sc.CACHE_LENGTHS.shape_for(dims), sc.CACHE_LENGTHS.fill, dtype=np.int64)
            lc.heads = (H, D)
        if T > lc.positions.shape[1]:
            lc.positions = np.pad(lc.positions, ((0, 0), (0, T - lc.positions.shape[1])),
                                  constant_values=sc.CACHE_POSITIONS.fill)
        lc.positions[sample, :T] = pos
        lc.lengths[sample] = T
        for name, t in (("keys", keys), ("values", values)):
            self._stat(layer, f"cache_{name}").add(sample, slab_stats(_slot_rows(t, T, H, D)))
            if self.level == "full":
                if name not in lc.tensors:
                    tmax = max(int(self.lengths.max()), T)
                    ds = sc.CACHE.create(self._group(layer), {**self.dims, "T": tmax}, name, to_numpy(t[:0]).dtype,
                                         maxshape=(self.n_samples, H, None, D), **self._kw((1, H, tmax, D)))
                    _text(ds, sc.ATTR_SOURCE_DTYPE, source_dtype(t))
                    lc.tensors[name] = ds
                ds = lc.tensors[name]
                if T > ds.shape[2]:
                    ds.resize((self.n_samples, H, T, D))
                if T:
                    self._write(ds, np.s_[sample, :, :T], t)
            elif self.level == "sampled":
                cells = self._sampled_cells(("cache", sample, T), sample, np.arange(T), np.ones(T, dtype=bool))
                self._write_sampled(layer, f"cache_{name}", sample, cells, t, heads=H)

    def layer_done(self, layer: int) -> None:
        """A layer is complete. What it kept in memory (its statistics, cache positions and sampled values) is
        written by ``flush`` or ``close``, all layers in one go: written here, between the prefill's layers,
        the same HDF5 calls took twice as long (caches cold after the engine's work)."""
        _check_interrupt()
        self._dirty.add(layer)

    def _write_layer(self, layer: int) -> None:
        """Write what a layer kept in memory: made on its first write, rewritten in place on a later one."""
        g = self._group(layer)
        stats = self._stats.get(layer, {})
        if stats:
            tables = _stat_tables(list(stats.values()))
            stats_id, sums_id = self._subgroup(g, layer, sc.STATS_GROUP), self._subgroup(g, layer, sc.CHECKSUMS_GROUP)
            for i, (name, st) in enumerate(stats.items()):
                self._put_small(stats_id, layer, sc.STATS, name, tables[i])
                self._put_small(sums_id, layer, sc.CHECKSUM, name, np.array(st.checksum, dtype=np.int64))
        buf = self._layers.get(layer)
        if buf is not None:
            self._write_cache_index(g, layer, buf)
            for name, smp in buf.sampled.items():
                self._write_sampled_layer(g, layer, name, smp)
            if buf.routing:
                self._write_routing(g, layer, buf)
        self._dirty.discard(layer)

    def _write_routing(self, g: h5py.Group, layer: int, buf: _LayerBuffers) -> None:
        """A layer's routing datasets, made on the layer's first write, in place later."""
        gid = self._subgroup(g, layer, sc.ROUTING_GROUP)
        for name, data in buf.routing.items():
            key = (layer, sc.ROUTING[name].path)
            dsid = self._small.get(key)
            if dsid is None:
                self._small[key] = dsid = _new_dataset(gid, name, np.ascontiguousarray(data), data.shape,
                                                       fill=sc.ROUTING[name].fill)
                if name == "logits":
                    _new_attr(dsid, sc.ATTR_SOURCE_DTYPE, buf.routing_source or str(data.dtype))
            else:
                dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))

    def _subgroup(self, g: h5py.Group, layer: int, name: str) -> h5py.h5g.GroupID:
        """The low-level id of layer group ``g``'s group ``name`` (stats, checksums, cache, sampled): made on first
        use, the stats group with its columns, or opened where the full level's cache tensors made it."""
        key = (layer, name)
        gid = self._small.get(key)
        if gid is None:
            buf = self._layers.get(layer)
            if name == sc.CACHE_GROUP and buf is not None and buf.tensors:
                gid = h5py.h5g.open(g.id, name.encode("ascii"))
            else:
                gid = _new_group(g.id, name)
                if name == sc.STATS_GROUP:
                    _new_attr(gid, sc.ATTR_COLUMNS, json.dumps(STAT_COLUMNS))
            self._small[key] = gid
        return gid

    def _put_small(self, gid, layer: int, el: sc.Element, name: str, data: np.ndarray) -> None:
        """A layer's contiguous statistics dataset ``el`` (stats/NAME or checksums/NAME, in its group ``gid``)
        holds ``data``: created on the layer's first write, written in place on a later one (a layer reached
        again)."""
        key = (layer, el.path, name)
        dsid = self._small.get(key)
        data = np.ascontiguousarray(data, dtype=el.dtype)
        if dsid is None:
            self._small[key] = _new_dataset(gid, name, data, el.shape_for(self.dims))
        else:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)

    def _write_cache_index(self, g: h5py.Group, layer: int, buf: _LayerBuffers) -> None:
        """A layer's cache positions and lengths, in one write each: created on the layer's first write (with
        the cache group's attributes), in place later."""
        if buf.positions is None:
            return
        key = (layer, sc.CACHE_POSITIONS.path)
        if key not in self._small:
            cache = self._subgroup(g, layer, sc.CACHE_GROUP)
            T = buf.positions.shape[1]
            self._small[key] = _new_dataset(cache, _leaf(sc.CACHE_POSITIONS), buf.positions, buf.positions.shape,
                                            fill=sc.CACHE_POSITIONS.fill, chunks=(1, T), maxshape=(self.n_samples, None))
            self._small[(layer, sc.CACHE_LENGTHS.path)] = _new_dataset(
                cache, _leaf(sc.CACHE_LENGTHS), buf.lengths, sc.CACHE_LENGTHS.shape_for(self.dims),
                fill=sc.CACHE_LENGTHS.fill)
            _new_attr(cache, sc.ATTR_HEAD_DIM, buf.heads[1])
            _new_attr(cache, sc.ATTR_N_KV_HEADS, buf.heads[0])
            return
        pos = h5py.Dataset(self._small[key])
        if pos.shape != buf.positions.shape:
            pos.resize(buf.positions.shape)
        pos[...] = buf.positions
        self._small[(layer, sc.CACHE_LENGTHS.path)].write(h5py.h5s.ALL, h5py.h5s.ALL, buf.lengths)

    def _write_sampled_layer(self, g: h5py.Group, layer: int, name: str, smp: _Sampled) -> None:
        """A layer's sampled/NAME: created with its attributes on the layer's first write, in place later."""
        key = (layer, sc.SAMPLED.path, name)
        dsid = self._small.get(key)
        if dsid is not None:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, smp.values)
            return
        shape = sc.SAMPLED.shape_for({**self.dims, "K": len(smp.channels)})
        dsid = _new_dataset(self._subgroup(g, layer, sc.SAMPLED_GROUP), name, smp.values, shape, fill=sc.SAMPLED.fill)
        _new_attr(dsid, sc.ATTR_CHANNELS, smp.channels)
        _new_attr(dsid, sc.ATTR_WIDTH, smp.width)
        _new_attr(dsid, sc.ATTR_SOURCE_DTYPE, smp.source_dtype)
        self._small[key] = dsid

    def final(self, sample: int, norm_last, logits, column: int, token_index: int) -> None:
        """h_b at the sample's gathered position (dim,), its raw logits (vocab_size,), and where it was gathered
        from: the stored column and the token index (the sample's last, n_b - 1, when the gather is right)."""
        self._need_begin()
        if not 0 <= int(sample) < self.n_samples:
            raise RecorderError(f"final: sample {sample} out of range (begin declared {self.n_samples} samples)")
        _want(f"final norm_last of sample {sample}", norm_last, (self.args["dim"],))
        _want(f"final logits of sample {sample}", logits, (self.args["vocab_size"],))
        h, z = to_numpy(norm_last), to_numpy(logits)
        if self._final is None:  # kept in memory, written by close in one write per dataset
            self.dims["k"] = min(self.topk, z.shape[0])
            own = {"norm_last": h.dtype, "logits": z.dtype, "topk_logits": z.dtype}  # float elements: the tensor's
            self._final = {key: np.full(el.shape_for(self.dims), 0 if el.fill is None else el.fill,
                                        dtype=own.get(key, el.dtype)) for key, el in sc.FINAL.items()}
            self._final_sources = {"logits": source_dtype(logits), "norm_last": source_dtype(norm_last)}
        fin = self._final
        self._roots_dirty = True
        order = top_ids(z, self.dims["k"])
        fin["norm_last"][sample] = h
        fin["logits"][sample] = z
        fin["topk_ids"][sample] = order
        fin["topk_logits"][sample] = z[order]
        fin["gather_col"][sample] = column
        fin["gather_token"][sample] = token_index
        fin["written"][sample] = 1

    def flush(self) -> None:
        """Write what the recorder keeps in memory until ``close`` (the layers' small datasets, the inputs, the
        final outputs so far): a reader of the file while it is recorded (``run --fail-fast`` compares in-memory
        traces layer by layer) calls it first. Each dataset is made with its data on the first call and written
        whole in place later; a layer still being recorded is written as far as it goes and rewritten later."""
        if self.n_samples is None:
            return
        for layer in sorted(self._dirty):
            self._write_layer(layer)
        if not self._roots_dirty:  # a live reader flushes per layer; the inputs are written once
            return
        for name, el in sc.INPUTS.items():
            self._root_dataset(el, self._inputs[name])
        for key, el in sc.FINAL.items() if self._final is not None else ():
            self._root_dataset(el, self._final[key], self._final_sources.get(key))
        self._roots_dirty = False

    def _root_dataset(self, el: sc.Element, data: np.ndarray, source_dtype: str | None = None) -> None:
        """Root element ``el`` (inputs/NAME, final/NAME: contiguous, its declared fill) holds ``data``: made on
        the first call (its group too, and its source_dtype attribute), in place later."""
        dsid = self._small.get((None, el.path))
        data = np.ascontiguousarray(data)
        if dsid is not None:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
            return
        group, _, leaf = el.path.rpartition("/")
        gid = self._small.get((None, group))
        if gid is None:
            gid = self._small[(None, group)] = _new_group(self.f.id, group)
        dsid = self._small[(None, el.path)] = _new_dataset(gid, leaf, data, el.shape_for(self.dims), fill=el.fill)
        if source_dtype is not None:
            _new_attr(dsid, sc.ATTR_SOURCE_DTYPE, source_dtype)

    def final_top_ids(self) -> list[int]:
        """Every sample's top-k ids as recorded so far (what a caller needs for token text after the run);
        empty before the first ``final``."""
        return [] if self._final is None else self._final["topk_ids"].ravel().tolist()

    def update_meta(self, **items) -> None:
        """Add or replace top-level keys of the trace's meta (written now, and again on close)."""
        self.meta.update(items)
        self._write_meta()

    def close(self) -> None:
        """Finish the file and move it into place (or, in memory, just mark it complete)."""
        if self._closed:
            return
        self._reuse = {}
        try:
            self._need_begin()
            self._check_complete()
            check_meta_as_read(self.meta, self.n_samples, self.lengths)
        except RecorderError:
            self.abort()  # nothing is left that looks like a trace
            raise
        self.flush()
        self._write_meta()
        self.f.attrs["complete"] = 1
        if self.in_memory:
            self.f.flush()
            self._closed = True
            return
        self.f.close()
        self._closed = True
        _check_interrupt()  # the interrupt may have been swallowed: never move an interrupted trace into place
        try:
            place(self.tmp, self.path, self.force)  # atomic: readers see the old state or the whole trace
        except BaseException:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            _PARTIAL.discard(self.tmp)
            raise
        _COMPLETED.append(str(self.path))
        _PARTIAL.discard(self.tmp)

    def _check_complete(self) -> None:
        """Every sample has its final output; every layer its required states and its cache."""
        written = self._final["written"] if self._final is not None else np.zeros(self.n_samples)
        missing = [int(s) for s in np.flatnonzero(written == 0)]
        if missing:
            raise RecorderError(f"final() was never called for sample(s) {missing[:8]}"
                                f"{' …' if len(missing) > 8 else ''}: every sample needs its final output "
                                "(the trace was not written)")
        absent = self.meta.get("absent_states") or {}
        routed = [layer for layer in range(self.args["n_layers"]) if (layer, "routing") in self._seen]
        margs = self.meta["model"]["args"]
        moe = [i for i in range(self.args["n_layers"]) if margs.get("n_experts") and i not in
               (margs.get("dense_layers") or ())]
        if routed and routed != moe:
            raise RecorderError(f"routing() was called for layers {routed[:8]}, the model's MoE layers are "
                                f"{moe[:8]}: a trace records the routing of every MoE layer or of none")
        for layer in range(self.args["n_layers"]):
            for name in REQUIRED_STATES + ("cache",):
                if (layer, name) not in self._seen and name not in absent:
                    what = "cache()" if name == "cache" else f"state {name!r}"
                    raise RecorderError(f"layer {layer} has no {what}: every layer needs {', '.join(REQUIRED_STATES)}"
                                        " and its cache (the trace was not written)")

    def abort(self) -> None:
        """Drop the partial file."""
        if self._closed:
            return
        self._closed = True
        try:
            self.f.close()
        except Exception:
            pass
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            _PARTIAL.discard(self.tmp)
