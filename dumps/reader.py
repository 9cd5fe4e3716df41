"""Reading traces: a Trace is the logical view of a trace file (samples, cells, layers, final outputs), checked
on open by dumps/file_checks.py (format and version first, then structure) and read row by row through
dumps/rows.py.

Nothing is read in bulk on open: tensors stay h5py datasets until a caller slices
one sample row at a time, so memory stays bounded whatever the trace size. LiveTrace reads a trace still
being recorded in memory (run --fail-fast), layer by layer.
"""
from __future__ import annotations

import os
from functools import cached_property

import h5py
import numpy as np

from ..engine.shared.errors import PrefillDiffError
from ..engine.shared.untrusted import regular_file, visible
from . import schema as sc
from .file_checks import DAMAGE, CheckedTrace, TraceError, check_trace_meta, guarded, json_attr
from .meta_fields import value
from .rows import RowReading
from .schema import FORMAT_VERSION, STAT_COLUMNS, STATES, layer_group


class LayerView:
    """One layer of a trace: states, statistics, samples and cache, all lazy."""

    def __init__(self, trace: "Trace", layer: int):
        self.trace, self.layer = trace, layer
        self.g = trace.f[layer_group(layer)]

    @guarded
    def state(self, name: str):
        ds = self.g.get(sc.STATE.rel(name))
        return ds if isinstance(ds, h5py.Dataset) else None

    @guarded
    def sampled(self, name: str):
        return self.g.get(sc.SAMPLED.rel(name))

    @guarded
    def stats(self, name: str):
        ds = self.g.get(sc.STATS.rel(name))
        if ds is None:
            return None
        st = self.trace.read(ds)
        col = {k: i for i, k in enumerate(STAT_COLUMNS)}
        full = self.g.get(sc.STATE.rel(name))
        limit = self.trace.n_cols * max(int(np.prod(full.shape[2:])) if full is not None else 1, 1) * 2 ** 20
        for c, f in (("count", "finite"), ("pad_count", "pad_finite")):
            n, k = st[:, col[c]], st[:, col[f]]
            if not (np.isfinite(n).all() and np.isfinite(k).all() and (n == np.round(n)).all()
                    and (k == np.round(k)).all() and (0 <= k).all() and (k <= n).all() and (n <= limit).all()):
                raise TraceError(f"{self.trace.name}: layer {self.layer} statistics of {name} are damaged "
                                 f"({c}/{f} must be whole numbers with 0 <= {f} <= {c})")
        return st

    @guarded
    def checksum(self, name: str):
        ds = self.g.get(sc.CHECKSUM.rel(name))
        return None if ds is None else self.trace.read(ds)

    @guarded
    def cache(self, name: str):
        return self.g.get(sc.CACHE.rel(name))

    def routing(self, name: str):
        """A MoE layer's routing dataset (ids, weights, margin, logits), or None (a dense layer, an older trace,
        or logits below the full level)."""
        return self.g.get(sc.ROUTING[name].rel())

    @guarded
    def op(self, name: str):
        """An op-level state's dataset (schema OP_TENSORS; [S, C, width]), or None (not recorded at this layer)."""
        ds = self.g.get(sc.OP_STATE.rel(name))
        if ds is None:
            return None
        problem = sc.OP_STATE.problem(ds, {"S": self.trace.n_samples, "C": self.trace.n_cols})
        if problem:
            raise TraceError(f"{self.trace.name}: layer {self.layer} ops/{name} {problem}")
        return ds

    @cached_property
    @guarded
    def cache_lengths(self) -> np.ndarray:
        lengths = self.trace.read(self.g[sc.CACHE_LENGTHS.rel()])
        cap = self.g[sc.CACHE_POSITIONS.rel()].shape[1]
        if lengths.dtype.kind not in "iu" or (lengths < 0).any() or (lengths > cap).any():
            raise TraceError(f"{self.trace.name}: layer {self.layer} cache lengths {lengths.tolist()[:8]} are not "
                             f"in [0, {cap}]")
        return lengths

    @cached_property
    @guarded
    def cache_positions(self) -> np.ndarray:
        return self.trace.read(self.g[sc.CACHE_POSITIONS.rel()])

    @guarded
    def names(self) -> list[str]:
        have = set(self.g.keys()) | {k for k in self.g.get(sc.STATS_GROUP, {}).keys()}
        return [s for s in STATES if s in have]


