"""The attention bias of contract §2.2 and three kernels that must agree on it.

Visibility is defined on logical coordinates, so one rule serves padded, packed,
chunked and prefix-reuse layouts alike: query cell i of sequence s sees key j when

    both are valid tokens, they belong to the same sequence, and tok(j) <= tok(i)

where tok is the token's index in its sequence. This is M[b,i,j] = 0 iff
G[b,i] = G[b,j] = 1 and j <= i, written without physical column numbers. A sliding-window layer
(window W) adds tok(j) > tok(i) - W: the query sees its W most recent tokens, itself included.

Invalid (padding) query rows never enter a softmax that matters; since the
kernels materialise them, each gets one sentinel key so no row is all -inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..shared.errors import MaskError


@dataclass
class AttentionMask:
    q_tok: torch.Tensor  # (B, Sq) token index of each query cell; -1 = padding
    k_tok: torch.Tensor  # (B, Sk) token index of each key; -1 = not a visible key
    q_seq: torch.Tensor  # (B, Sq) sequence of each query cell
    k_seq: torch.Tensor  # (B, Sk) sequence of each key
    sentinel: bool = True  # padding query rows see key 0, so no row is all -inf
    causal: bool = False  # set when the mask is exactly lower-triangular on every row (no padding, one sequence)
    window: int | None = None  # sliding window W: key token > query token - W
    _visible: torch.Tensor | None = field(default=None, repr=False)
    _bias: dict = field(default_factory=dict, repr=False)

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Visibility (B, q1-q0, k1-k0) of one tile, sentinel included."""
        qt, kt = self.q_tok[:, q0:q1, None], self.k_tok[:, None, k0:k1]
        vis = (qt >= 0) & (kt >= 0) & (kt <= qt) & (self.q_seq[:, q0:q1, None] == self.k_seq[:, None, k0:k1])
        if self.window is not None:
            vis &= kt > qt - self.window
        if self.sentinel and k0 == 0:
            vis[:, :, 0] |= self.q_tok[:, q0:q1] < 0
        return vis

    def windowed(self, window: int | None) -> "AttentionMask":
        """The same visibility limited to a sliding window of ``window`` tokens (None: this mask)."""
        if window is None:
            return self
        return AttentionMask(self.q_tok, self.k_tok, self.q_seq, self.k_seq, self.sentinel, window=window)

    @property
    def visible(self) -> torch.Tensor:
        """(B, Sq, Sk) boolean; built once, checked when built."""
        if self._visible is None:
            self._visible = self.tile(0, self.q_tok.shape[1], 0, self.k_tok.shape[1])
            self.check_rows(self._visible.any(-1))
        return self._visible

    def check_rows(self, any_visible: torch.Tensor, q0: int = 0) -> None:
        """Refuse a valid query row (B, rows) starting at column q0 that sees no key."""
        empty = (self.q_tok[:, q0:q0 + any_visible.shape[1]] >= 0) & ~any_visible
        if bool(empty.any()):
            b, i = (int(t) for t in empty.nonzero()[0])
            i += q0
            raise MaskError("2.2", "a valid query row must see at least one key "
                            f"(row {b}, column {i}, token {int(self.q_tok[b, i])} has none)")

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive M: 0 where visible, -inf elsewhere; (B, 1, Sq, Sk)."""
        if dtype not in self._bias:
            m = torch.zeros(self.visible.shape, dtype=dtype, device=self.q_tok.device)
            self._bias[dtype] = m.masked_fill_(~self.visible, float("-inf"))[:, None]
        return self._bias[dtype]


def standard_head_map(n_heads: int, n_kv_heads: int) -> list[int]:
    """g(h) = ⌊h·H_kv/H_q⌋ for every query head h."""
    return [h * n_kv_heads // n_heads for h in range(n_heads)]


# Kernels read KV head g(h) = ⌊h·H_kv/H_q⌋ for query head h, i.e. query heads are grouped in runs
# of n_rep = H_q/H_kv. A different head map is applied around the kernel (prefill.ForwardStep).

def eager_attention(q, k, v, mask: AttentionMask, shapes=None, scale: float | None = None,
                    softcap: float | None = None):
    """softmax(Q̃K̃ᵀ·scale + M)·V with S and A materialised (scale: 1/√d_h unless the model sets another;
    softcap: the scores become cap·tanh(scores/cap) before the mask, as Gemma 2 has)."""
    B, H, S, D = q.shape
    n_kv = k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.view(B, n_kv, H // n_kv, S, D)  # (B, n_kv_heads, n_rep, S, head_dim)
    scores = qg @ k[:, :, None].transpose(-1, -2)  # (B, n_kv_heads, n_rep, S, Sk)
    scores = scores.view(B, H, S, -1).mul_(D ** -0.5 if scale is None else scale)  # (B, n_heads, S, Sk), in place
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.add_(mask.bias(scores.dtype))
    if shapes is not None:
        shapes("scores", tuple(scores.shape))
    probs = torch.softmax(scores, dim=-1, dtype=compute).to(q.dtype)  # stable: subtracts the row max
    out = probs.view(B, n_kv, H // n_kv, S, -1) @ v[:, :, None]  # (B, n_kv_heads, n_rep, S, head_dim)
    return out.view(B, H, S, D)


def sdpa_attention(q, k, v, mask: AttentionMask, shapes=None, scale: float | None = None):
    """torch's scaled_dot_product_attention with the same boolean visibility (is_causal when that is all it is)."""
    if mask.causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible[:, None], enable_gqa=True, scale=scale)


def tiled_attention(q, k, v, mask: AttentionMask, shapes=None, block_size: int = 16, scale: float | None = None,
                    softcap: float | None = None):
    """FlashAttention's online softmax in torch: S is only ever one (block × block) tile."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    n_rep = H // k.shape[1]
    kq, vq = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, n_heads, Sk, head_dim)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    for q0 in range(0, S, block_size):
        q1 = min(q0 + block_size, S)
        qb = q[:, :, q0:q1].to(compute)
        m = torch.full((B, H, q1 - q0, 1), float("-inf"), dtype=compute, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((B, H, q1 - q0, D), dtype=compute, device=q.device)
        seen = torch.zeros((B, q1 - q0), dtype=torch.bool, device=q.device)
        for k0 in range(0, Sk, block_size):
            k1 = min(k0 + block_size, Sk)
            vis = mask.tile(q0, q1, k0, k1)  # (B, bq, bk)
            if not bool(vis.any()):
                continue
            seen |= vis.any(-1)
            s = (qb @ kq[:, :, k0:k1].to(compute).transpose(-1, -2)) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~vis[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ vq[:, :, k0:k1].to(compute)
            m = m_new
        mask.check_rows(seen, q0)
        out[:, :, q0:q1] = (acc / l).to(q.dtype)
    return out


def get_kernel(name: str, block_size: int = 16, scale: float | None = None, softcap: float | None = None):
    """The kernel ``name`` as f(q, k, v, mask, shapes=None), with the model's score scale and soft-cap bound
    (sdpa has no soft-cap: the engine refuses that pair)."""
    if name == "eager":
        return lambda q, k, v, mask, shapes=None: eager_attention(q, k, v, mask, shapes, scale=scale, softcap=softcap)
    if name == "sdpa":
        return lambda q, k, v, mask, shapes=None: sdpa_attention(q, k, v, mask, shapes, scale=scale)
    if name == "tiled":
        return lambda q, k, v, mask, shapes=None: tiled_attention(q, k, v, mask, shapes, block_size=block_size,
                                                                  scale=scale, softcap=softcap)
    raise ValueError(name)
