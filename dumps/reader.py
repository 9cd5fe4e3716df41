"""Reading traces: format and version first, then structure, then a lazy logical view.

Nothing is read in bulk on open: tensors stay h5py datasets until a caller slices
one sample row at a time, so memory stays bounded whatever the trace size.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from functools import cached_property
from typing import Iterator, NamedTuple

import h5py
import numpy as np

from ..engine.shared.errors import PrefillDiffError
from ..engine.shared.untrusted import regular_file, visible
from .chunks import ChunkReader
from .metacheck import MetaError, check_meta, check_meta_against_file
from . import schema as sc
from .schema import (CACHE_TENSORS, FORMAT_NAME, FORMAT_VERSION, META_LIMIT, READABLE_MAJOR, REQUIRED_STATES, TENSOR,
                     STAT_COLUMNS, STATES, layer_group)


class TraceError(PrefillDiffError):
    """A file is not a readable trace: missing, not HDF5, foreign, unknown version, incomplete or corrupt."""


_DAMAGE = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError, AttributeError,
           UnicodeDecodeError, MemoryError)
ROW_LIMIT = 1 << 30  # bytes of one stored sample row a reader will allocate


def _guarded(fn):
    """Turn whatever HDF5 raises on a damaged file into one TraceError naming the file."""
    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        try:
            return fn(self, *a, **kw)
        except TraceError:
            raise
        except _DAMAGE as e:
            name = getattr(self, "name", None) or getattr(getattr(self, "trace", None), "name", "trace")
            first = str(e).splitlines()[0][:160] if str(e) else ""
            raise TraceError(f"{name}: damaged trace ({type(e).__name__}: {first})") from None
    return wrapper


def _json_attr(f, key: str, where: str):
    raw = f.attrs.get(key)
    if raw is None:
        return None
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not isinstance(raw, str):
        raise TraceError(f"{where}: attribute {key!r} must be JSON text (got {type(raw).__name__})")
    if len(raw) > META_LIMIT:
        raise TraceError(f"{where}: attribute {key!r} is {len(raw)} bytes of JSON, over the {META_LIMIT} limit")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise TraceError(f"{where}: attribute {key!r} is not valid JSON ({e})") from None


# Filters the recorder writes (gzip with shuffle); anything else is a file this tool did not write, and an
# unknown filter is code run on read (HDF5 loads filter plugins by id).
ALLOWED_FILTERS = {h5py.h5z.FILTER_DEFLATE: "gzip", h5py.h5z.FILTER_SHUFFLE: "shuffle"}
OBJECT_LIMIT = 100_000  # links a reader walks before it gives up on a file


def check_storage(f: h5py.File, where: str) -> None:
    """Refuse, before reading any data, every object that would make HDF5 read outside this file or run code
    this tool does not ship: external links, soft links (the recorder writes none; one may lead to an external
    link), user-defined links, datasets with external storage, virtual datasets, filters other than gzip and
    shuffle. Raises TraceError naming the object and why.

    Two walks inside HDF5 (H5Lvisit over every link, H5Ovisit over every object once, both through hard
    links only, so cycles are cut and nothing outside the file is opened) call back into Python once per
    link and once per object; only datasets are opened, and only to read their creation properties."""
    count = [0]

    def on_link(name: bytes, info):
        count[0] += 1
        if count[0] > OBJECT_LIMIT:
            return f"{where}: more than {OBJECT_LIMIT} objects; not a trace this tool wrote"
        return None if info.type == h5py.h5l.TYPE_HARD else _link_refusal(f, name, info.type, where)

    def on_object(name: bytes, info):
        if info.type != h5py.h5o.TYPE_DATASET:
            return None
        return _dataset_refusal(h5py.h5d.open(f.id, name), visible("/" + _text_name(name))[:200], where)

    refusal = f.id.links.visit(on_link, info=True) or h5py.h5o.visit(f.id, on_object, info=True)
    if refusal:
        raise TraceError(refusal)


def _text_name(name: bytes) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def _link_refusal(f: h5py.File, name: bytes, kind: int, where: str) -> str:
    shown = visible("/" + _text_name(name))[:200]
    if kind == h5py.h5l.TYPE_EXTERNAL:
        link = f.get(name, getlink=True)
        return (f"{where}: {shown} is an external link to {visible(link.filename)[:200]}:"
                f"{visible(link.path)[:100]}; refused (a trace never reads other files)")
    if kind == h5py.h5l.TYPE_SOFT:
        link = f.get(name, getlink=True)
        return (f"{where}: {shown} is a soft link to {visible(link.path)[:200]}; refused "
                "(traces hold no links, and a link may lead out of the file)")
    return f"{where}: {shown} is a user-defined link (HDF5 link type {kind}); refused"


def _dataset_refusal(dsid, shown: str, where: str) -> str | None:
    plist = dsid.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        return f"{where}: dataset {shown} is a virtual dataset (it maps data from other files); refused"
    if plist.get_external_count() > 0:
        target = plist.get_external(0)[0]
        target = target.decode("utf-8", "replace") if isinstance(target, bytes) else str(target)
        return (f"{where}: dataset {shown} keeps its data in external file {visible(target)[:200]}; "
                "refused (a trace never reads other files)")
    for i in range(plist.get_nfilters()):
        code, _flags, _values, fname = plist.get_filter(i)
        if code not in ALLOWED_FILTERS:
            fname = fname.decode("utf-8", "replace") if isinstance(fname, bytes) else str(fname)
            return (f"{where}: dataset {shown} uses HDF5 filter {code} ({visible(fname)[:60] or 'unnamed'})"
                    f"; refused (traces use only {', '.join(ALLOWED_FILTERS.values())})")
    return None


_local = threading.local()


def _row_buffer(slot: str, shape, dtype) -> np.ndarray:
    bufs = getattr(_local, "rows", None)
    if bufs is None:
        bufs = _local.rows = {}
    key = (slot, tuple(shape), np.dtype(dtype).str)
    if key not in bufs:
        for k in [k for k in bufs if k[0] == slot]:  # one buffer per slot: drop the old shape
            del bufs[k]
        bufs[key] = np.empty(shape, dtype=dtype)
    return bufs[key]


class RowSource(NamedTuple):
    """Rows of one dataset of one open trace, for read_ahead."""
    trace: "Trace"
    ds: h5py.Dataset


def _new_reader() -> None:
    """The read-ahead thread's executor; a forked child gets a new one (the parent's thread is not there, and
    the old executor would queue work that no thread ever runs)."""
    global _READER
    _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-diff-read")


_new_reader()
os.register_at_fork(after_in_child=_new_reader)
READ_AHEAD = True  # False: read_ahead reads each step on the calling thread (tests/bench/bench_compare.py)
AHEAD_MIN_BYTES = 256 * 1024  # smaller steps are read on the calling thread: a hand-over costs more than the read


def read_ahead(sources, steps) -> Iterator[tuple]:
    """For each step (one row index per source), the rows ``source.ds[index]`` of every source, in order; the
    next step's rows are read while this step's are used.

    A comparison alternates reading rows (a system call that copies from the page cache or waits
    for the disk) and computing on them (numpy); both release the GIL, so reading the next rows on
    a background thread hides most of the read. The rows are two alternating buffers per source,
    of the calling thread: a step's rows are valid until the next step is requested. A read's error
    is raised here, when its step is requested; a generator closed early waits for the read in
    flight (the traces may be closed next).
    """
    sources, steps = [RowSource(*s) for s in sources], [tuple(s) for s in steps]
    if not steps:
        return
    mapped = [s.trace.mapped_rows(s.ds) for s in sources]
    if all(m is not None for m in mapped):
        yield from _mapped_rows(mapped, steps)
        return
    bufs = [[_row_buffer(f"ahead{j}.{k}", s.ds.shape[1:], s.ds.dtype) for j, s in enumerate(sources)] for k in (0, 1)]

    def read(k: int) -> tuple:
        return tuple(s.trace.read_row_into(s.ds, i, b) for s, i, b in zip(sources, steps[k], bufs[k % 2]))

    step_bytes = sum(int(np.prod(s.ds.shape[1:])) * s.ds.dtype.itemsize for s in sources)
    if not READ_AHEAD or step_bytes < AHEAD_MIN_BYTES:
        yield from (read(k) for k in range(len(steps)))
        return
    for s in sources:
        s.trace.direct_reader()  # made on this thread: the reading thread only uses it
    pending = _READER.submit(read, 0)
    try:
        for k in range(len(steps)):
            rows = pending.result()
            pending = _READER.submit(read, k + 1) if k + 1 < len(steps) else None
            yield rows
    finally:
        if pending is not None:
            pending.cancel() or wait([pending])


def _mapped_rows(mapped, steps) -> Iterator[tuple]:
    """read_ahead over mapped files (Trace.mapped_rows): each row a view of the page cache, no copy and no
    thread; the next step's rows are announced to the kernel first, so that a cold file is read while this
    step is compared, and the previous step's pages are released from the process once it is over (its
    views stay valid: touched again, they fault the pages back in)."""
    for k, step in enumerate(steps):
        if k + 1 < len(steps):
            for (_, will_need, _), i in zip(mapped, steps[k + 1]):
                will_need(i)
        try:
            yield tuple(view(i) for (view, _, _), i in zip(mapped, step))
        finally:
            for (_, _, done_with), i in zip(mapped, step):
                done_with(i)


class LayerView:
    """One layer of a trace: states, statistics, samples and cache, all lazy."""

    def __init__(self, trace: "Trace", layer: int):
        self.trace, self.layer = trace, layer
        self.g = trace.f[layer_group(layer)]

    @_guarded
    def state(self, name: str):
        ds = self.g.get(sc.STATE.rel(name))
        return ds if isinstance(ds, h5py.Dataset) else None

    @_guarded
    def sampled(self, name: str):
        return self.g.get(sc.SAMPLED.rel(name))

    @_guarded
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

    @_guarded
    def checksum(self, name: str):
        ds = self.g.get(sc.CHECKSUM.rel(name))
        return None if ds is None else self.trace.read(ds)

    @_guarded
    def cache(self, name: str):
        return self.g.get(sc.CACHE.rel(name))

    def routing(self, name: str):
        """A MoE layer's routing dataset (ids, weights, margin, logits), or None (a dense layer, an older trace,
        or logits below the full level)."""
        return self.g.get(sc.ROUTING[name].rel())

    @cached_property
    @_guarded
    def cache_lengths(self) -> np.ndarray:
        lengths = self.trace.read(self.g[sc.CACHE_LENGTHS.rel()])
        cap = self.g[sc.CACHE_POSITIONS.rel()].shape[1]
        if lengths.dtype.kind not in "iu" or (lengths < 0).any() or (lengths > cap).any():
            raise TraceError(f"{self.trace.name}: layer {self.layer} cache lengths {lengths.tolist()[:8]} are not "
                             f"in [0, {cap}]")
        return lengths

    @cached_property
    @_guarded
    def cache_positions(self) -> np.ndarray:
        return self.trace.read(self.g[sc.CACHE_POSITIONS.rel()])

    @_guarded
    def names(self) -> list[str]:
        have = set(self.g.keys()) | {k for k in self.g.get(sc.STATS_GROUP, {}).keys()}
        return [s for s in STATES if s in have]


class Trace:
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
        except _DAMAGE as e:
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

    def read(self, ds, sel=()):
        """ds[sel], turning HDF5 read failures into TraceError."""
        try:
            return ds[sel]
        except _DAMAGE as e:
            raise TraceError(f"{self.name}: cannot read {ds.name} (corrupt data: {str(e).splitlines()[0][:120]})") \
                from None

    def read_row(self, ds, index: int, slot: str) -> np.ndarray:
        """ds[index] (one sample's chunk) into a reused per-thread buffer named ``slot``.

        Streaming compare reads thousands of rows of the same shape; reading into the same memory
        avoids a fresh allocation (and its page faults) per row. The result is valid until the next
        read into the same slot on the same thread.
        """
        return self.read_row_into(ds, index, _row_buffer(slot, ds.shape[1:], ds.dtype))

    def read_row_into(self, ds, index: int, buf: np.ndarray) -> np.ndarray:
        """ds[index] into ``buf`` (C-contiguous, of the row's shape and dtype); returns ``buf``."""
        try:
            if not self._chunks.read_row(ds, index, buf):  # uncompressed rows of a checked file: os.preadv
                ds.read_direct(buf, np.s_[index])
        except _DAMAGE as e:
            raise TraceError(f"{self.name}: cannot read {ds.name} (corrupt data: {str(e).splitlines()[0][:120]})") \
                from None
        return buf

    def mapped_rows(self, ds):
        """Three functions of a row index: ds[index] as a read-only view of the mapped file (dumps.chunks
        ChunkReader.view), announcing a row that will be needed, and releasing a row's pages from the
        process (they stay in the page cache); None when rows must be read (read_row_into)."""
        plan = self._chunks.mapped_plan(ds)
        if plan is None:
            return None
        chunks, name = self._chunks, ds.name

        def view(index: int) -> np.ndarray:
            try:
                return chunks.view(plan, index)
            except _DAMAGE as e:
                raise TraceError(f"{self.name}: cannot read {name} ({str(e).splitlines()[0][:160]})") from None
        return view, lambda index: chunks.will_need(plan, index), lambda index: chunks.done_with(plan, index)

    @cached_property
    def _chunks(self) -> ChunkReader:  # made on the first row read, after _check passed
        return ChunkReader(self.f, enabled=not self._built_here, why="a view built over rank files")

    def direct_reader(self) -> ChunkReader:
        """The reader of this file's uncompressed rows (dumps.chunks), made on first use."""
        return self._chunks

    def _check(self):
        if not self._built_here:  # a file we did not build ourselves: nothing outside it is followed
            check_storage(self.f, self.name)
        self._check_header(require_complete=True)
        self._check_inputs()
        self._check_final()
        self._check_layers()

    def _check_header(self, require_complete: bool):
        f, where = self.f, self.name
        fmt = f.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode("utf-8", "replace")
        if fmt != FORMAT_NAME:
            raise TraceError(f"{where}: not a prefill-diff trace (root attribute format={fmt!r}, "
                             f"expected {FORMAT_NAME!r})")
        version = f.attrs.get("format_version")
        if isinstance(version, bytes):
            version = version.decode("utf-8", "replace")
        try:
            major = int(str(version).split(".")[0])
        except ValueError:
            major = None
        if major not in READABLE_MAJOR:
            raise TraceError(f"{where}: trace format version {version!r} is not supported "
                             f"(this reader reads versions {', '.join(f'{m}.x' for m in READABLE_MAJOR)})")
        self.version = str(version)
        if require_complete and int(f.attrs.get("complete", 0)) != 1:
            raise TraceError(f"{where}: incomplete trace (the recording did not finish)")
        self.level = f.attrs.get("level")
        if isinstance(self.level, bytes):
            self.level = self.level.decode()
        if self.level not in ("full", "sampled", "stats"):
            raise TraceError(f"{where}: unknown trace level {self.level!r}")
        self.meta = _json_attr(f, "meta", where) or {}
        if not isinstance(self.meta, dict):
            raise TraceError(f"{where}: attribute 'meta' must be a JSON object")
        _check_meta(self.meta, where)
        for key in ("model", "side", "engine", "layout", "tolerance", "record", "repro", "run", "token_text"):
            if self.meta.get(key) is not None and not isinstance(self.meta[key], dict):
                raise TraceError(f"{where}: meta.{key} must be a JSON object (got {type(self.meta[key]).__name__})")
            if key in self.meta and self.meta[key] is None:
                del self.meta[key]  # a null object reads as an absent one (readers write meta.get(key, {}))
        model = self.meta["model"] = self.meta.get("model") or {}
        if model.get("args") is not None and not isinstance(model["args"], dict):
            raise TraceError(f"{where}: meta.model.args must be a JSON object (got {type(model['args']).__name__})")
        model["args"] = model.get("args") or {}

    def _element(self, group, el: sc.Element, dims: dict, name: str | None = None, layer: int | None = None,
                 required: bool = True, ds=False):
        """``group``'s instance of a schema element (``ds`` when the caller looked it up already), checked
        against it (dtype kind and shape in ``dims``); None when it is absent and not ``required``. Raises
        TraceError naming the dataset."""
        rel = el.rel(name)
        if ds is False:
            ds = group.get(rel)
        path = "/" + el.at(layer, name)
        if not isinstance(ds, h5py.Dataset):
            if ds is None and not required:
                return None
            raise TraceError(f"{self.name}: missing required dataset {path}")
        why = el.problem(ds, dims)
        if why:
            raise TraceError(f"{self.name}: {path} {why}")
        return ds

    def _model_dims(self) -> dict:
        """The named dimensions the metadata fixes (schema module docstring); unknown ones are left out."""
        a = self.args
        dims = {"S": self.n_samples, "C": self.n_cols, "stat": len(STAT_COLUMNS), "dim": a.get("dim"),
                "vocab": a.get("vocab_size"), "H": a.get("n_kv_heads"), "D": a.get("head_dim"),
                "A": a.get("n_active_experts") or None, "E": a.get("n_experts") or None}
        return {k: v for k, v in dims.items() if v is not None}

    def _check_inputs(self):
        f, where = self.f, self.name
        for el in (sc.TOKEN_IDS, sc.LENGTHS, *sc.INPUTS.values()):
            if not isinstance(f.get(el.path), h5py.Dataset):
                raise TraceError(f"{where}: missing required dataset /{el.path}")
        mask = f[sc.INPUTS["valid_mask"].path]
        if mask.ndim != 2:
            raise TraceError(f"{where}: /{mask.name.lstrip('/')} must be 2-D [samples, columns]")
        self.n_samples, self.n_cols = S, C = mask.shape
        if S * C * 8 > ROW_LIMIT or f[sc.TOKEN_IDS.path].size * 8 > ROW_LIMIT:
            raise TraceError(f"{where}: declared inputs of {S} x {C} cells are larger than a reader allocates")
        dims = {"S": S, "C": C}
        for el in (sc.TOKEN_IDS, sc.LENGTHS, *sc.INPUTS.values()):
            self._element(f, el, dims)
        self.lengths = self.read(f[sc.LENGTHS.path]).astype(np.int64)
        if (self.lengths < 1).any() or (self.lengths > f[sc.TOKEN_IDS.path].shape[1]).any():
            raise TraceError(f"{where}: /{sc.LENGTHS.path} out of range")
        try:
            check_meta_against_file(self.meta, S, self.lengths)
        except MetaError as e:
            raise TraceError(_meta_message(where, e)) from None
        if self.level == "sampled":
            toks = self.read(self._element(f, sc.SAMPLED_TOKENS, dims))
            if ((toks < -1) | (toks >= self.lengths[:, None])).any():
                raise TraceError(f"{where}: /{sc.SAMPLED_TOKENS.path} holds token indices outside [-1, length)")
            self.sampled_slots = toks.shape[1]

    def _check_final(self):
        dims = self._model_dims()
        for key, el in sc.FINAL.items():
            self._element(self.f, el, dims, required=bool(el.levels))
        written = self.f.get(sc.FINAL["written"].path)
        if written is not None:
            missing = np.flatnonzero(self.read(written) == 0)
            if missing.size:  # never compare a sample's unwritten (zero) final output
                raise TraceError(f"{self.name}: sample(s) {missing[:8].tolist()} have no final output "
                                 f"(/{sc.FINAL['written'].path} is 0)")

    def _check_layers(self):
        f, where = self.f, self.name
        layers = f.get("layers")
        names = sorted(layers.keys()) if isinstance(layers, h5py.Group) else []
        self.n_layers = len(names)
        declared = self.meta.get("model", {}).get("args", {}).get("n_layers")
        if declared is not None and (not isinstance(declared, int) or isinstance(declared, bool) or
                                     not 0 < declared <= max(self.n_layers, 1000)):
            raise TraceError(f"{where}: metadata declares n_layers={str(declared)[:40]}, the file holds "
                             f"{len(names)} layer groups")
        expected = [f"{i:03d}" for i in range(max(self.n_layers, declared or 0))]
        if names != expected:
            missing = sorted(set(expected) - set(names))
            shown = ", ".join(missing[:8]) + (f", … ({len(missing)} in all)" if len(missing) > 8 else "")
            raise TraceError(f"{where}: layer groups are incomplete (missing {shown or 'none'}; "
                             f"found {len(names)}, model has {declared})")
        for i in range(self.n_layers):
            self._check_layer(i)

    def _state_widths(self, names) -> dict:
        """State or statistics name -> its width by the metadata (None where the metadata does not say)."""
        a = self.args
        heads = a["n_heads"] * a["head_dim"] if a.get("n_heads") and a.get("head_dim") else None
        kv = a["n_kv_heads"] * a["head_dim"] if a.get("n_kv_heads") and a.get("head_dim") else None
        widths = {"dim": a.get("dim"), "heads": heads, "kv": kv}
        return {n: widths[TENSOR[n].width] for n in names}

    def _check_layer(self, i: int):
        """Every dataset of layer ``i`` against the schema, at the trace's level; sizes against ROW_LIMIT before
        anything is allocated."""
        g, where = self.f[layer_group(i)], self.name
        dims = self._model_dims()
        present = [n for n in REQUIRED_STATES if n not in (self.meta.get("absent_states") or {})]  # metacheck'd
        for name, want in self._state_widths(STATES).items():
            ds = g.get(sc.STATE.rel(name))
            if isinstance(ds, h5py.Dataset) and ds.ndim == 3 and self.n_cols * ds.shape[2] * ds.dtype.itemsize > \
                    ROW_LIMIT:
                raise TraceError(f"{where}: layer {i} {name} declares rows of {self.n_cols * ds.shape[2]} values, "
                                 "larger than a reader allocates")
            required = self.level == "full" and name in present
            self._element(g, sc.STATE, {**dims, **({"W": want} if want else {})}, name, i, required, ds=ds)
        for name in sc.STAT_TENSORS:  # the five states MUST exist (contract: docs/trace-format.md) unless the meta
            self._element(g, sc.STATS, dims, name, i, required=name in present)  # says the model has none
            self._element(g, sc.CHECKSUM, dims, name, i, required=name in present)
        pos = self._element(g, sc.CACHE_POSITIONS, dims, layer=i)
        self._element(g, sc.CACHE_LENGTHS, dims, layer=i)
        if isinstance(g.get("sampled"), h5py.Group):
            self._check_sampled(i, g)
        for name in CACHE_TENSORS:
            ds = g.get(sc.CACHE.rel(name))
            if isinstance(ds, h5py.Dataset) and ds.ndim == 4 and int(np.prod(ds.shape[1:])) * ds.dtype.itemsize > \
                    ROW_LIMIT:
                raise TraceError(f"{where}: layer {i} cache {name} declares rows larger than a reader allocates")
            self._element(g, sc.CACHE, {**dims, "T": pos.shape[1]}, name, i, required=self.level == "full", ds=ds)
        if sc.ROUTING_GROUP in g:
            self._check_routing(i, g, dims)

    def _check_routing(self, i: int, g: h5py.Group, dims: dict):
        """A MoE layer's routing (format 1.2): only where the metadata declares experts, ids, weights and margin
        together, ids in [0, n_experts) where written, logits at the full level."""
        where = f"{self.name}: layer {i} routing"
        E, A = dims.get("E"), dims.get("A")
        if E is None or A is None:
            raise TraceError(f"{where}: the metadata declares no experts (model.args.n_experts, n_active_experts)")
        if i in (self.args.get("dense_layers") or ()):
            raise TraceError(f"{where}: layer {i} is dense (model.args.dense_layers) but holds routing")
        if not A <= E:
            raise TraceError(f"{where}: the metadata declares {A} experts per token of {E}")
        if E * self.n_cols * 8 > ROW_LIMIT:
            raise TraceError(f"{where}: rows of {E * self.n_cols} router logits, larger than a reader allocates")
        for name, el in sc.ROUTING.items():
            self._element(g, el, dims, layer=i, required=name != "logits" or self.level == "full")
        ids_ds, margin_ds, scale_ds = (g[sc.ROUTING[n].rel()] for n in ("ids", "margin", "scale"))
        for s in range(self.n_samples):  # one sample's rows at a time
            cols, toks = self.cells(s)
            ids = self.read(ids_ds, (s,))[cols]
            if ids.size and (ids.min() < 0 or ids.max() >= E):
                c = int(cols[np.argwhere((ids < 0) | (ids >= E))[0][0]])
                raise TraceError(f"{where}: ids at the valid cells must be experts in [0, {E}) (sample {s}, column "
                                 f"{c} holds {self.read(ids_ds, (s,))[c].tolist()})")
            if A > 1 and ids.size and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
                raise TraceError(f"{where}: a cell of sample {s} names one expert twice")
            margin, scale = self.read(margin_ds, (s,))[cols], self.read(scale_ds, (s,))[cols]
            if not ((margin >= 0).all() and (np.isfinite(scale) & (scale >= 0)).all()):
                raise TraceError(f"{where}: margins (>= 0) and logit scales (finite, >= 0) of sample {s} are out of "
                                 "range at a valid cell")

    def _check_sampled(self, i: int, g: h5py.Group):
        """The sampled level's datasets and their ``channels``/``width`` attributes (compare indexes with them)."""
        where = self.name
        dims = {**self._model_dims(), **({"P": self.sampled_slots} if hasattr(self, "sampled_slots") else {})}
        for name, want in self._state_widths(sc.STAT_TENSORS).items():
            ds = self._element(g, sc.SAMPLED, dims, name, i, required=False)
            if ds is None:
                continue
            what = f"{where}: layer {i} sampled {name}"
            width = ds.attrs.get(sc.ATTR_WIDTH)
            if width is None or np.ndim(width) != 0 or np.asarray(width).dtype.kind not in "iu" or int(width) < 1 \
                    or (want is not None and int(width) != want):
                raise TraceError(f"{what}: attribute 'width' must be the tensor's width {want} (got "
                                 f"{visible(repr(width))[:60]})")
            ch = ds.attrs.get(sc.ATTR_CHANNELS)
            if ch is None:
                raise TraceError(f"{what}: attribute 'channels' is missing")
            ch = np.asarray(ch)
            if ch.ndim != 1 or ch.dtype.kind not in "iu" or ch.shape[0] != ds.shape[2]:
                raise TraceError(f"{what}: attribute 'channels' must be {ds.shape[2]} integer channel indices "
                                 f"(got {ch.dtype} of shape {ch.shape})")
            if ch.size and (ch[0] < 0 or ch[-1] >= int(width) or (np.diff(ch) <= 0).any()):
                raise TraceError(f"{what}: attribute 'channels' must be increasing indices in [0, {int(width)}) "
                                 f"(got {ch.tolist()[:8]}…)")

    # -- logical view ---------------------------------------------------------------------------
    @cached_property
    @_guarded
    def inputs(self) -> dict:
        return {k: self.read(self.f[el.path]) for k, el in sc.INPUTS.items()}

    @cached_property
    @_guarded
    def samples(self) -> list[tuple]:
        ids = self.read(self.f[sc.TOKEN_IDS.path])
        return [tuple(int(t) for t in ids[s, :self.lengths[s]]) for s in range(self.n_samples)]

    def cells(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        """Columns holding the sample's valid, computed tokens, and their token indices, in token order."""
        cache = self.__dict__.setdefault("_cells", {})
        if sample not in cache:
            cache[sample] = self._cells_of(sample)
        return cache[sample]

    @_guarded
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

    @_guarded
    def pad_cols(self, sample: int) -> np.ndarray:
        inp = self.inputs
        return np.flatnonzero((inp["computed"][sample] == 1) & (inp["valid_mask"][sample] == 0))

    def layer(self, i: int) -> LayerView:
        return LayerView(self, i)

    def layers(self):
        for i in range(self.n_layers):
            yield LayerView(self, i)

    @cached_property
    @_guarded
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
        self.f, self.name, self._recorder = recorder.f, name, recorder
        recorder.flush()  # the inputs, which the recorder keeps in memory until it closes
        self._check_header(require_complete=False)
        self._check_inputs()
        self.n_layers = int(self.meta.get("model", {}).get("args", {}).get("n_layers", 0))
        self._checked = set()

    def layer(self, i: int) -> LayerView:
        if i not in self._checked:
            self._recorder.flush()  # the layers' small datasets, kept in memory until then
            if layer_group(i) not in self.f:
                raise TraceError(f"{self.name}: layer {i} has not been recorded")
            self._check_layer(i)
            self._checked.add(i)
        return LayerView(self, i)

    def refresh(self) -> None:
        """Re-read what the recorder finished since: meta and the final outputs."""
        self._recorder.flush()
        self.meta = _json_attr(self.f, "meta", self.name) or {}
        _check_meta(self.meta, self.name)
        self._check_final()
        self.__dict__.pop("final", None)


def _meta_message(where: str, e: MetaError) -> str:
    if e.path.startswith("meta.tolerance"):
        return (f"{where}: the tolerance declared in this trace is invalid: {visible(e)} (the trace's "
                "meta.tolerance, written by `record --atol/--tolerance ...`; give a tolerance on the command line "
                "or fix the trace)")
    return f"{where}: damaged trace metadata: {visible(e)}"


def _check_meta(meta, where: str) -> None:
    try:
        check_meta(meta)
    except MetaError as e:
        raise TraceError(_meta_message(where, e)) from None


__all__ = ["Trace", "TraceError", "LayerView", "FORMAT_VERSION"]