class Trace(CheckedTrace, RowReading):
    """A trace file opened for reading. Raises TraceError with the file name on any problem."""

    # True only for the in-memory view dumps.rank_merge builds over rank files it has opened (and checked) as
    # traces one by one: its virtual datasets are ours, so check_storage would refuse them for no reason
    _built_here = False

    def __init__(self, source, name: str | None = None):
        if isinstance(source, h5py.File):
            self.f, self.name = source, name or "<in-memory trace>"
        else:
            self.name = str(source)
            if not os.path.exists(self.name):
                raise TraceError(f"{self.name}: no such file")
            if os.path.isdir(self.name):
                raise TraceError(f"{self.name}: is a directory, not a trace")
            try:
                regular_file(self.name, "trace")  # a FIFO would block h5py forever; a device never ends
            except PrefillDiffError as e:
                raise TraceError(str(e)) from None
            try:
                self.f = h5py.File(self.name, "r")
            except OSError as e:
                raise TraceError(f"{self.name}: not a readable HDF5 file (truncated, corrupt or another format: "
                                 f"{str(e).splitlines()[0][:120]})") from None
        try:
            self._check()
        except TraceError:
            self.close()
            raise
        except DAMAGE as e:
            self.close()
            raise TraceError(f"{self.name}: damaged trace ({type(e).__name__}: {str(e)[:160]})") from None

    def close(self):
        chunks = self.__dict__.get("_chunks")  # made on the first row read
        if chunks is not None:
            chunks.close()
        try:
            self.f.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- logical view ---------------------------------------------------------------------------
    @cached_property
    @guarded
    def inputs(self) -> dict:
        return {k: self.read(self.f[el.path]) for k, el in sc.INPUTS.items()}

    @cached_property
    @guarded
    def samples(self) -> list[tuple]:
        ids = self.read(self.f[sc.TOKEN_IDS.path])
        return [tuple(int(t) for t in ids[s, :self.lengths[s]]) for s in range(self.n_samples)]

    def cells(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        """Columns holding the sample's valid, computed tokens, and their token indices, in token order."""
        cache = self.__dict__.setdefault("_cells", {})
        if sample not in cache:
            cache[sample] = self._cells_of(sample)
        return cache[sample]

    @guarded
    def _cells_of(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        inp = self.inputs
        ok = (inp["valid_mask"][sample] == 1) & (inp["computed"][sample] == 1) & (inp["token_index"][sample] >= 0)
        cols = np.flatnonzero(ok)
        toks = inp["token_index"][sample, cols]
        order = np.argsort(toks, kind="stable")
        cols, toks = cols[order], toks[order]
        n = int(self.lengths[sample])
        if toks.size and (toks[-1] >= n or (toks[1:] == toks[:-1]).any()):
            raise TraceError(f"{self.name}: /inputs/token_index of sample {sample} is inconsistent (indices must be "
                             f"distinct and below the sample's length {n}; got {toks.tolist()[:16]})")
        # the computed tokens are the prompt's suffix after the reused prefix (if any): never none, never holes
        if toks.size == 0 or toks[0] != n - toks.size or toks[-1] != n - 1:
            raise TraceError(f"{self.name}: sample {sample} does not compute a suffix of its {n} tokens "
                             f"(/inputs computed, valid_mask and token_index give {toks.tolist()[:16]})")
        rec = self.meta.get("record")
        if isinstance(rec, dict):  # a finished trace says which prefixes were reused
            reused = {o.get("sample"): o.get("prefix_len") for o in rec.get("reuse") or () if isinstance(o, dict)
                      and o.get("hit")}
            start = reused.get(sample, 0)
            if toks[0] != start:
                said = f"a prefix of {start} was reused" if start else "nothing was reused"
                raise TraceError(f"{self.name}: sample {sample} computes tokens from {int(toks[0])}, but its record "
                                 f"says {said}")
        ids = np.asarray(self.samples[sample], dtype=np.int64)[toks]
        if not np.array_equal(inp["input_ids"][sample, cols].astype(np.int64), ids):
            raise TraceError(f"{self.name}: /inputs/input_ids of sample {sample} disagree with /samples/token_ids")
        return cols, toks

    @guarded
    def pad_cols(self, sample: int) -> np.ndarray:
        inp = self.inputs
        return np.flatnonzero((inp["computed"][sample] == 1) & (inp["valid_mask"][sample] == 0))

    def layer(self, i: int) -> LayerView:
        return LayerView(self, i)

    def layers(self):
        for i in range(self.n_layers):
            yield LayerView(self, i)

    @cached_property
    @guarded
    def rows(self) -> dict:
        """What each cell's forward was (phase, step, cache_len: schema ROWS, [S, C]); a trace without them (before
        1.3, or a writer that does not say) reads as prefill cells whose cache length is not said (-1)."""
        shape = (self.n_samples, self.n_cols)
        return {k: self.read(self.f[el.path]) if isinstance(self.f.get(el.path), h5py.Dataset)
                else np.full(shape, el.fill, dtype=el.dtype) for k, el in sc.ROWS.items()}

    @cached_property
    @guarded
    def response(self) -> dict | None:
        """A response's rows (schema RESPONSE: token_index [S, R], logits [S, R, vocab]); None without one."""
        if not all(isinstance(self.f.get(el.path), h5py.Dataset) for el in sc.RESPONSE.values()):
            return None
        out = {k: self.read(self.f[el.path]) for k, el in sc.RESPONSE.items()}
        ti, z = out["token_index"], out["logits"]
        if ti.ndim != 2 or ti.shape[0] != self.n_samples or z.shape[:2] != ti.shape or \
                z.shape[2] != int(self.args.get("vocab_size") or z.shape[2]) or \
                ((ti < -1) | (ti >= self.lengths[:, None])).any():
            raise TraceError(f"{self.name}: /{sc.RESPONSE['token_index'].path} and /{sc.RESPONSE['logits'].path} "
                             "must be [samples, R] token indices in [-1, length) and [samples, R, vocab] logits")
        return out

    @property
    def ops(self) -> dict | None:
        """``meta.record.ops`` (format 1.4): the op-level states recorded and those absent, or None (none recorded)."""
        return (self.meta.get("record") or {}).get("ops") or None

    @cached_property
    @guarded
    def final(self) -> dict:
        out = {k: self.read(self.f[el.path]) for k, el in sc.FINAL.items()
               if isinstance(self.f.get(el.path), h5py.Dataset)}
        V = out["logits"].shape[1]
        ids = out["topk_ids"]
        if ids.dtype.kind not in "iu" or ids.shape[0] != self.n_samples or ((ids < 0) | (ids >= V)).any():
            raise TraceError(f"{self.name}: /{sc.FINAL['topk_ids'].path} must hold ids in [0, {V}) for "
                             f"{self.n_samples} samples")
        return out

    @property
    def model(self) -> dict:
        return self.meta.get("model", {})

    @property
    def args(self) -> dict:
        return self.model.get("args", {})

    def source_dtype(self, ds) -> str:
        v = ds.attrs.get("source_dtype", ds.dtype.name)
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if not isinstance(v, str) or len(v) > 32:
            raise TraceError(f"{self.name}: {ds.name} attribute 'source_dtype' must be a dtype name (got "
                             f"{visible(repr(v))[:60]})")
        return v


class LiveTrace(Trace):
    """A trace still being recorded in memory (run --fail-fast): layers are checked as they arrive."""

    def __init__(self, recorder, name: str):
        self.name, self._recorder = name, recorder
        self.f = recorder.written()  # with the inputs, which the recorder keeps in memory until it closes
        self._check_header(require_complete=False)
        self._check_inputs()
        self.n_layers = int(value(self.meta, "meta.model.args.n_layers", 0))
        self._checked = set()

    def layer(self, i: int) -> LayerView:
        if i not in self._checked:
            self._recorder.written()  # with the layers' small datasets, kept in memory until then
            if layer_group(i) not in self.f:
                raise TraceError(f"{self.name}: layer {i} has not been recorded")
            self._check_layer(i)
            self._checked.add(i)
        return LayerView(self, i)

    def refresh(self) -> None:
        """Re-read what the recorder finished since: meta and the final outputs."""
        self._recorder.written()
        self.meta = json_attr(self.f, "meta", self.name) or {}
        check_trace_meta(self.meta, self.name)
        self._check_final()
        self.__dict__.pop("final", None)


__all__ = ["Trace", "TraceError", "LayerView", "FORMAT_VERSION"]
