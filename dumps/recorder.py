"""Recorder: the public API through which any engine writes a conforming trace.

Example (any engine; tensors may be torch tensors or numpy arrays)::

    from prefill_diff.dumps import Recorder

    with Recorder("trace.h5", level="full") as rec:
        rec.begin(samples=[[5, 6, 7], [8, 9]], n_cols=3, meta={"model": {...}, "run": {...}})
        for s in range(2):                       # one trace row per sample, columns as laid out
            rec.inputs(s, 0, ids[s], valid[s], positions[s], token_index[s])
        for layer in range(n_layers):
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                for s in range(2):
                    rec.state(layer, name, s, 0, x[name][s])          # (columns, width)
            for s in range(2):
                rec.cache(layer, s, keys[s], values[s], cache_positions[s])  # (H_kv, T, d_h), (T,)
            rec.layer_done(layer)
        for s in range(2):
            rec.final(s, norm_last[s], logits[s], column=last_col[s], token_index=last_tok[s])
    # leaving the block closes the file and renames it into place; an exception removes it

The file is written under a temporary name beside the target and renamed only when
complete and closed, so an interrupted run never leaves a file a reader accepts.
This module does not import torch: tensors are used through their own methods.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import h5py
import numpy as np

from ..engine.errors import INTERRUPT, PrefillDiffError
from .schema import FORMAT_NAME, FORMAT_VERSION, LEVELS, STAT_COLUMNS, layer_group

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


def completed_traces(start: int = 0) -> list:
    """Traces this process finished and moved into place (from the ``start``-th on) that are still there."""
    return [p for p in _COMPLETED[start:] if os.path.exists(p)]


class TraceExistsError(PrefillDiffError):
    """The target trace exists and --force was not given."""


def _renameat2_noreplace(src: str, dst: str) -> bool:
    """rename(src, dst) failing if dst exists (Linux renameat2 RENAME_NOREPLACE); False if unavailable here."""
    import ctypes
    import errno
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


class RecorderError(PrefillDiffError):
    """The recorder was called out of order or with inconsistent data."""


def _is_torch(x) -> bool:
    return hasattr(x, "detach") and hasattr(x, "dtype") and str(x.dtype).startswith("torch.")


def source_dtype(x) -> str:
    return str(x.dtype).replace("torch.", "") if _is_torch(x) else np.dtype(x.dtype).name


def to_numpy(x) -> np.ndarray:
    """Host copy of a tensor; bfloat16 becomes float32 (exact), other float dtypes are kept."""
    if _is_torch(x):
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def slab_stats(x) -> tuple:
    """(count, finite, min, max, sum, sumsq, checksum) of a 2-D slab (rows, width), on the tensor's own device.

    Four passes at memory speed: aminmax, sum, a BLAS dot for the sum of squares, and the checksum;
    the finite count is only computed when sum or sumsq is not finite. The checksum is the wrapped int64
    sum, row by row, of the data's 8-byte words (each row zero-padded to a multiple of 8 bytes), so it
    composes over any split into rows: equal data gives equal checksums. A differing checksum alone is
    never a failure.
    """
    n = int(np.prod(x.shape))
    if n == 0:
        return 0, 0, np.inf, -np.inf, 0.0, 0.0, 0
    if _is_torch(x):
        import sys
        torch = sys.modules["torch"]  # x is a torch tensor, so torch is already imported
        xc = x.detach().contiguous()
        flat = (xc if xc.dtype in (torch.float32, torch.float64) else xc.float()).view(-1)
        mn, mx = flat.aminmax()
        v = [float(t) for t in (mn, mx, flat.sum(), torch.dot(flat, flat))]
        finite = n if np.isfinite(v[2]) and np.isfinite(v[3]) else int(flat.isfinite().sum())
        return n, finite, v[0], v[1], v[2], v[3], _torch_checksum(xc, torch)
    a = np.ascontiguousarray(x)
    af = (a.astype(np.float64) if a.dtype.itemsize < 4 else a).ravel()
    s, ss = float(af.sum(dtype=np.float64)), float(np.dot(af, af))
    finite = n if np.isfinite(s) and np.isfinite(ss) else int(np.isfinite(af).sum())
    return n, finite, float(af.min()), float(af.max()), s, ss, _numpy_checksum(a)


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
        self.valid = np.zeros((n_samples, 6))  # count, finite, min, max, sum, sumsq
        self.valid[:, 2], self.valid[:, 3] = np.inf, -np.inf
        self.pad = np.zeros((n_samples, 2))  # count, finite
        self.checksum = [0] * n_samples

    def add(self, s: int, st: tuple, padding: bool = False) -> None:
        if padding:
            self.pad[s] += st[:2]
            return
        row = self.valid[s]
        row[0] += st[0]
        row[1] += st[1]
        row[2] = min(row[2], st[2]) if not np.isnan(st[2]) else np.nan
        row[3] = max(row[3], st[3]) if not np.isnan(st[3]) else np.nan
        row[4] += st[4]
        row[5] += st[5]
        self.checksum[s] = _signed64(self.checksum[s] + st[6])

    def table(self) -> np.ndarray:
        """Rows of STAT_COLUMNS."""
        v = self.valid
        count = np.maximum(v[:, 0], 1)
        with np.errstate(invalid="ignore"):
            out = np.stack([v[:, 0], v[:, 1], v[:, 2], v[:, 3], v[:, 4] / count, np.sqrt(v[:, 5]),
                            self.pad[:, 0], self.pad[:, 1]], axis=1)
        empty = v[:, 0] == 0
        out[empty, 2:6] = np.nan
        return out


def select_tokens(length: int, k: int) -> list[int]:
    """The sampled level's token indices: k evenly spaced over the prompt, first and last included."""
    if length <= k:
        return list(range(length))
    return sorted({round(i * (length - 1) / (k - 1)) for i in range(k)})


