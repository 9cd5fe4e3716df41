"""What a trace's layers keep in memory until the recorder flushes them, and the file's layer groups.

Statistics and checksums, cache positions and lengths, sampled values and routing are gathered per layer
while the engine runs and written one dataset write each (``write_layer``): creating a few hundred small
datasets and writing them piecemeal (per sample, by fancy index) was most of what the stats and sampled levels
cost. Each dataset is made on the layer's first write and written in place on a later one (a later prefill call
that reaches the same layer adds to what it kept, and the layer is rewritten whole). The root datasets the
recorder keeps in memory (inputs, final outputs) are written the same way (``root_dataset``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import h5py
import numpy as np

from . import schema as sc
from .h5write import new_attr, new_group
from .reductions import RunningStats, stat_tables
from .sampling import Sampled
from .schema import STAT_COLUMNS, layer_group


@dataclass
class LayerBuffers:
    """What a layer accumulates in memory and ``flush`` writes, one dataset write each: creating a few
    hundred small datasets and writing them piecemeal (per sample, by fancy index) was most of what the
    stats and sampled levels cost. Kept after the layer is written: a later prefill call that
    reaches the same layer adds to them and the layer is rewritten whole."""
    positions: np.ndarray | None = None  # (S, T) cache positions, -1 past a sample's length
    lengths: np.ndarray | None = None  # (S,) cache lengths
    heads: tuple = ()  # (n_kv_heads, head_dim) of the cache, for the cache group's attributes
    tensors: dict = field(default_factory=dict)  # "keys"/"values" -> dataset (full level, written in place)
    sampled: dict = field(default_factory=dict)  # tensor name -> Sampled (sampled level)
    routing: dict = field(default_factory=dict)  # ids, weights, margin (and logits at the full level) -> (S, C, ...)
    routing_source: str | None = None  # the router logits' dtype in the engine


class LayerStore:
    """The layers' in-memory part of one trace being written into ``f`` (module docstring). ``dims``: the trace's
    named dimensions, set when the recorder begins (the same dict: the recorder adds to it)."""

    def __init__(self, f: h5py.File):
        self.f = f
        self.dims: dict = {}
        self.stats: dict[int, dict[str, RunningStats]] = {}  # layer -> tensor name -> its statistics so far
        self.groups: dict[int, h5py.Group] = {}  # layer -> its group, created on first use
        self.small: dict[tuple, object] = {}  # (layer, element path, name) -> h5py DatasetID written so far
        self.layers: dict[int, LayerBuffers] = {}
        self.dirty: set = set()  # layers with something not yet written

    @property
    def n_samples(self) -> int:
        return self.dims["S"]

    def write_dirty(self) -> None:
        """Write every layer with something not yet written."""
        for layer in sorted(self.dirty):
            self.write_layer(layer)

    def group(self, layer: int) -> h5py.Group:
        g = self.groups.get(layer)
        if g is None:  # made once per layer by this recorder (the first makes the layers group too)
            g = self.groups[layer] = h5py.Group(new_group(self.f.id, layer_group(layer)))
        return g

    def buffers(self, layer: int) -> LayerBuffers:
        self.dirty.add(layer)
        if layer not in self.layers:
            self.layers[layer] = LayerBuffers()
        return self.layers[layer]

    def stat(self, layer: int, name: str) -> RunningStats:
        """The running statistics of a layer's tensor, kept for the whole run: a layer written and then reached
        again is rewritten with every sample's statistics, not only the later ones."""
        self.dirty.add(layer)
        per_layer = self.stats.setdefault(layer, {})
        if name not in per_layer:
            per_layer[name] = RunningStats(self.n_samples)
        return per_layer[name]

    def write_layer(self, layer: int) -> None:
        """Write what a layer kept in memory: made on its first write, rewritten in place on a later one."""
        g = self.group(layer)
        stats = self.stats.get(layer, {})
        if stats:
            tables = stat_tables(list(stats.values()))
            stats_id, sums_id = self._subgroup(g, layer, sc.STATS_GROUP), self._subgroup(g, layer, sc.CHECKSUMS_GROUP)
            for i, (name, st) in enumerate(stats.items()):
                self._put_small(stats_id, layer, sc.STATS, name, tables[i])
                self._put_small(sums_id, layer, sc.CHECKSUM, name, np.array(st.checksum, dtype=np.int64))
        buf = self.layers.get(layer)
        if buf is not None:
            self._write_cache_index(g, layer, buf)
            for name, smp in buf.sampled.items():
                self._write_sampled_layer(g, layer, name, smp)
            if buf.routing:
                self._write_routing(g, layer, buf)
        self.dirty.discard(layer)

    def _write_routing(self, g: h5py.Group, layer: int, buf: LayerBuffers) -> None:
        """A layer's routing datasets, made on the layer's first write, in place later."""
        gid = self._subgroup(g, layer, sc.ROUTING_GROUP)
        for name, data in buf.routing.items():
            key = (layer, sc.ROUTING[name].path)
            dsid = self.small.get(key)
            if dsid is None:
                el = sc.ROUTING[name]
                dims = {**dict(zip(el.shape, data.shape)), **self.dims}  # A and E: the engine's, as given
                self.small[key] = dsid = el.create(gid, dims, leaf=True, data=data)
                if name == "logits":
                    new_attr(dsid, sc.ATTR_SOURCE_DTYPE, buf.routing_source or str(data.dtype))
            else:
                dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))

    def _subgroup(self, g: h5py.Group, layer: int, name: str) -> h5py.h5g.GroupID:
        """The low-level id of layer group ``g``'s group ``name`` (stats, checksums, cache, sampled): made on first
        use, the stats group with its columns, or opened where the full level's cache tensors made it."""
        key = (layer, name)
        gid = self.small.get(key)
        if gid is None:
            buf = self.layers.get(layer)
            if name == sc.CACHE_GROUP and buf is not None and buf.tensors:
                gid = h5py.h5g.open(g.id, name.encode("ascii"))
            else:
                gid = new_group(g.id, name)
                if name == sc.STATS_GROUP:
                    new_attr(gid, sc.ATTR_COLUMNS, json.dumps(STAT_COLUMNS))
            self.small[key] = gid
        return gid

    def _put_small(self, gid, layer: int, el: sc.Element, name: str, data: np.ndarray) -> None:
        """A layer's contiguous statistics dataset ``el`` (stats/NAME or checksums/NAME, in its group ``gid``)
        holds ``data``: created on the layer's first write, written in place on a later one (a layer reached
        again)."""
        key = (layer, el.path, name)
        dsid = self.small.get(key)
        data = np.ascontiguousarray(data, dtype=el.dtype)
        if dsid is None:
            self.small[key] = el.create(gid, self.dims, name, leaf=True, data=data)
        else:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)

    def _write_cache_index(self, g: h5py.Group, layer: int, buf: LayerBuffers) -> None:
        """A layer's cache positions and lengths, in one write each: created on the layer's first write (with
        the cache group's attributes), in place later."""
        if buf.positions is None:
            return
        key = (layer, sc.CACHE_POSITIONS.path)
        if key not in self.small:
            cache = self._subgroup(g, layer, sc.CACHE_GROUP)
            T = buf.positions.shape[1]
            self.small[key] = sc.CACHE_POSITIONS.create(cache, {**self.dims, "T": T}, leaf=True, data=buf.positions,
                                                         chunks=(1, T), maxshape=(self.n_samples, None))
            self.small[(layer, sc.CACHE_LENGTHS.path)] = sc.CACHE_LENGTHS.create(cache, self.dims, leaf=True,
                                                                                  data=buf.lengths)
            new_attr(cache, sc.ATTR_HEAD_DIM, buf.heads[1])
            new_attr(cache, sc.ATTR_N_KV_HEADS, buf.heads[0])
            return
        pos = h5py.Dataset(self.small[key])
        if pos.shape != buf.positions.shape:
            pos.resize(buf.positions.shape)
        pos[...] = buf.positions
        self.small[(layer, sc.CACHE_LENGTHS.path)].write(h5py.h5s.ALL, h5py.h5s.ALL, buf.lengths)

    def _write_sampled_layer(self, g: h5py.Group, layer: int, name: str, smp: Sampled) -> None:
        """A layer's sampled/NAME: created with its attributes on the layer's first write, in place later."""
        key = (layer, sc.SAMPLED.path, name)
        dsid = self.small.get(key)
        if dsid is not None:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, smp.values)
            return
        dsid = sc.SAMPLED.create(self._subgroup(g, layer, sc.SAMPLED_GROUP), {**self.dims, "K": len(smp.channels)},
                                 name, leaf=True, data=smp.values)
        new_attr(dsid, sc.ATTR_CHANNELS, smp.channels)
        new_attr(dsid, sc.ATTR_WIDTH, smp.width)
        new_attr(dsid, sc.ATTR_SOURCE_DTYPE, smp.source_dtype)
        self.small[key] = dsid

    def root_dataset(self, el: sc.Element, data: np.ndarray, source_dtype: str | None = None) -> None:
        """Root element ``el`` (inputs/NAME, final/NAME: contiguous, its declared fill) holds ``data``: made on
        the first call (its group too, and its source_dtype attribute), in place later."""
        dsid = self.small.get((None, el.path))
        data = np.ascontiguousarray(data)
        if dsid is not None:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
            return
        group = el.path.rpartition("/")[0]
        gid = self.small.get((None, group))
        if gid is None:
            gid = self.small[(None, group)] = new_group(self.f.id, group)
        dsid = self.small[(None, el.path)] = el.create(gid, self.dims, leaf=True, data=data)
        if source_dtype is not None:
            new_attr(dsid, sc.ATTR_SOURCE_DTYPE, source_dtype)
