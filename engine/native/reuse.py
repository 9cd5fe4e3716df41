"""Prefix KV reuse (contract §2.9): a hash finds candidates, immutable metadata confirms them.

Entries live in per-tenant namespaces. A lookup searches the requester's namespace
(and a shared one only if the policy allows cross-tenant reuse), so another tenant's
private prefix is never compared against, and neither the answer nor its timing
depends on it. A refusal says which §2.9 condition failed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .kv_cache import PrefixKV

SHARED = "\0shared"  # a namespace no tenant name can equal

# §2.9 conditions and the metadata keys each one compares.
CONDITIONS = (
    ("1", "weights, adapter and layer config", ("weights_digest", "adapter", "layers")),
    ("2", "position numbering and RoPE parameters", ("position_numbering", "rope")),
    ("3", "mask semantics on the prefix", ("mask_semantics",)),
    ("4", "cache precision and layout", ("cache_dtype", "key_rotation", "layout_version")),
)


def prefix_hash(tokens) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


@dataclass
class Entry:
    tokens: tuple
    kv: PrefixKV
    meta: dict
    tenant: str


@dataclass
class Lookup:
    kv: PrefixKV | None
    reason: str | None = None  # why nothing usable was found
    forced: bool = False  # a mismatching candidate was used anyway (fault injection)

    @property
    def hit(self) -> bool:
        return self.kv is not None


@dataclass
class PrefixCache:
    allow_cross_tenant: bool = False
    namespaces: dict = field(default_factory=dict)
    confirmations: int = 0  # metadata comparisons made (a test watches this)

    def insert(self, tokens, kv: PrefixKV, meta: dict, tenant: str, share: bool = False) -> None:
        entry = Entry(tuple(tokens), kv, dict(meta), tenant)
        self.namespaces.setdefault(tenant, {}).setdefault(prefix_hash(tokens), []).append(entry)
        if share and self.allow_cross_tenant:
            self.namespaces.setdefault(SHARED, {}).setdefault(prefix_hash(tokens), []).append(entry)

    def _candidates(self, tenant: str, key: str):
        yield from self.namespaces.get(tenant, {}).get(key, ())
        if self.allow_cross_tenant:
            yield from (e for e in self.namespaces.get(SHARED, {}).get(key, ()) if e.tenant != tenant)

    def confirm(self, entry: Entry, tokens, meta: dict, tenant: str, segments) -> str | None:
        """None if the entry may serve this request, else the failed §2.9 condition."""
        self.confirmations += 1
        k = len(entry.tokens)
        if tuple(tokens[:k]) != entry.tokens:
            return "prefix tokens differ (hash collision)"
        for number, name, keys in CONDITIONS:
            for key in keys:
                if entry.meta.get(key) != meta.get(key):
                    return (f"§2.9 condition {number} ({name}): {key} differs "
                            f"(cached: {_brief(entry.meta.get(key))}; request: {_brief(meta.get(key))})")
        for start, end in segments or ():
            if start < k < end:
                return (f"§2.9 condition 5 (segment boundary): prefix length {k} cuts the segment "
                        f"[{start}, {end}) that cannot stand alone")
        if entry.tenant != tenant and not self.allow_cross_tenant:
            return "§2.9 condition 6 (tenant policy): cross-tenant reuse is not allowed"
        return None

    def lookup(self, tokens, k: int, meta: dict, tenant: str, segments=(), force: bool = False) -> Lookup:
        if k >= len(tokens):
            return Lookup(None, f"prompt of {len(tokens)} tokens is not longer than the prefix ({k})")
        first_refusal = None
        for entry in self._candidates(tenant, prefix_hash(tokens[:k])):
            why = self.confirm(entry, tokens, meta, tenant, segments)
            if why is None:
                return Lookup(entry.kv)
            first_refusal = first_refusal or (entry, why)
        if first_refusal is None:
            return Lookup(None, "no cached prefix in this tenant's namespace")
        entry, why = first_refusal
        if force and why.startswith("§2.9 condition") and "condition 6" not in why:
            return Lookup(entry.kv, why, forced=True)
        return Lookup(None, why)


def _brief(v) -> str:
    """A metadata value as words, never a Python repr: 'adapter other-adapter (sha256:be43b1d8…)', 'none'."""
    if v is None:
        return "none"
    if isinstance(v, dict):
        parts = []
        for k, x in v.items():
            x = str(x)
            parts.append(f"{k} {x[:19] + '…' if x.startswith('sha256:') and len(x) > 20 else _brief(x)}")
        return ", ".join(parts)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_brief(x) for x in v) + "]"
    s = str(v)
    return s if len(s) <= 60 else s[:59] + "…"
