"""prefill(): the contract of contract §2.1-§2.7, following the pseudo-code of §2.6.

    assert_input_contract(...)            -> contract.py
    attention_bias = build_attention_bias -> attention.AttentionMask
    residual = embedding_lookup(...)
    for each layer: norm, qkv, RoPE, cache.write_sequence, causal_attention, MLP
    h_last = gather_last_valid_position(final, valid_mask)
    next_logits = unembedding(h_last)
    assert_cache_invariants(cache, ...)

``Engine.steps`` is the same computation as a generator that yields each layer's
index once that layer (states and cache) is complete, so a caller can compare two
runs in lockstep and stop at the first break.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import contract
from .attention import AttentionMask, get_kernel, standard_head_map
from .kv_cache import KVCache, check_invariants
from .compiled import compile_layers
from ..calls import Faults
from ..coords import CacheWrite, Cell, SeqRun
from ..shared.errors import CacheInvariantError, ConfigError
from .faults import (PaddingKV, decode_positions, gathered_cell, padding_visible_mask, rewire_heads, skipped_kv_keep,
                     stale_keys)
from .model import apply_rope, rope_cos_sin
from .settings import CacheConfig, NumericalConfig  # plain data (no torch)
from ..models.cache_layout import CacheLayout
from ..decode import decoding_columns, forward_facts, forward_starts
from .sharding import kv_for_attention, shard
from .skeleton import build
from ..models.dtypes import torch_dtype
from ..models.rope import longrope_switch, rope_attention_factor, rope_inv_freq
from ..models.snapshot import Snapshot


@dataclass
class PrefillResult:
    next_logits: torch.Tensor  # (n_seqs, V)
    kv_cache: KVCache
    valid_lengths: torch.Tensor  # (n_seqs,)
    cache_metadata: dict
    final_norm: torch.Tensor  # (n_seqs, d): h_b at each sequence's last valid position
    gather_cells: list = field(default_factory=list)  # the Cell each h_b was read from


class CheckedCall(NamedTuple):
    """A prefill call's inputs after the §2.1 checks: ids, validity, sequence of each cell, positions."""
    ids: torch.Tensor
    valid: torch.Tensor
    seq: torch.Tensor
    positions: torch.Tensor


class Cells:
    """Which sequence and token each cell of the input rectangle holds (contract §2.2's G, made explicit)."""

    def __init__(self, valid: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor, offsets: dict[int, int]):
        self.valid, self.seq = valid, torch.where(valid, seq, -1)
        self.positions = torch.where(valid, positions, torch.zeros_like(positions))
        B, n = valid.shape
        self.tok = torch.full_like(self.seq, -1)
        self.runs: list[SeqRun] = []
        self.row_seqs = [[] for _ in range(B)]
        self.last: dict[int, Cell] = {}  # seq -> its last valid token
        self.lengths = {}  # seq -> tokens in the cache after this call
        for b in range(B):
            for s in self.seq[b][valid[b]].unique().tolist():
                cols = (self.seq[b] == s).nonzero().flatten()
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                off = offsets.get(s, 0)
                self.tok[b, c0:c1] = torch.arange(off, off + c1 - c0)
                self.runs.append(SeqRun(row=b, seq=s, c0=c0, c1=c1))
                self.row_seqs[b].append(s)
                self.last[s] = Cell(row=b, col=c1 - 1)
                self.lengths[s] = off + c1 - c0
        self.n_seqs = len(self.last)

    def expected_positions(self, history_positions: dict) -> list[torch.Tensor]:
        out = []
        for s in range(self.n_seqs):
            mine = [self.positions[r.row, r.c0:r.c1] for r in self.runs if r.seq == s]
            out.append(torch.cat([history_positions.get(s, torch.zeros(0, dtype=torch.long))] + mine))
        return out

    def writes(self, c0: int, c1: int) -> list[CacheWrite]:
        """Each sequence's cells within chunk columns [c0, c1), in chunk coordinates."""
        return [CacheWrite(row=r.row, seq=r.seq, a=max(r.c0, c0) - c0, e=min(r.c1, c1) - c0,
                           tok0=max(r.c0, c0) - r.c0 + self.tok[r.row, r.c0].item())
                for r in self.runs if r.c0 < c1 and r.c1 > c0]


