"""Per-rank traces of a tensor-parallel run, and the one logical trace they make.

Layout (format 1.1): a directory ``NAME.tpN/`` holding ``rank0.h5 … rank{N-1}.h5``, one ordinary
trace per rank, each written atomically by its own process. Every rank records what it holds:

- replicated tensors — the residual-stream states (after each all-reduce), the cache positions and
  lengths, the final norm and logits — with the dataset attribute ``placement = "replicated"``;
- its shards — ``attn_heads`` (its query heads' attention output, axis 2, in channels) and the KV
  cache ``cache/keys``, ``cache/values`` (its KV heads, axis 1) — with ``placement = "sharded"``,
  ``shard_axis``, and ``shard_start``/``shard_stop`` out of ``shard_size`` along that axis. Their
  statistics and checksums carry the same range: they cover the shard only.

Each rank file's ``meta.model.args`` describes the modules of that rank (its share of the heads,
so the file opens on its own as a trace); ``meta.parallel`` declares the mesh, the rank, the heads
it holds, the whole model's arguments (``model_args``) and a ``run_id`` common to the set.

``RankTrace(DIR)`` presents the set as one logical trace (a ``dumps.reader.Trace``): shards are
concatenated on their axis through HDF5 virtual datasets (nothing is read in bulk), replicated
tensors are taken once, from rank 0, and shard statistics are merged. Whether the replicas agree
is a comparison check (verify/rank_checks.py); whether the shards tile each tensor is checked here and
kept in ``shard_problems`` for the comparison to report as a shape break.
"""
from __future__ import annotations

import json
import os
import tempfile

import h5py
import numpy as np

from .reader import Trace, TraceError
from . import schema as sc
from .schema import REQUIRED_STATES, layer_group

# logical tensor (its stats name) -> (full dataset path in a layer group, dataset axis sharded)
SHARDED = {"attn_heads": (sc.STATE.rel("attn_heads"), 2), "cache_keys": (sc.CACHE.rel("keys"), 1),
           "cache_values": (sc.CACHE.rel("values"), 1)}
ATTR_PLACEMENT = "placement"  # format 1.1 (docs/trace-format.md, Rank traces)
_MASK64 = (1 << 64) - 1


def rank_dir(path, tp: int) -> str:
    """Where a tp run's rank traces go: ``x.h5`` -> ``x.tpN/``; any other name is the directory itself."""
    path = str(path)
    return path[:-3] + f".tp{tp}" if path.endswith(".h5") else path


def is_rank_set(path) -> bool:
    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), "rank0.h5"))


def open_any(path) -> Trace:
    """A trace file, or a directory of rank traces as one logical trace."""
    if os.path.isdir(str(path)):
        if not is_rank_set(path):
            raise TraceError(f"{path}: is a directory, but not a set of rank traces (no rank0.h5 in it)")
        return RankTrace(path)
    return Trace(path)


# -- recording: what a rank's trace declares (the ranks are run by the jobs: jobs/sides.py) -------------------------

def shard_ranges(args, rank: int, world: int) -> dict:
    """tensor -> (axis, start, stop, size) that rank ``rank`` holds, in dataset indices."""
    q, kv = args.n_heads // world, args.n_kv_heads // world
    hd = args.head_dim
    heads = (2, rank * q * hd, (rank + 1) * q * hd, args.n_heads * hd)
    cache = (1, rank * kv, (rank + 1) * kv, args.n_kv_heads)
    return {"attn_heads": heads, "cache_keys": cache, "cache_values": cache}


def annotate(f: h5py.File, args, rank: int, world: int, ranges: dict | None = None) -> None:
    """Declare each dataset's placement: replicated, or this rank's shard of a tensor."""
    ranges = ranges or shard_ranges(args, rank, world)
    for i in range(args.n_layers):
        g = f.get(layer_group(i))
        if g is None:
            continue
        for name in REQUIRED_STATES:
            for p in (sc.STATE.rel(name), sc.STATS.rel(name), sc.CHECKSUM.rel(name)):
                if p in g:
                    g[p].attrs[ATTR_PLACEMENT] = np.bytes_(b"replicated")
        for p in (sc.CACHE_POSITIONS.rel(), sc.CACHE_LENGTHS.rel()):
            if p in g:
                g[p].attrs[ATTR_PLACEMENT] = np.bytes_(b"replicated")
        for tensor, (path, _) in SHARDED.items():
            axis, a, b, size = ranges[tensor]
            for p in (path, sc.STATS.rel(tensor), sc.CHECKSUM.rel(tensor)):
                if p in g:
                    ds = g[p]
                    ds.attrs[ATTR_PLACEMENT] = np.bytes_(b"sharded")
                    if p == path:
                        ds.attrs["shard_axis"] = axis
                    ds.attrs["shard_start"], ds.attrs["shard_stop"], ds.attrs["shard_size"] = a, b, size
    for el in sc.FINAL.values():
        if el.path in f:
            f[el.path].attrs[ATTR_PLACEMENT] = np.bytes_(b"replicated")


