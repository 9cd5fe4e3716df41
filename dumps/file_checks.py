"""A trace file from a stranger, checked before anything is read from it: nothing outside the file is
followed (external links, external storage, virtual datasets), no filter the format does not use is run,
and the header, metadata, inputs, final outputs and every layer are held to the schema (dumps/schema.py,
dumps/metacheck.py). A problem is a TraceError naming the file and the dataset.

``CheckedTrace`` holds the checks as the Trace runs them on open (and LiveTrace layer by layer, as a trace
being recorded grows).
"""
from __future__ import annotations

import functools
import json

import h5py
import numpy as np

from ..engine.shared.errors import PrefillDiffError
from ..engine.shared.untrusted import visible
from . import schema as sc
from .meta_fields import MetaError, value
from .metacheck import check_meta, check_meta_against_file
from .schema import (CACHE_TENSORS, FORMAT_NAME, META_LIMIT, READABLE_MAJOR, REQUIRED_STATES, TENSOR, STAT_COLUMNS,
                     STATES, layer_group)

class TraceError(PrefillDiffError):
    """A file is not a readable trace: missing, not HDF5, foreign, unknown version, incomplete or corrupt."""


ROW_LIMIT = 1 << 30  # bytes of one stored sample row a reader will allocate

DAMAGE = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError, AttributeError,
           UnicodeDecodeError, MemoryError)


def guarded(fn):
    """Turn whatever HDF5 raises on a damaged file into one TraceError naming the file."""
    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        try:
            return fn(self, *a, **kw)
        except TraceError:
            raise
        except DAMAGE as e:
            name = getattr(self, "name", None) or getattr(getattr(self, "trace", None), "name", "trace")
            first = str(e).splitlines()[0][:160] if str(e) else ""
            raise TraceError(f"{name}: damaged trace ({type(e).__name__}: {first})") from None
    return wrapper


def json_attr(f, key: str, where: str):
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


def _meta_message(where: str, e: MetaError) -> str:
    if e.path.startswith("meta.tolerance"):
        return (f"{where}: the tolerance declared in this trace is invalid: {visible(e)} (the trace's "
                "meta.tolerance, written by `record --atol/--tolerance ...`; give a tolerance on the command line "
                "or fix the trace)")
    return f"{where}: damaged trace metadata: {visible(e)}"


def check_trace_meta(meta, where: str) -> None:
    try:
        check_meta(meta)
    except MetaError as e:
        raise TraceError(_meta_message(where, e)) from None


class CheckedTrace:
    """The checks a Trace runs on open (``_check``), over ``self.f`` and ``self.name``: they set what the
    header declares (``version``, ``level``, ``meta``) and what the inputs fix (samples, columns)."""

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
        self.meta = json_attr(f, "meta", where) or {}
        if not isinstance(self.meta, dict):
            raise TraceError(f"{where}: attribute 'meta' must be a JSON object")
        check_trace_meta(self.meta, where)
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
        declared = value(self.meta, "meta.model.args.n_layers")
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