class ForwardStep:
    """Plumbing for one forward over columns [c0, c1): what the model's attention and blocks call.

    The model calls ``rope``, ``attend`` (write K̃ and V to the cache, read what attention sees, run
    the kernel) and ``record``; faults (faults.py), tensor parallelism (sharding.py) and shape probes
    (ledger) are applied here, around the kernel, never inside the model.
    """

    def __init__(self, engine: "Engine", cells: Cells, c0: int, c1: int, cache: KVCache, read_through: bool,
                 faults: Faults, recorder, shapes, routing: dict | None = None, decoding=None, padding=None):
        self.engine, self.cache, self.read_through, self.faults = engine, cache, read_through, faults
        self.routing = routing or {}
        self.recorder, self.shapes, self.c0 = recorder, shapes, c0
        self.decoding = decoding  # (B, c1 - c0): the cells that are decode steps (None: no sequence decodes)
        self.padding = padding  # decode-mask: the prompt's padding K/V its decode steps are shown (PaddingKV)
        inv = engine.call_inv_freq(cells.positions)
        self.positions = decode_positions(cells.positions[:, c0:c1], decoding, faults)
        self.rope = rope_cos_sin(self.positions, inv, engine.dtype, engine.rope_scale)
        self.rope_local = None if engine.inv_freq_local is None else rope_cos_sin(
            self.positions, engine.inv_freq_local, engine.dtype)
        self.row_seqs = cells.row_seqs
        self.writes = cells.writes(c0, c1)
        self.q_tok, self.q_seq = cells.tok[:, c0:c1], cells.seq[:, c0:c1]
        self.mask = chunk_mask(cells, c0, c1, faults)
        self._windowed = {None: self.mask}
        self.head_map = list(faults.head_map) if faults.head_map else engine.head_map

    def rope_of(self, layer: int):
        """The cos/sin tables layer ``layer`` rotates with."""
        return self.rope_local if self.engine.args.local_rope(layer) else self.rope

    def attend(self, layer: int, q_rot, k_rot, v, k_pre):
        """O for every query head: (B, n_heads, S, head_dim)."""
        self._write(layer, k_rot, v, k_pre)
        keys, values, mask = self._visible(layer, k_rot, v)
        if self.engine.tp is not None:  # tensor parallel: this rank's KV heads (engine/native/sharding.py)
            keys, values = kv_for_attention(self.engine.tp, layer, keys, values)
        return self._kernel(layer, q_rot, keys, values, mask)

    def _write(self, layer: int, k_rot, v, k_pre) -> None:
        """cache.write_sequence for each sequence's valid cells (fault row 2 drops one of them)."""
        for w in self.writes:
            if w.a >= w.e:
                continue
            k, vv, kp, pos = k_rot[w.row, :, w.a:w.e], v[w.row, :, w.a:w.e], k_pre[w.row, :, w.a:w.e], \
                self.positions[w.row, w.a:w.e]
            keep = skipped_kv_keep(self.faults.skip_kv, layer, w)
            if keep is not None:
                k, vv, kp, pos = k[:, keep], vv[:, keep], kp[:, keep], pos[keep]
            self.cache.write(layer, w.seq, k, vv, kp, pos)

    def _visible(self, layer: int, k_rot, v):
        """Keys, values and mask attention reads: the cache (read through) or this forward's own, limited to
        the layer's sliding window where it has one."""
        window = self.engine.args.window(layer)
        if window is not None:
            window += self.faults.window_shift
        if not self.read_through:
            if window not in self._windowed:
                self._windowed[window] = self.mask.windowed(window)
            return k_rot, v, self._windowed[window]
        rows = self.cache.read_rows(layer, self.row_seqs, like=k_rot)
        if self.padding is not None:
            if self.decoding is None or not bool(self.decoding.any()):
                self.padding.keep(layer, self.q_tok, k_rot, v)
            rows = self.padding.shown(layer, rows, self.q_seq, self.decoding)
        k_tok = stale_keys(rows.k_tok, rows.k_seq, self.q_tok, self.q_seq, self.decoding, self.faults)
        return rows.keys, rows.values, AttentionMask(self.q_tok, k_tok, self.q_seq, rows.k_seq,
                                                     self.mask.sentinel, window=window)

    def _kernel(self, layer: int, q_rot, keys, values, mask):
        if self.shapes is not None:
            self.shapes(layer, "q", tuple(q_rot.shape))
            self.shapes(layer, "k", tuple(keys.shape))
            self.shapes(layer, "v", tuple(values.shape))
        shapes = None if self.shapes is None else (lambda name, shape: self.shapes(layer, name, shape))
        out = self.engine.kernel(q_rot, keys, values, mask, shapes)
        rewire_heads(out, self.engine.kernel, q_rot, keys, values, mask, self.head_map, self.engine.head_map)
        if self.shapes is not None:
            self.shapes(layer, "attn_out", tuple(out.shape))
        return out

    def record(self, layer: int, name: str, x: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.state(layer, name, x, self.c0)

    def op_of(self, layer: int):
        """``op(name, x)`` recording layer ``layer``'s op-level states (schema OP_TENSORS), or None when they are not
        recorded."""
        ops = getattr(getattr(self.recorder, "recorder", None), "ops", None)
        if ops is None or not ops.wants(layer):
            return None
        return lambda name, x, heads_first=False: self.recorder.op(
            layer, name, x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1) if heads_first else x, self.c0)

    def op(self, layer: int, name: str, x: torch.Tensor, heads_first: bool = False) -> None:
        """An op-level state, (B, S, width), or with ``heads_first`` (B, heads, S, head_dim)."""
        record = self.op_of(layer)
        if record is not None:
            record(name, x, heads_first)

    def record_routing(self, layer: int, ids, weights, margin, scale, logits) -> None:
        """A mixture of experts' routing over this forward's cells, (B, S, ...) each."""
        if self.recorder is not None:
            self.recorder.routing(layer, ids, weights, margin, scale, logits, self.c0)

    def forced_routing(self, layer: int) -> torch.Tensor | None:
        """(B, S, k) experts to take at this forward's cells (-1: the router's own choice), or None: routing replay
        forces the reference's choices at the cells where the candidate's flipped."""
        forced = self.routing.get(layer)
        if not forced:
            return None
        out = torch.full((*self.q_tok.shape, self.engine.args.n_active_experts), -1, dtype=torch.long)
        for (seq, tok), ids in forced.items():
            out[(self.q_seq == seq) & (self.q_tok == tok)] = torch.as_tensor(ids, dtype=torch.long)
        return out