# -- reading ---------------------------------------------------------------------------------------

class RankTrace(Trace):
    """A directory of rank traces, read as one logical trace (see the module docstring)."""

    _built_here = True  # the logical view's virtual datasets point only at rank files opened as Traces

    def __init__(self, path):
        self.dir = str(path).rstrip("/") or str(path)
        self.ranks: list[Trace] = []
        self.shard_problems: dict = {}  # (layer, tensor) -> why the rank shards do not tile it
        try:
            self._open_ranks()
            mem = self._logical()
        except BaseException:
            for t in self.ranks:
                t.close()
            raise
        super().__init__(mem, name=self.dir)

    def close(self):
        super().close()
        for t in self.ranks:
            t.close()

    def _open_ranks(self):
        d = self.dir
        first = Trace(os.path.join(d, "rank0.h5"))
        self.ranks.append(first)
        par = first.meta.get("parallel")
        if not isinstance(par, dict) or not isinstance(par.get("world_size"), int) or par["world_size"] < 1:
            raise TraceError(f"{d}/rank0.h5: not a rank trace (its metadata declares no parallel world_size)")
        world = par["world_size"]
        if world > 4096:
            raise TraceError(f"{d}/rank0.h5: declares world_size={world}, more ranks than a reader opens")
        names = {n for n in os.listdir(d) if n.startswith("rank") and n.endswith(".h5")}
        want = {f"rank{r}.h5" for r in range(world)}
        if names != want:
            missing, extra = sorted(want - names), sorted(names - want)
            raise TraceError(f"{d}: rank traces do not match world_size={world} declared by rank 0 "
                             f"(missing {', '.join(missing) or 'none'}; unexpected {', '.join(extra) or 'none'})")
        for r in range(1, world):
            self.ranks.append(Trace(os.path.join(d, f"rank{r}.h5")))
        for r, t in enumerate(self.ranks):
            p = t.meta.get("parallel") or {}
            where = f"{d}/rank{r}.h5"
            if p.get("rank") != r or p.get("world_size") != world:
                raise TraceError(f"{where}: declares rank {p.get('rank')!r} of {p.get('world_size')!r}, expected rank "
                                 f"{r} of {world}")
            if p.get("run_id") != par.get("run_id"):
                raise TraceError(f"{where}: belongs to another run than rank0.h5 (run_id {p.get('run_id')!r} vs "
                                 f"{par.get('run_id')!r}); rank traces of different runs cannot be combined")
            if t.level != first.level or t.n_layers != first.n_layers or t.samples != first.samples:
                raise TraceError(f"{where}: level, layers or samples differ from rank0.h5")
            for k, el in sc.INPUTS.items():
                if not np.array_equal(t.inputs[k], first.inputs[k]):
                    raise TraceError(f"{where}: /{el.path} differs from rank0.h5 (the ranks ran different inputs)")
        if not isinstance(par.get("model_args"), dict):
            raise TraceError(f"{d}/rank0.h5: meta.parallel.model_args (the whole model's arguments) is missing")

    def _logical(self) -> h5py.File:
        first = self.ranks[0]
        src = first.f
        # Built in a private temporary file, then reopened read-only and removed at once (the open handle
        # keeps it): HDF5 opens a virtual dataset's source files with its own file's driver and intent, so
        # an in-memory or writable logical file would read whole rank files into memory or lock them.
        fd, tmp = tempfile.mkstemp(prefix="prefill-diff-ranks-", suffix=".h5")
        os.close(fd)
        try:
            mem = h5py.File(tmp, "w", libver=("v110", "latest"))
            try:
                self._fill(mem, first, src)
            finally:
                mem.close()
            return h5py.File(tmp, "r")
        finally:
            os.unlink(tmp)

    def _fill(self, mem, first, src):
        for k, v in src.attrs.items():
            if k != "meta":
                mem.attrs[k] = v
        meta = json.loads(json.dumps(first.meta))
        par = dict(meta["parallel"])
        meta["model"]["args"] = par.pop("model_args")
        per_rank = ("rank", "query_heads", "kv_heads", "mlp_rows", "startup_s", "init_process_group_s",
                    "prepare_s", "prefill_record_s", "done_after_s")
        for k in per_rank:
            par.pop(k, None)
        par["ranks"] = [{k: t.meta["parallel"].get(k) for k in per_rank} for t in self.ranks]
        par["files"] = [f"rank{r}.h5" for r in range(len(self.ranks))]
        meta["parallel"] = par
        mem.attrs["meta"] = np.bytes_(json.dumps(meta, sort_keys=True).encode("utf-8"))
        for grp in {el.path.split("/")[0] for el in (sc.TOKEN_IDS, *sc.INPUTS.values(), *sc.FINAL.values())}:
            if grp in src:
                src.copy(src[grp], mem, name=grp)
        if sc.SAMPLED_GROUP in src:
            raise TraceError(f"{self.dir}: sampled-level rank traces are not supported")
        for i in range(first.n_layers):
            self._logical_layer(mem, i)

    def _logical_layer(self, mem: h5py.File, i: int):
        lg = layer_group(i)
        g0 = self.ranks[0].f[lg]
        out = mem.create_group(lg)
        sharded = set()
        for tensor, (path, axis) in SHARDED.items():
            sharded |= {path, sc.STATS.rel(tensor), sc.CHECKSUM.rel(tensor)}
        # replicated: rank 0's, as a virtual dataset (no copy) or, if small, a copy
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and name not in sharded:
                if obj.ndim >= 3:
                    _virtual(out, name, [(self.ranks[0].name, f"{lg}/{name}", obj.shape, None)], obj.shape, obj)
                else:
                    out.create_dataset(name, data=obj[()])
                    for k, v in obj.attrs.items():
                        out[name].attrs[k] = v
        g0.visititems(visit)
        cache, stats, heads = sc.CACHE_GROUP, sc.STATS_GROUP, sc.ATTR_N_KV_HEADS
        for k, v in g0.get(cache, {}).attrs.items() if cache in g0 else ():
            out.require_group(cache).attrs[k] = v
        if cache in out:
            out[cache].attrs[heads] = sum(int(t.f[lg][cache].attrs.get(heads, 0)) for t in self.ranks)
        for k, v in g0.get(stats, {}).attrs.items() if stats in g0 else ():
            out.require_group(stats).attrs[k] = v
        for tensor, (path, axis) in SHARDED.items():
            self._logical_shards(out, i, tensor, path, axis)

    def _extents(self, i: int, tensor: str, path: str):
        """Each rank's declared (start, stop) of ``tensor`` at layer i, and the size; problems recorded."""
        parts, sizes = [], set()
        for r, t in enumerate(self.ranks):
            g = t.f[layer_group(i)]
            ds = g.get(path) if path in g else g.get(sc.STATS.rel(tensor))
            if ds is None:
                return None
            try:
                a, b, n = (int(ds.attrs[k]) for k in ("shard_start", "shard_stop", "shard_size"))
            except KeyError:
                raise TraceError(f"{t.name}: layer {i} {tensor} does not declare its shard "
                                 "(shard_start, shard_stop, shard_size)") from None
            parts.append((a, b, r))
            sizes.add(n)
        size = max(sizes)
        problems = []
        if len(sizes) > 1:
            problems.append(f"ranks declare different sizes {sorted(sizes)}")
        at = 0
        for a, b, r in sorted(parts):
            if not 0 <= a < b <= size:
                problems.append(f"rank {r} holds {a}..{b}, outside 0..{size}")
            elif a > at:
                problems.append(f"{at}..{a} held by no rank")
            elif a < at:
                problems.append(f"rank {r}'s {a}..{b} overlaps {a}..{min(at, b)} held by another rank")
            at = max(at, b)
        if at < size:
            problems.append(f"{at}..{size} held by no rank")
        if problems:
            held = ", ".join(f"rank {r} {a}..{b}" for a, b, r in parts)
            self.shard_problems[(i, tensor)] = (f"the rank shards of {tensor} do not tile its {size} "
                                                f"{'channels' if tensor == 'attn_heads' else 'KV heads'} "
                                                f"({'; '.join(problems)}; {held})")
        return parts, size

    def _logical_shards(self, out, i, tensor, path, axis):
        lg = layer_group(i)
        ext = self._extents(i, tensor, path)
        if ext is None:
            return
        parts, size = ext
        g0 = self.ranks[0].f[lg]
        if path in g0:  # full level: one virtual dataset over the shards
            ds0 = g0[path]
            shape = list(ds0.shape)
            shape[axis] = size
            for r, t in enumerate(self.ranks):
                other = t.f[lg].get(path)
                if other is None or [s for k, s in enumerate(other.shape) if k != axis] != \
                        [s for k, s in enumerate(ds0.shape) if k != axis]:
                    self.shard_problems.setdefault((i, tensor), f"rank {r}'s shard of {tensor} has shape "
                                                   f"{None if other is None else other.shape}, rank 0's {ds0.shape}")
            pieces = [(self.ranks[r].name, f"{lg}/{path}", self.ranks[r].f[lg][path].shape, (axis, a, b))
                      for a, b, r in parts if path in self.ranks[r].f[lg]]
            _virtual(out, path, pieces, tuple(shape), ds0)
        stats = [t.f[lg].get(sc.STATS.rel(tensor)) for t in self.ranks]
        if all(s is not None for s in stats):
            merged = merge_stats([s[()] for s in stats])
            sc.STATS.create(out, {"S": merged.shape[0], "stat": merged.shape[1]}, tensor, data=merged)
        chk = [t.f[lg].get(sc.CHECKSUM.rel(tensor)) for t in self.ranks]
        if all(c is not None for c in chk) and path in g0 and self._words_aligned(g0[path], axis):
            total = np.zeros(chk[0].shape, dtype=object)
            for c in chk:
                total = total + c[()].astype(object)
            sc.CHECKSUM.create(out, {"S": total.size}, tensor,
                               data=np.array([_signed64(int(v)) for v in total.ravel()], dtype=np.int64))

    @staticmethod
    def _words_aligned(ds, axis) -> bool:
        """Checksums add over shards when each shard's row is whole 8-byte words."""
        inner = int(np.prod(ds.shape[axis:])) if axis == 2 else int(np.prod(ds.shape[1:])) // ds.shape[2]
        return (inner * ds.dtype.itemsize) % 8 == 0


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def _virtual(out, name, pieces, shape, like):
    """A virtual dataset of ``shape``: each piece (file, dataset, its shape, (axis, start, stop) or None)."""
    layout = h5py.VirtualLayout(shape=tuple(shape), dtype=like.dtype)
    for fname, dsname, pshape, where in pieces:
        source = h5py.VirtualSource(os.path.abspath(fname), dsname, shape=tuple(pshape))
        if where is None:
            layout[tuple(slice(0, s) for s in pshape)] = source
            continue
        axis, a, b = where
        a, b = max(a, 0), min(b, shape[axis], a + pshape[axis])
        if a >= b:
            continue
        sel = [slice(0, s) for s in pshape]
        sel[axis] = slice(a, b)
        src_sel = [slice(0, s) for s in pshape]
        src_sel[axis] = slice(0, b - a)
        layout[tuple(sel)] = source[tuple(src_sel)]
    fill = np.nan if like.dtype.kind == "f" else 0
    ds = out.create_virtual_dataset(name, layout, fillvalue=fill)
    for k, v in like.attrs.items():
        if k not in ("shard_axis", "shard_start", "shard_stop", "shard_size"):
            ds.attrs[k] = v
    return ds


def merge_stats(tables: list) -> np.ndarray:
    """Statistics of a tensor from the statistics of its shards (rows of schema.STAT_COLUMNS)."""
    t = np.stack(tables)  # (ranks, samples, columns)
    count, finite = t[..., 0].sum(0), t[..., 1].sum(0)
    has = t[..., 0] > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mn = np.where(has, t[..., 2], np.inf).min(0)
        mx = np.where(has, t[..., 3], -np.inf).max(0)
        mean = np.where(has, t[..., 4] * t[..., 0], 0.0).sum(0) / count
        l2 = np.sqrt(np.where(has, t[..., 5] ** 2, 0.0).sum(0))
    # a NaN minimum in any shard (a NaN value) stays NaN
    nan_min = (has & np.isnan(t[..., 2])).any(0)
    nan_max = (has & np.isnan(t[..., 3])).any(0)
    mn, mx = np.where(nan_min, np.nan, mn), np.where(nan_max, np.nan, mx)
    out = np.stack([count, finite, mn, mx, mean, l2, t[..., 6].sum(0), t[..., 7].sum(0)], axis=1)
    out[count == 0, 2:6] = np.nan
    return out
