"""The KV cache contract of contract §2.5 and its invariants (contract §2.2 box).

Logically, ``LayerCache[l]`` holds per sequence the keys and values attention used,
their positions and the valid length, in the order of positions. Physically the
store is free: contiguous chunks, fixed-size pages in a shared pool behind a block
table, int8 with scales, or keys kept before RoPE and rotated on read (recorded in
the layout). Every read goes through ``read`` (what attention sees) or ``stored``
(what the cache holds, as the layout says), never through physical slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# storage dtypes of a KV cache (FP8_TORCH, torch_dtype); fp8 as vLLM stores it: the value divided by the layer's
# scale (1.0 unless calibrated), cast to the fp8 format, read back times the scale
from ..models.dtypes import FP8_TORCH, torch_dtype
from ..models.cache_layout import CacheLayout  # plain data (no torch)


@dataclass
class PrefixKV:
    """A reused prefix of one sequence: per layer (keys as stored, values, positions), and its identity."""
    layers: list
    identity: dict

    @property
    def length(self) -> int:
        return int(self.layers[0][2].shape[0])  # layers: Stored, or (keys, values, positions) tuples


class _Codec:
    """Storage encoding: a float cast (fp8 included, at scale 1.0 as vLLM's uncalibrated fp8 cache), or int8 with
    per-token or per-head scales."""

    def __init__(self, layout: CacheLayout, act_dtype: torch.dtype):
        self.int8 = layout.dtype == "int8"
        self.per_head = layout.int8_scales == "per-head"
        self.store_dtype = torch_dtype(layout.dtype)
        self.act_dtype = act_dtype

    def encode(self, x: torch.Tensor):
        """(H, T, d) -> (data, scale (H, T) or None)."""
        if not self.int8:
            return (x.to(torch.float32) if self.store_dtype in FP8_TORCH.values() else x).to(self.store_dtype), None
        xf = x.float()
        amax = xf.abs().amax(dim=(1, 2) if self.per_head else 2)  # (H,) or (H, T)
        scale = (amax.clamp_min(1e-12) / 127.0)
        scale = scale[:, None].expand(x.shape[0], x.shape[1]) if self.per_head else scale  # (H, T)
        q = torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, scale.contiguous()

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            fp8 = data.dtype in FP8_TORCH.values()
            return data.to(torch.float32).to(self.act_dtype) if fp8 else data.to(self.act_dtype)
        return (data.float() * scale[..., None]).to(self.act_dtype)


class Chunk(NamedTuple):
    """One write as a store holds it: encoded keys and values (with their scales, if any) and positions."""
    keys: torch.Tensor
    key_scales: torch.Tensor | None
    values: torch.Tensor
    value_scales: torch.Tensor | None
    positions: torch.Tensor


class Stored(NamedTuple):
    """A sequence's cache entries of one layer, dequantised: keys, values (H_kv, T, d_h) and positions (T,)."""
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


class RowsKV(NamedTuple):
    """What attention reads per row: keys, values (B, H_kv, Sk, d_h), k_tok and k_seq (B, Sk); -1 is padding."""
    keys: torch.Tensor
    values: torch.Tensor
    k_tok: torch.Tensor
    k_seq: torch.Tensor


class _ContiguousStore:
    """Per (layer, sequence) a list of written chunks; a chunk may be a view of the step's K/V."""

    def __init__(self):
        self.chunks: dict[tuple[int, int], list[Chunk]] = {}

    def append(self, layer, seq, kd, ks, vd, vs, pos):
        self.chunks.setdefault((layer, seq), []).append(Chunk(kd, ks, vd, vs, pos))

    def length(self, layer, seq) -> int:
        return sum(int(c.positions.shape[0]) for c in self.chunks.get((layer, seq), ()))

    def gather(self, layer, seq):
        chunks = self.chunks.get((layer, seq), [])
        if len(chunks) == 1:
            return chunks[0]
        if not chunks:
            return None
        cat = lambda i, dim: None if chunks[0][i] is None else torch.cat([c[i] for c in chunks], dim)
        return Chunk(cat(0, 1), cat(1, 1), cat(2, 1), cat(3, 1), cat(4, 0))

    def shapes(self, layer, seq):
        return [(tuple(c.keys.shape), tuple(c.values.shape)) for c in self.chunks.get((layer, seq), ())]


class _PagedStore:
    """Fixed-size pages in one pool per layer; a block table per sequence maps logical slots to pages.

    Pages are handed out in a seeded random order, so a sequence's pages are deliberately
    not contiguous and not in slot order.
    """

    def __init__(self, page_size: int, n_layers: int, seed: int = 0):
        self.page = page_size
        self.n_layers = n_layers
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[tuple[int, int], int] = {}
        self.pools: list[dict | None] = [None] * n_layers
        self.capacity = 0
        self.free: list[int] = []
        self.gen = torch.Generator().manual_seed(seed)

    def _grow(self, need: int):
        new_cap = max(8, self.capacity * 2, self.capacity + need)
        fresh = torch.randperm(new_cap - self.capacity, generator=self.gen) + self.capacity
        self.free.extend(int(p) for p in fresh)
        for pool in self.pools:
            if pool is None:
                continue
            for name, t in pool.items():
                grown = t.new_zeros((new_cap,) + tuple(t.shape[1:]))
                grown[: t.shape[0]] = t
                pool[name] = grown
        self.capacity = new_cap

    def _pool(self, layer, kd, ks, vd, vs):
        if self.pools[layer] is None:
            H, _, D = kd.shape
            mk = lambda t, shape: None if t is None else t.new_zeros((self.capacity, H, self.page) + shape)
            self.pools[layer] = {k: v for k, v in {
                "k": mk(kd, (D,)), "v": mk(vd, (D,)), "ks": mk(ks, ()), "vs": mk(vs, ()),
                "pos": torch.zeros((self.capacity, self.page), dtype=torch.int64, device=kd.device)}.items()
                if v is not None}
        return self.pools[layer]

    def _slots(self, seq, start, stop):
        table = self.tables.setdefault(seq, [])
        need = -(-stop // self.page) - len(table)
        if need > len(self.free):
            self._grow(need - len(self.free))
        for _ in range(max(need, 0)):
            table.append(self.free.pop())
        slots = torch.arange(start, stop)
        return torch.tensor(table)[slots // self.page], slots % self.page

    def append(self, layer, seq, kd, ks, vd, vs, pos):
        start = self.lengths.get((layer, seq), 0)
        T = int(pos.shape[0])
        if self.capacity == 0:
            self._grow(1)
        pages, offs = self._slots(seq, start, start + T)
        pool = self._pool(layer, kd, ks, vd, vs)
        pool["k"][pages, :, offs] = kd.transpose(0, 1)  # (T, H, d) into (pages, H, page, d)
        pool["v"][pages, :, offs] = vd.transpose(0, 1)
        if ks is not None:
            pool["ks"][pages, :, offs] = ks.transpose(0, 1)
            pool["vs"][pages, :, offs] = vs.transpose(0, 1)
        pool["pos"][pages, offs] = pos
        self.lengths[(layer, seq)] = start + T

    def length(self, layer, seq) -> int:
        return self.lengths.get((layer, seq), 0)

    def gather(self, layer, seq):
        T = self.length(layer, seq)
        if T == 0:
            return None
        pages, offs = self._slots(seq, 0, T)
        pool = self.pools[layer]
        get = lambda name: pool[name][pages, :, offs].transpose(0, 1) if name in pool else None  # (H, T, ...)
        return Chunk(get("k"), get("ks"), get("v"), get("vs"), pool["pos"][pages, offs])

    def shapes(self, layer, seq):
        g = self.gather(layer, seq)
        return [] if g is None else [(tuple(g.keys.shape), tuple(g.values.shape))]


class KVCache:
    """Per layer and sequence: keys, values, positions, valid length; plus layout metadata."""

    def __init__(self, n_layers: int, n_seqs: int, layout: CacheLayout, act_dtype: torch.dtype,
                 rotate=None, seed: int = 0):
        if layout.dtype is None:
            raise ValueError("layout dtype must be resolved")
        self.n_layers, self.n_seqs, self.layout = n_layers, n_seqs, layout
        self.codec = _Codec(layout, act_dtype)
        self.store = _PagedStore(layout.page_size, n_layers, seed) if layout.kind == "paged" else _ContiguousStore()
        self.rotate = rotate  # (keys (H, T, d), positions (T,)) -> rotated keys; needed for key_rotation="pre"
        self.metadata: dict = {"layout": layout.as_dict()}
        self.reads: list = []  # (layer, seq, positions) of every read by attention, for invariant 3

    def write(self, layer: int, seq: int, k_rot, v, k_pre, positions) -> None:
        """Append one sequence's new tokens (H_kv, T, d_h) in logical order."""
        keys = k_pre if self.layout.key_rotation == "pre" else k_rot
        kd, ks = self.codec.encode(keys)
        vd, vs = self.codec.encode(v)
        self.store.append(layer, seq, kd, ks, vd, vs, positions)

    def length(self, layer: int, seq: int) -> int:
        return self.store.length(layer, seq)

    def stored(self, layer: int, seq: int):
        """Keys (pre-rotation if the layout says so) and values, dequantised, and positions."""
        g = self.store.gather(layer, seq)
        if g is None:
            return None
        return Stored(self.codec.decode(g.keys, g.key_scales), self.codec.decode(g.values, g.value_scales),
                      g.positions)

    def read(self, layer: int, seq: int):
        """What attention reads: keys after RoPE, values, positions."""
        got = self.stored(layer, seq)
        if got is None:
            return None
        k, v, pos = got
        self.reads.append((layer, seq, pos.clone()))
        if self.layout.key_rotation == "pre":
            k = self.rotate(k, pos, layer)
        return Stored(k, v, pos)

    def read_rows(self, layer: int, row_seqs: list[list[int]], like: torch.Tensor):
        """Keys/values for each row's sequences, concatenated and right-padded.

        """
        reads = [[(s, self.read(layer, s)) for s in seqs] for seqs in row_seqs]
        Sk = max(1, max(sum(0 if r is None else r.positions.shape[0] for _, r in row) for row in reads))
        B, H, D = len(row_seqs), like.shape[1], like.shape[3]
        keys = like.new_zeros((B, H, Sk, D))
        values = like.new_zeros((B, H, Sk, D))
        k_tok = torch.full((B, Sk), -1, dtype=torch.long, device=like.device)
        k_seq = torch.full((B, Sk), -1, dtype=torch.long, device=like.device)
        for b, row in enumerate(reads):
            at = 0
            for s, r in row:
                if r is None:
                    continue
                k, v, _ = r
                T = k.shape[1]
                keys[b, :, at:at + T], values[b, :, at:at + T] = k, v
                k_tok[b, at:at + T] = torch.arange(T, device=like.device)
                k_seq[b, at:at + T] = s
                at += T
        return RowsKV(keys, values, k_tok, k_seq)

    def positions(self, layer: int, seq: int) -> torch.Tensor:
        g = self.store.gather(layer, seq)
        return torch.zeros(0, dtype=torch.long) if g is None else g.positions


def check_invariants(cache: KVCache, n_kv_heads: int, head_dim: int,
                     expected_positions: list[torch.Tensor], identity: dict) -> list[str]:
    """The five cache invariants of contract §2.2; returns violations as sentences (empty = all hold)."""
    out = []
    L, n = cache.n_layers, cache.n_seqs
    for s in range(n):
        lengths = [cache.length(layer, s) for layer in range(L)]
        if len(set(lengths)) > 1:
            out.append(f"invariant 1 (equal lengths across layers): sequence {s} has lengths {lengths} by layer")
    stored = {s for (layer, s) in _stored_keys(cache)}
    if stored - set(range(n)):
        out.append(f"invariant 2 (batch matches): the cache holds sequences {sorted(stored - set(range(n)))} "
                   f"beyond the {n} of this call")
    for layer in range(L):
        for s in range(n):
            for kshape, vshape in cache.store.shapes(layer, s):
                if kshape[0] != n_kv_heads or kshape[2] != head_dim or vshape[0] != n_kv_heads or vshape[2] != head_dim:
                    out.append(f"invariant 2 (KV heads and head dim match the model): layer {layer} sequence {s} "
                               f"has keys {kshape}, values {vshape}, model has n_kv_heads={n_kv_heads}, head_dim={head_dim}")
    moved = set()
    for layer, s, seen in cache.reads:  # every slot attention read still maps to the position it had then
        now = cache.positions(layer, s).cpu()
        if (layer, s) not in moved and (now.shape[0] < seen.shape[0] or not torch.equal(now[:seen.shape[0]],
                                                                                         seen.cpu())):
            moved.add((layer, s))
            out.append(f"invariant 3 (stable slot mapping): layer {layer} sequence {s} was read with positions "
                       f"{_short(seen.cpu())}, its slots now hold {_short(now)}")
    for s in range(n):
        want = expected_positions[s].cpu()
        for layer in range(L):
            first = cache.positions(layer, s).cpu()
            if first.shape != want.shape or not torch.equal(first, want):
                out.append(f"invariant 4 (only valid tokens as history): layer {layer} sequence {s} holds positions "
                           f"{_short(first)}, its valid tokens have {_short(want)}")
                break
    for key, value in identity.items():
        if key not in cache.metadata:
            out.append(f"invariant 5 (identity recorded and matching): the cache does not record {key}")
        elif cache.metadata.get(key) != value:
            out.append(f"invariant 5 (identity recorded and matching): cache {key}={cache.metadata.get(key)!r}, "
                       f"this call has {value!r}")
    return out


def _stored_keys(cache: KVCache):
    """(layer, seq) pairs the store holds anything for."""
    store = cache.store
    return list(store.chunks if isinstance(store, _ContiguousStore) else store.lengths)


def _short(t: torch.Tensor, k: int = 8) -> str:
    vals = t.tolist()
    return str(vals) if len(vals) <= k else f"[{', '.join(map(str, vals[:k]))}, ... ({len(vals)} in all)]"