def chunk_mask(cells: Cells, c0: int, c1: int, faults: Faults) -> AttentionMask:
    """The attention mask of chunk columns [c0, c1) against themselves."""
    q_tok, q_seq = cells.tok[:, c0:c1], cells.seq[:, c0:c1]
    sentinel = not faults.masked_row_softmax
    if faults.unmasked_padding:
        return padding_visible_mask(q_tok, q_seq, cells.row_seqs, c0, c1, sentinel)
    mask = AttentionMask(q_tok, q_tok, q_seq, q_seq, sentinel)
    S = c1 - c0
    mask.causal = bool((q_tok == torch.arange(S)).all()) and all(len(r) == 1 for r in cells.row_seqs)
    return mask


class Engine:
    """A snapshot built in one numerical configuration, ready to prefill many requests."""

    def __init__(self, snapshot: Snapshot, numerical: NumericalConfig = NumericalConfig(), tp=None):
        self.snapshot, self.numerical, self.args = snapshot, numerical, snapshot.args
        self.model, self.quantized_digest = build(snapshot, numerical.dtype, numerical.weight_quant, numerical.training)
        self.tp = tp  # a parallel.TPContext: this process is one rank of a tensor-parallel group
        if tp is not None:
            shard(tp, self.model)
            self.args = tp.local_args(self.args)  # this rank's heads and MLP rows
        if numerical.compile:
            compile_layers(self.model)
        self.dtype = torch_dtype(numerical.dtype)
        freq_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.inv_freq = rope_inv_freq(self.args, freq_dtype)
        self.inv_freq_local = None if self.args.rope_local_theta is None else rope_inv_freq(self.args, freq_dtype,
                                                                                            local=True)
        self.longrope_switch = longrope_switch(self.args)
        self.inv_freq_long = None if self.longrope_switch is None else rope_inv_freq(self.args, freq_dtype, long=True)
        self.rope_scale = rope_attention_factor(self.args)
        if self.args.attn_softcap is not None and numerical.kernel == "sdpa":
            raise ConfigError(f"kernel sdpa cannot soft-cap attention scores (the model has attn_softcap="
                              f"{self.args.attn_softcap}): use kernel eager or tiled")
        self.kernel = get_kernel(numerical.kernel, numerical.block_size, scale=self.args.attn_scale,
                                 softcap=self.args.attn_softcap)
        self.head_map = standard_head_map(self.args.n_heads, self.args.n_kv_heads)
        self.rng = None
        if numerical.training and numerical.dropout_seed is not None:
            self.rng = numerical.dropout_seed
        # §2.1(4) and (5) depend on the model alone: checked once, here
        contract.check_vocab(self.model, self.args.tokenizer_vocab_size)
        contract.check_inference_mode(self.model, numerical.dropout_seed)

    def call_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """The global layers' inverse frequencies for one call at ``positions``: LongRoPE's long factors when the
        call's longest position + 1 exceeds the original length, as transformers decides per forward."""
        if self.inv_freq_long is not None and int(positions.max()) + 1 > self.longrope_switch:
            return self.inv_freq_long
        return self.inv_freq

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, layer: int, inv: torch.Tensor) -> torch.Tensor:
        """RoPE on layer ``layer``'s cached pre-rotation keys (H, T, d) at their stored positions (``inv``: the
        call's global frequencies)."""
        if self.args.local_rope(layer):
            cos, sin = rope_cos_sin(positions[None], self.inv_freq_local, keys.dtype)
            return apply_rope(keys[None], cos, sin)[0]
        cos, sin = rope_cos_sin(positions[None], inv, keys.dtype, self.rope_scale)
        return apply_rope(keys[None], cos, sin)[0]

    def identity(self, layout: CacheLayout) -> dict:
        """What a cache built by this engine must carry (invariant 5; §2.9 conditions 1, 2 and 4)."""
        return {**self.snapshot.identity(), "rope": self.args.rope_dict(), "precision": self.numerical.dtype,
                "cache_dtype": layout.dtype, "key_rotation": layout.key_rotation, "layout_version": layout.version}

    def prefill(self, *args, **kw) -> PrefillResult:
        gen = self.steps(*args, **kw)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    def steps(self, input_ids, attention_mask, positions, cache_config: CacheConfig = CacheConfig(), *,
              segments=None, history: dict | None = None, recorder=None, faults: Faults = Faults(), shapes=None,
              routing: dict | None = None, decode_from: dict | None = None, logits_from: dict | None = None):
        """Generator form of prefill: yields each layer index once that layer is complete. ``routing``: experts to
        force, {layer: {(sequence, token index): expert ids}} (routing replay). ``decode_from``: {sequence: token
        index} from which that sequence's tokens are decoded, one forward per column (decode.py);
        ``logits_from``: {sequence: token index} from which on the logits at each of its tokens are recorded too
        (those predicting a response's tokens)."""
        call = self._check(input_ids, attention_mask, positions, segments)
        if self.rng is not None:
            torch.manual_seed(self.rng)
        history = history or {}
        layout = cache_config.layout.resolved(self.numerical.dtype)
        cells = Cells(call.valid, call.seq, call.positions, {s: h.length for s, h in history.items()})
        identity = self.identity(layout)
        cache = self._seeded_cache(cells, layout, identity, history)
        if recorder is not None:
            recorder.inputs(call.ids, call.valid, cells.positions, cells.tok, cells.seq)
        n = call.ids.shape[1]
        chunk = min(cache_config.chunk_size or n, n)  # a chunk longer than the prompt is the whole prompt
        decode_from = decode_from or {}
        starts = forward_starts(cells.tok, cells.seq, n, chunk, decode_from)
        read_through = not layout.plain or bool(history) or len(starts) > 1
        if recorder is not None and len(starts) > 1:  # what each cell's forward was (one forward: the default)
            recorder.steps(*forward_facts(cells.tok, cells.seq, starts, decode_from))
        ids = torch.where(call.valid, call.ids, torch.zeros_like(call.ids))
        with torch.no_grad():
            x_last = yield from self._layers(ids, cells, cache, starts, read_through, recorder, faults, shapes,
                                             routing or {}, decode_from)
            result = self._finish(cells, x_last, cache, faults, recorder, identity, history, logits_from or {})
        violations = result.cache_metadata["invariant_violations"]
        if violations and cache_config.invariants == "raise":
            raise CacheInvariantError("cache invariant broken after prefill: " + "; ".join(violations))
        return result

    def _check(self, input_ids, attention_mask, positions, segments) -> CheckedCall:
        """§2.1 (1)-(3) on this call's rectangle."""
        input_ids = torch.as_tensor(input_ids)
        valid = contract.check_mask(input_ids, torch.as_tensor(attention_mask))
        B, n = valid.shape
        seq = torch.arange(B)[:, None].expand(B, n) if segments is None else torch.as_tensor(segments)
        contract.check_contiguous(valid, seq)
        positions = torch.as_tensor(positions)
        contract.check_positions(positions, valid, seq, self.args.max_position)
        contract.check_ids(input_ids, valid, self.args.vocab_size)
        return CheckedCall(ids=input_ids, valid=valid, seq=seq, positions=positions)

    def _seeded_cache(self, cells: Cells, layout: CacheLayout, identity: dict, history: dict) -> KVCache:
        """An empty cache for this call's sequences, holding any reused prefix KV (contract §2.9) as stored."""
        inv = self.call_inv_freq(cells.positions)
        cache = KVCache(self.args.n_layers, cells.n_seqs, layout, self.dtype,
                        rotate=lambda keys, positions, layer: self.rotate(keys, positions, layer, inv))
        cache.metadata.update(identity)
        for s, prefix in history.items():
            for layer, (k, v, pos) in enumerate(prefix.layers):
                cache.write(layer, s, k, v, k, pos)
        return cache

    def _layers(self, ids, cells: Cells, cache: KVCache, starts: list, read_through: bool, recorder, faults, shapes,
                routing: dict, decode_from: dict):
        """The model over the prompt, whole or forward by forward (chunks, decode steps: ``starts``); yields ℓ once
        layer ℓ (states and cache) is complete, returns the last layer's output R_L, (B, n, dim)."""
        B, n = ids.shape
        whole = len(starts) == 1
        x_last = None
        padding = PaddingKV() if faults.decode_mask and decode_from else None
        for c0, c1 in zip(starts, starts[1:] + [n]):
            decoding = decoding_columns(cells.tok, cells.seq, c0, c1, decode_from) if decode_from else None
            step = ForwardStep(self, cells, c0, c1, cache, read_through, faults, recorder, shapes, routing, decoding,
                               padding)
            for layer, x in self.model.layer_by_layer(ids[:, c0:c1], step):
                if whole:
                    self._emit_cache(recorder, cache, layer)
                    yield layer
            if whole:
                x_last = x
            else:
                x_last = x.new_zeros((B, n, self.args.dim)) if x_last is None else x_last
                x_last[:, c0:c1] = x
        if not whole:  # chunked: a layer's cache is complete only after the last chunk
            for layer in range(self.args.n_layers):
                self._emit_cache(recorder, cache, layer)
                yield layer
        return x_last

    @staticmethod
    def _emit_cache(recorder, cache: KVCache, layer: int) -> None:
        if recorder is None:
            return
        for s in range(cache.n_seqs):
            got = cache.stored(layer, s)
            if got is not None:
                recorder.cache(layer, s, *got)

    def _finish(self, cells: Cells, x_last, cache: KVCache, faults: Faults, recorder, identity, history,
                logits_from: dict):
        n = x_last.shape[1]
        if recorder is not None:
            self._response_logits(cells, x_last, recorder, logits_from)
        gather = [gathered_cell(cells.last[s], n, faults) for s in range(cells.n_seqs)]
        rows = torch.tensor([g.row for g in gather])
        cols = torch.tensor([g.col for g in gather])
        h = self.model.norm(x_last[rows, cols])  # (n_seqs, dim)
        logits = self.model.unembed(h)  # (n_seqs, vocab)
        hist_pos = {s: prefix.layers[0][2] for s, prefix in history.items()}
        violations = check_invariants(cache, self.args.n_kv_heads, self.args.head_dim,  # identity recomputed now
                                      cells.expected_positions(hist_pos), self.identity(cache.layout))
        for s, prefix in history.items():
            ident = prefix.identity
            diff = sorted(k for k in identity if ident.get(k) != identity[k])
            if diff:
                violations.append(f"invariant 5 (identity recorded and matching): reused prefix of sequence {s} "
                                  f"was built with other {', '.join(diff)}")
        lengths = torch.tensor([cells.lengths[s] for s in range(cells.n_seqs)])
        meta = {**cache.metadata, "invariant_violations": violations, "valid_lengths": lengths.tolist()}
        if recorder is not None:
            for s in range(cells.n_seqs):
                b, c = gather[s]
                recorder.final(s, h[s], logits[s], gather[s], int(cells.tok[b, c]))
        return PrefillResult(logits, cache, lengths, meta, h, gather)


    def _response_logits(self, cells: Cells, x_last, recorder, logits_from: dict) -> None:
        """The logits at each of a sequence's tokens from ``logits_from[seq]`` on, but its last (whose logits are
        the first-step logits ``final`` records): those predicting its response's tokens."""
        for r in cells.runs:
            if r.seq not in logits_from:
                continue
            toks = cells.tok[r.row, r.c0:r.c1]
            cols = ((toks >= logits_from[r.seq]) & (toks < cells.lengths[r.seq] - 1)).nonzero().flatten() + r.c0
            if cols.numel():
                h = self.model.norm(x_last[r.row, cols])  # (R, dim)
                recorder.response_logits(r.seq, cells.tok[r.row, cols], self.model.unembed(h))


def prefill(input_ids, attention_mask, position_descriptor, model_snapshot: Snapshot,
            numerical_config: NumericalConfig = NumericalConfig(), cache_config: CacheConfig = CacheConfig(),
            **kw) -> PrefillResult:
    """The interface of contract §2.1: one call, one snapshot, one configuration."""
    return Engine(model_snapshot, numerical_config).prefill(
        input_ids, attention_mask, position_descriptor, cache_config, **kw)