def select_channels(width: int, k: int, seed: int) -> np.ndarray:
    if width <= k:
        return np.arange(width)
    return np.sort(np.random.default_rng(seed).choice(width, k, replace=False))


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
            if self.path.exists() and not force:
                raise TraceExistsError(f"{self.path} exists; pass --force to overwrite it")
            if self.path.is_dir():
                raise RecorderError(f"{self.path} is a directory")
            self.tmp = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
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
        self._stats: dict[tuple[int, str], _Stats] = {}
        self._closed = False
        self.n_samples = None
        self._ds = {}

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
        self.n_samples, self.n_cols = S, n_cols
        self.lengths = np.array([len(s) for s in samples], dtype=np.int64)
        nmax = int(self.lengths.max())
        ids = np.full((S, nmax), -1, dtype=np.int64)
        for i, s in enumerate(samples):
            ids[i, :len(s)] = s
        self.f.create_dataset("samples/token_ids", data=ids)
        self.f.create_dataset("samples/lengths", data=self.lengths)
        for name, dtype, fill in (("input_ids", np.int64, 0), ("valid_mask", np.uint8, 0),
                                  ("computed", np.uint8, 0), ("positions", np.int64, 0),
                                  ("token_index", np.int64, -1)):
            self.f.create_dataset(f"inputs/{name}", shape=(S, n_cols), dtype=dtype, fillvalue=fill)
        self.valid = np.zeros((S, n_cols), dtype=bool)
        self.tok = np.full((S, n_cols), -1, dtype=np.int64)
        self.meta = dict(meta)
        self._write_meta()
        self._sampled_toks = [select_tokens(int(n), self.sample_tokens) for n in self.lengths]
        self._slot_of_tok = []  # per sample: token index -> sampled slot, -1 if not sampled
        for n, toks in zip(self.lengths, self._sampled_toks):
            m = np.full(int(n), -1, dtype=np.int64)
            m[toks] = np.arange(len(toks))
            self._slot_of_tok.append(m)
        self._ds = {}
        if self.level == "sampled":
            P = max(len(t) for t in self._sampled_toks)
            st = np.full((S, P), -1, dtype=np.int64)
            for i, t in enumerate(self._sampled_toks):
                st[i, :len(t)] = t
            self.f.create_dataset("sampled/token_index", data=st)
            self.f["sampled"].attrs["seed"] = self.sample_seed

    def _write_meta(self):
        _text(self.f, "meta", json.dumps(self.meta, sort_keys=True, default=str))

    def _need_begin(self):
        if self.n_samples is None:
            raise RecorderError("begin() must be called before writing tensors")

    def inputs(self, sample: int, col: int, ids, valid, positions, token_index) -> None:
        """The physical cells one prefill call laid out for a sample, from column ``col``."""
        self._need_begin()
        v = to_numpy(valid).astype(bool)
        T = v.shape[0]
        sl = np.s_[sample, col:col + T]
        self.f["inputs/input_ids"][sl] = to_numpy(ids)
        self.f["inputs/valid_mask"][sl] = v.astype(np.uint8)
        self.f["inputs/computed"][sl] = np.ones(T, dtype=np.uint8)
        self.f["inputs/positions"][sl] = to_numpy(positions)
        self.f["inputs/token_index"][sl] = to_numpy(token_index)
        self.valid[sl], self.tok[sl] = v, to_numpy(token_index)

    def _stat(self, layer: int, name: str) -> _Stats:
        key = (layer, name)
        if key not in self._stats:
            self._stats[key] = _Stats(self.n_samples)
        return self._stats[key]

    def state(self, layer: int, name: str, sample: int, col: int, x) -> None:
        """One sample's cells [col, col + T) of a residual-stream state, (T, width)."""
        self._need_begin()
        T = x.shape[0]
        v = self.valid[sample, col:col + T]
        st = self._stat(layer, name)
        idx = np.flatnonzero(v)
        if idx.size:
            a, b = int(idx[0]), int(idx[-1]) + 1
            st.add(sample, slab_stats(x[a:b]))
            if a > 0:
                st.add(sample, slab_stats(x[:a]), padding=True)
            if b < T:
                st.add(sample, slab_stats(x[b:]), padding=True)
        else:
            st.add(sample, slab_stats(x), padding=True)
        if self.level == "full":
            ds = self._state_ds(layer, name, x)
            self._write(ds, np.s_[sample, col:col + T], x)
        elif self.level == "sampled":
            self._write_sampled(layer, name, sample, self.tok[sample, col:col + T], v, x)

    def _write_sampled(self, layer, name, sample, toks, valid, x):
        """The declared (token, channel) subset of one sample's rows (T, width)."""
        m = self._slot_of_tok[sample]
        ok = valid & (toks >= 0) & (toks < m.shape[0])
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            return
        slots = m[toks[rows]]
        keep = slots >= 0
        rows, slots = rows[keep], slots[keep]
        if rows.size == 0:
            return
        ds, ch = self._sampled_ds(layer, name, x.shape[1], x)
        order = np.argsort(slots)
        ds[sample, slots[order].tolist()] = to_numpy(x[rows[order]])[:, ch]

    def _state_ds(self, layer, name, x):
        key = (layer, name)
        if key not in self._ds:
            dt = to_numpy(x[:0]).dtype
            ds = self.f.create_dataset(f"{layer_group(layer)}/{name}", shape=(self.n_samples, self.n_cols, x.shape[1]),
                                       dtype=dt, **self._kw((1, self.n_cols, x.shape[1])))
            _text(ds, "source_dtype", source_dtype(x))
            self._ds[key] = ds
        return self._ds[key]

    def _sampled_ds(self, layer, name, width, x):
        key = (layer, "sampled", name)
        if key not in self._ds:
            P = self.f["sampled/token_index"].shape[1]
            ch = select_channels(width, self.sample_channels, self.sample_seed)
            dt = to_numpy(x[:0]).dtype
            ds = self.f.create_dataset(f"{layer_group(layer)}/sampled/{name}", shape=(self.n_samples, P, len(ch)),
                                       dtype=dt, fillvalue=np.nan)
            ds.attrs["channels"] = ch
            ds.attrs["width"] = width
            _text(ds, "source_dtype", source_dtype(x))
            self._ds[key] = (ds, ch)
        return self._ds[key]

    def cache(self, layer: int, sample: int, keys, values, positions) -> None:
        """One sample's logical cache at a layer: keys and values (H_kv, T, d_h), positions (T,)."""
        self._need_begin()
        g = f"{layer_group(layer)}/cache"
        pos = to_numpy(positions).astype(np.int64)
        T = pos.shape[0]
        H, D = keys.shape[0], keys.shape[2]
        if f"{g}/positions" not in self.f:
            tmax = int(self.lengths.max())
            self.f.create_dataset(f"{g}/positions", shape=(self.n_samples, tmax), maxshape=(self.n_samples, None),
                                  dtype=np.int64, fillvalue=-1, chunks=(1, tmax))
            self.f.create_dataset(f"{g}/lengths", shape=(self.n_samples,), dtype=np.int64, fillvalue=0)
            self.f[g].attrs["head_dim"] = D
            self.f[g].attrs["n_kv_heads"] = H
        pds = self.f[f"{g}/positions"]
        if T > pds.shape[1]:
            pds.resize((self.n_samples, T))
        pds[sample, :T] = pos
        self.f[f"{g}/lengths"][sample] = T
        for name, t in (("keys", keys), ("values", values)):
            flat = t.swapaxes(0, 1).reshape(T, H * D) if T else t.reshape(0, H * D)  # (T, H_kv*d_h)
            self._stat(layer, f"cache_{name}").add(sample, slab_stats(flat))
            if self.level == "full":
                path = f"{g}/{name}"
                if path not in self.f:
                    tmax = max(int(self.lengths.max()), T)
                    ds = self.f.create_dataset(path, shape=(self.n_samples, H, tmax, D), dtype=to_numpy(t[:0]).dtype,
                                               maxshape=(self.n_samples, H, None, D), **self._kw((1, H, tmax, D)))
                    _text(ds, "source_dtype", source_dtype(t))
                ds = self.f[path]
                if T > ds.shape[2]:
                    ds.resize((self.n_samples, H, T, D))
                if T:
                    self._write(ds, np.s_[sample, :, :T], t)
            elif self.level == "sampled":
                self._write_sampled(layer, f"cache_{name}", sample, np.arange(T), np.ones(T, dtype=bool), flat)

    def layer_done(self, layer: int) -> None:
        """Write the statistics of a completed layer (a reader streaming this file may then read it)."""
        _check_interrupt()
        for (lay, name), st in list(self._stats.items()):
            if lay != layer:
                continue
            base = f"{layer_group(layer)}/stats"
            if f"{base}/{name}" in self.f:
                del self.f[f"{base}/{name}"], self.f[f"{layer_group(layer)}/checksums/{name}"]
            self.f.create_dataset(f"{base}/{name}", data=st.table())
            self.f.create_dataset(f"{layer_group(layer)}/checksums/{name}", data=np.array(st.checksum, dtype=np.int64))
            _text(self.f[base], "columns", json.dumps(STAT_COLUMNS))
            del self._stats[(lay, name)]

    def final(self, sample: int, norm_last, logits, column: int, token_index: int) -> None:
        """h_b at the sample's gathered position, its raw logits, and where it was gathered from."""
        self._need_begin()
        h, z = to_numpy(norm_last), to_numpy(logits)
        S = self.n_samples
        if "final/logits" not in self.f:
            k = min(self.topk, z.shape[0])
            self.f.create_dataset("final/norm_last", shape=(S, h.shape[0]), dtype=h.dtype)
            self.f.create_dataset("final/logits", shape=(S, z.shape[0]), dtype=z.dtype)
            self.f.create_dataset("final/topk_ids", shape=(S, k), dtype=np.int64)
            self.f.create_dataset("final/topk_logits", shape=(S, k), dtype=z.dtype)
            self.f.create_dataset("final/gather_col", shape=(S,), dtype=np.int64, fillvalue=-1)
            self.f.create_dataset("final/gather_token", shape=(S,), dtype=np.int64, fillvalue=-1)
            self.f.create_dataset("final/written", shape=(S,), dtype=np.uint8)
            _text(self.f["final/logits"], "source_dtype", source_dtype(logits))
            _text(self.f["final/norm_last"], "source_dtype", source_dtype(norm_last))
        k = self.f["final/topk_ids"].shape[1]
        order = np.argsort(-z.astype(np.float64), kind="stable")[:k]  # ties: lower id first
        self.f["final/norm_last"][sample] = h
        self.f["final/logits"][sample] = z
        self.f["final/topk_ids"][sample] = order
        self.f["final/topk_logits"][sample] = z[order]
        self.f["final/gather_col"][sample] = column
        self.f["final/gather_token"][sample] = token_index
        self.f["final/written"][sample] = 1

    def update_meta(self, **items) -> None:
        self.meta.update(items)
        self._write_meta()

    def close(self) -> None:
        """Finish the file and move it into place (or, in memory, just mark it complete)."""
        if self._closed:
            return
        self._need_begin()
        for layer in sorted({lay for lay, _ in self._stats}):
            self.layer_done(layer)
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
