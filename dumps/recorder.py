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

``meta``: a JSON object, every key declared in dumps/meta_fields.py (docs/trace-format.md has the table). It
requires model.args' sizes (dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size: they fix every shape and
decide whether two traces compare) and engine.dtype (it picks the default tolerance policy); model.rope_inv_freq
when layout.key_rotation is "pre". ``begin`` writes provenance unless given. An engine's own record
(meta.record.vllm, ...) is checked against the declaration it registered through ``declare_record``.

States (``state(layer, name, ...)``), per layer: layer_input R_l, attn_update (the attention output after
the output projection), mid U_l = R_l + attn_update, mlp_update, layer_output R_l+1 (all (columns, dim),
required), and attn_heads: concat(O) before the output projection, (columns, n_heads·head_dim), optional,
which lets a break name the query heads. ``cache`` (required for every layer and sample): keys after RoPE
(unless layout.key_rotation is "pre") and values, in logical order, (n_kv_heads, T, head_dim), with the
position of each slot (T,). ``final`` (required for every sample): the final-norm output at the gathered
position (dim,) and its raw logits (vocab_size,). ``op`` (with ``ops=True``): op-level states (dumps/ops.py).

``begin`` refuses a meta without a required key, and ``inputs``/``state``/``cache``/``final`` a tensor of the wrong
shape, naming what is expected (RecorderError). ``close`` refuses a trace with a sample whose ``final`` was never
called, or a layer without a required state or cache, and removes the file. The file is written under a temporary
name and renamed only when complete and closed (dumps/trace_file.py), so an interrupted run never leaves a file a
reader accepts. This module does not import torch: tensors are used through their own methods.
"""
from __future__ import annotations

import json

import h5py
import numpy as np

from . import metacheck
from . import schema as sc
from .h5write import text_attr
from .meta_fields import REQUIRED_ARGS, MetaError, value
from .layer_store import LayerStore
from .ops import OpStore
from .placement import check_interrupt
from .provenance import provenance
from .responses import ResponseRows
from .reductions import is_torch, slab_stats, slot_rows, source_dtype, to_numpy, top_ids
from .sampling import Sampled, gather, select_channels, select_tokens
from .schema import FORMAT_NAME, FORMAT_VERSION, REQUIRED_STATES, STAT_COLUMNS, STATES
from .trace_file import RecorderError, TraceFile


def _required_args(meta) -> dict:
    """metacheck.required_args, refused as the recorder refuses."""
    try:
        return metacheck.required_args(meta)
    except metacheck.MissingMeta as e:
        raise RecorderError(str(e)) from None


def _check_as_read(meta: dict, n_samples: int | None = None, lengths=None) -> None:
    """metacheck.check_as_read, refused as the recorder refuses."""
    try:
        metacheck.check_as_read(meta, n_samples, lengths)
    except MetaError as e:
        raise RecorderError(f"the trace's metadata breaks its schema, so its reader would refuse it: {e}") from None


def _shape(x) -> tuple:
    return tuple(map(int, x.shape))


def _want(what: str, x, expected: tuple) -> None:
    """x must have shape ``expected`` (None: any length)."""
    got = _shape(x)
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        shown = ", ".join("T" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "")
        raise RecorderError(f"{what} has shape {got}, expected ({shown})")


class Recorder:
    """Writes one trace. ``begin``, then ``inputs``/``state``/``cache``/``layer_done``, ``final``, ``close``."""

    def __init__(self, path, level: str = "full", *, force: bool = False, compression: str | None = None,
                 topk: int = 10, sample_tokens: int = 8, sample_channels: int = 32, sample_seed: int = 0,
                 in_memory: bool = False, ops: bool | tuple = False):
        if level not in sc.RECORD_LEVELS:
            raise RecorderError(f"level must be one of {', '.join(sc.RECORD_LEVELS)} (got {level!r})")
        level, ops = ("full", ops or True) if level == sc.OPS_LEVEL else (level, ops)
        if compression not in (None, "none", "gzip"):
            raise RecorderError(f"compression must be 'none' or 'gzip' (got {compression!r}; lzf: not h5dump's)")
        self.level, self.topk = level, topk
        self.compression = None if compression in (None, "none") else compression
        self.sample_tokens, self.sample_channels, self.sample_seed = sample_tokens, sample_channels, sample_seed
        self.file = TraceFile(path, force, in_memory)
        self.f = self.file.f
        text_attr(self.f, "format", FORMAT_NAME)
        text_attr(self.f, "format_version", FORMAT_VERSION)
        text_attr(self.f, "level", level)
        self.f.attrs["complete"] = 0
        self.store = LayerStore(self.f)  # what the layers keep in memory until flushed
        self.n_samples = None
        self._ds = {}
        self._seen: set = set()  # (layer, state name) and (layer, "cache") recorded
        self._reuse: dict = {}  # layer_output slabs of layer _reuse_layer: identity -> (root tensor, statistics)
        self._reuse_layer: int | None = None
        self._final: dict | None = None  # FINAL element name -> its array, made on the first final()
        self._final_sources: dict = {}  # norm_last, logits -> the source dtype
        self._cells: dict = {}  # sampled level: (sample, col, T) -> the rows and slots of its sampled tokens
        self._sections: dict = {}  # meta.record key -> (its engine, the check of its declaration)
        self._ops_asked, self.ops = ops, None  # True, or the layers whose op-level states to record; their OpStore

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
        """ds[sel] = x; a selection that is exactly one uncompressed chunk goes straight to the file (twice as fast).
        (A writer thread overlapping compute did not pay on a 2-core CPU: torch keeps both cores busy; see
        docs/performance.md.)"""
        arr = to_numpy(x)
        chunk = ds.chunks
        if (not self.compression and chunk is not None and arr.shape == chunk[1:] and arr.dtype == ds.dtype
                and all((s.start or 0) == 0 for s in sel[1:]) and chunk[0] == 1):
            ds.id.write_direct_chunk((sel[0],) + (0,) * (len(chunk) - 1), np.ascontiguousarray(arr))
        else:
            ds[sel] = arr

    def _kw(self, chunks):
        return {"chunks": chunks, "gzip": bool(self.compression)}

    def begin(self, samples, n_cols: int, meta: dict) -> None:
        """Declare the samples (full logical token ids) and the width of the stored rectangle."""
        S = len(samples)
        if S == 0 or n_cols < 1:
            raise RecorderError(f"a trace needs at least one sample and one column (got {S}, {n_cols})")
        self.args = {k: int(v) for k, v in _required_args(meta).items() if k in REQUIRED_ARGS}
        if any(len(s) == 0 for s in samples):
            raise RecorderError("every sample needs at least one token (got an empty sample)")
        self.n_samples, self.n_cols = S, n_cols
        a = self.args
        self._widths = {"dim": a["dim"], "heads": a["n_heads"] * a["head_dim"],  # schema LayerTensor.width
                        "kv": a["n_kv_heads"] * a["head_dim"]}
        self.lengths = np.array([len(s) for s in samples], dtype=np.int64)
        nmax = int(self.lengths.max())
        ids = np.full((S, nmax), -1, dtype=np.int64)
        for i, s in enumerate(samples):
            ids[i, :len(s)] = s
        self.dims = {"S": S, "C": n_cols, "N": nmax, "dim": self.args["dim"], "vocab": self.args["vocab_size"],
                     "H": self.args["n_kv_heads"], "D": self.args["head_dim"], "stat": len(STAT_COLUMNS)}
        self.store.dims = self.dims
        margs = meta["model"]["args"]
        if margs.get("n_experts"):  # a mixture of experts: its routing's sizes (metacheck'd below)
            self.dims.update(A=int(margs.get("n_active_experts") or 0), E=int(margs["n_experts"]))
        sc.TOKEN_IDS.create(self.f, self.dims, data=ids)
        sc.LENGTHS.create(self.f, self.dims, data=self.lengths)
        self._inputs = {name: np.full(el.shape_for(self.dims), el.fill, dtype=el.dtype)  # written by flush
                        for name, el in {**sc.INPUTS, **sc.ROWS}.items()}
        said = (meta.get("record") or {}).get("response") or {}
        self._response = ResponseRows(S, said.get("samples") or (), self.args["vocab_size"])
        if self._response.R:
            self.dims["R"] = self._response.R
        self._roots_dirty = True  # inputs or final outputs changed since the last flush
        self.valid = np.zeros((S, n_cols), dtype=bool)
        self.tok = np.full((S, n_cols), -1, dtype=np.int64)
        self.meta = {**meta, "provenance": meta.get("provenance") or provenance()}
        self._check_meta()
        self._write_meta()
        self._sampled_toks = [select_tokens(int(n), self.sample_tokens) for n in self.lengths]
        self._slot_of_tok = []  # per sample: token index -> sampled slot, -1 if not sampled
        for n, toks in zip(self.lengths, self._sampled_toks):
            m = np.full(int(n), -1, dtype=np.int64)
            m[toks] = np.arange(len(toks))
            self._slot_of_tok.append(m)
        self._ds = {}
        if self._ops_asked is not False:
            self.ops = OpStore(self.store.group, self.dims, self._widths, self.args["n_layers"], bool(self.compression),
                               None if self._ops_asked is True else self._ops_asked)
        if self.file.tmp is not None:
            self.file.check_space(self.size_estimate())
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
        item = 8 if value(self.meta, "meta.engine.dtype") == "float64" else 4
        width = max(d, self.args["n_heads"] * self.args["head_dim"])
        if self.level == "full":
            per_layer = len(STATES) * S * C * width + 2 * S * self.dims["H"] * N * self.dims["D"] + \
                S * C * self.dims.get("E", 0)
        else:  # statistics and checksums; sampled rows of a few tokens and channels
            per_layer = (len(STATES) + 2) * S * (self.sample_tokens * self.sample_channels + 64)
        return int(1.1 * item * (self.args["n_layers"] * per_layer + 2 * S * self.dims["vocab"] + 8 * S * C)) + (1 << 20)

    def _write_meta(self):
        text_attr(self.f, "meta", json.dumps(self.meta, sort_keys=True, default=str))

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
        inp["phase"][sl], inp["step"][sl], inp["cache_len"][sl] = 0, -1, -1  # until steps() says otherwise
        self.valid[sl], self.tok[sl] = v, to_numpy(token_index)
        self._cells = {}
        self._roots_dirty = True

    def steps(self, sample: int, col: int, phase, step, cache_len) -> None:
        """What the forward of each of a sample's cells from column ``col`` was: its phase (schema PHASES' index),
        decode step (-1 outside decode) and the cache length it read; three (T,) arrays, after ``inputs``."""
        self._need_begin()
        self._where(sample, col, phase, "steps")
        T = _shape(phase)[0]
        sl = np.s_[sample, col:col + T]
        for name, x in (("phase", phase), ("step", step), ("cache_len", cache_len)):
            _want(f"steps(sample {sample}) {name}", x, (T,))
            self._inputs[name][sl] = to_numpy(x)
        self._roots_dirty = True

    def response_logits(self, sample: int, token_index, logits) -> None:
        """The raw logits at a sample's tokens ``token_index`` (R,) whose next tokens are its response's: (R, vocab)."""
        self._need_begin()
        if not 0 <= int(sample) < self.n_samples:
            raise RecorderError(f"response_logits: sample {sample} out of range (begin declared {self.n_samples} "
                                "samples)")
        self._response.add(int(sample), to_numpy(token_index), to_numpy(logits), source_dtype(logits))
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

    def state(self, layer: int, name: str, sample: int, col: int, x) -> None:
        """One sample's cells [col, col + T) of a residual-stream state: (T, dim), attn_heads (T, n_heads·head_dim)."""
        self._need_begin()
        if name not in STATES:
            raise RecorderError(f"state name must be one of {', '.join(STATES)} (got {name!r})")
        width = self._widths[sc.TENSOR[name].width]
        shape = _shape(x)
        if not (0 <= layer < self.args["n_layers"] and 0 <= sample < self.n_samples and len(shape) == 2
                and shape[1] == width and 0 <= col and col + shape[0] <= self.n_cols):  # the checks, with messages
            self._layer(layer, f"state {name}")
            self._where(sample, col, x, f"layer {layer} {name}")
            _want(f"layer {layer} {name} of sample {sample}", x, (None, width))
        self._seen.add((layer, name))
        T = shape[0]
        v = self.valid[sample, col:col + T]
        st = self.store.stat(layer, name)
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

    def op(self, layer: int, name: str, sample: int, col: int, x) -> None:
        """An op-level state (schema OP_TENSORS): one sample's cells [col, col + T), (T, width); nothing unless the
        trace records ops (dumps/ops.py)."""
        if self.ops is not None:
            self.ops.add(layer, name, sample, col, x)

    def _slab(self, layer: int, name: str, x) -> tuple:
        """slab_stats(x), except that layer l's layer_output statistics serve layer l+1's layer_input when the
        engine hands both the very same torch tensor (one state in six): the same root tensor object,
        offset, shape and strides, and its version counter unchanged (an in-place change in between bumps it;
        only writes that bypass it, through ``.data`` or a numpy alias, would go unseen)."""
        if name not in sc.CARRIED or not is_torch(x):
            return slab_stats(x)
        root = x if x._base is None else x._base
        key = (id(root), x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version)
        if name == sc.CARRIED[1]:
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
        buf.values[sample, slots] = gather(x, rows, buf.channels, heads)

    def _state_ds(self, layer, name, x):
        key = (layer, name)
        if key not in self._ds:
            dims = {**self.dims, "W": x.shape[1]}
            ds = h5py.Dataset(sc.STATE.create(self.store.group(layer), dims, name, to_numpy(x[:0]).dtype,
                                              **self._kw((1, self.n_cols, x.shape[1]))))
            text_attr(ds, sc.ATTR_SOURCE_DTYPE, source_dtype(x))
            self._ds[key] = ds
        return self._ds[key]

    def _sampled_buffer(self, layer, name, x, width: int) -> Sampled:
        sampled = self.store.buffers(layer).sampled
        if name not in sampled:
            width = int(width)
            ch = select_channels(width, self.sample_channels, self.sample_seed)
            shape = sc.SAMPLED.shape_for({**self.dims, "K": len(ch)})
            sampled[name] = Sampled(np.full(shape, np.nan, dtype=to_numpy(x[:0]).dtype), ch, width, source_dtype(x))
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
        buf = self.store.buffers(layer)
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
        lc = self.store.buffers(layer)
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
            self.store.stat(layer, f"cache_{name}").add(sample, slab_stats(slot_rows(t, T, H, D)))
            if self.level == "full":
                if name not in lc.tensors:
                    tmax = max(int(self.lengths.max()), T)
                    ds = h5py.Dataset(sc.CACHE.create(self.store.group(layer), {**self.dims, "T": tmax}, name, to_numpy(t[:0]).dtype,
                                         maxshape=(self.n_samples, H, None, D), **self._kw((1, H, tmax, D))))
                    text_attr(ds, sc.ATTR_SOURCE_DTYPE, source_dtype(t))
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
        check_interrupt()
        self.store.dirty.add(layer)

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

    def written(self) -> h5py.File:
        """The file as recorded so far, everything kept in memory written to it first (``flush``): what a reader
        of a trace still being recorded reads (dumps/reader.py: LiveTrace)."""
        self.flush()
        return self.f

    def flush(self) -> None:
        """Write what the recorder keeps in memory until ``close`` (the layers' small datasets, the inputs, the
        final outputs so far): a reader of the file while it is recorded (``run --fail-fast`` compares in-memory
        traces layer by layer) calls it first. Each dataset is made with its data on the first call and written
        whole in place later; a layer still being recorded is written as far as it goes and rewritten later."""
        if self.n_samples is None:
            return
        self.store.write_dirty()
        if not self._roots_dirty:  # a live reader flushes per layer; the inputs are written once
            return
        for name, el in {**sc.INPUTS, **sc.ROWS}.items():
            self.store.root_dataset(el, self._inputs[name])
        for name, data, src in self._response.datasets():
            self.store.root_dataset(sc.RESPONSE[name], data, src)
        for key, el in sc.FINAL.items() if self._final is not None else ():
            self.store.root_dataset(el, self._final[key], self._final_sources.get(key))
        self._roots_dirty = False

    def final_top_ids(self) -> list[int]:
        """Every sample's top-k ids as recorded so far (what a caller needs for token text after the run);
        empty before the first ``final``."""
        return [] if self._final is None else self._final["topk_ids"].ravel().tolist()

    def declare_record(self, key: str, declared, engine: str) -> None:
        """The engine's own record, ``meta.record.<key>``, as that engine declares it (its rows: dumps/meta_fields.py
        ``section_fields``; the job hands over what engine/registry.py registers): checked strictly, like the rest of
        the metadata, when ``begin`` and ``close`` check it, and refused naming the field."""
        self._sections[key] = (engine, metacheck.section_check(key, declared, engine))

    def _check_meta(self, n_samples: int | None = None, lengths=None) -> None:
        _check_as_read(self.meta, n_samples, lengths)
        for key, (engine, check) in self._sections.items():
            try:
                metacheck.check_section(self.meta, key, check)
            except MetaError as e:
                raise RecorderError(f"the {engine} engine's record breaks the declaration it registered "
                                    f"(engine/registry.py record_section): {e}") from None

    def update_meta(self, **items) -> None:
        """Add or replace top-level keys of the trace's meta (written now, and again on close)."""
        self.meta.update(items)
        self._write_meta()

    def close(self) -> None:
        """Finish the file and move it into place (or, in memory, just mark it complete)."""
        if self.file.closed:
            return
        self._reuse = {}
        try:
            self._need_begin()
            if self.ops is not None:
                self.meta["record"] = {**(self.meta.get("record") or {}), "ops": self.ops.declared()}
            self._check_complete()
            self._check_meta(self.n_samples, self.lengths)
        except RecorderError:
            self.abort()  # nothing is left that looks like a trace
            raise
        self.flush()
        self._write_meta()
        self.f.attrs["complete"] = 1
        self.file.finish()

    def _check_complete(self) -> None:
        """Every sample has its final output; every layer its required states and its cache."""
        written = self._final["written"] if self._final is not None else np.zeros(self.n_samples)
        missing = [int(s) for s in np.flatnonzero(written == 0)]
        if missing:
            raise RecorderError(f"final() was never called for sample(s) {missing[:8]}"
                                f"{' …' if len(missing) > 8 else ''}: every sample needs its final output "
                                "(the trace was not written)")
        self._response.check_complete()
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
        self.file.abort()
