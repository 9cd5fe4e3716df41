"""Where snapshots come from: the built-in synthetic models, Hugging Face directories, GGUF files.

``load_snapshot`` resolves a ModelSpec to a Snapshot and keeps the last one loaded, so the sides of
a comparison that name the same model share its weights.
"""
from __future__ import annotations

import os

from . import budget, cache_entries, model_cache
from .adapter import seeded_adapter
from .args import MODEL_PRESETS
from ..shared.errors import ConfigError, ModelLoadError, UnsupportedModel
from .gguf_loader import load_gguf, smollm2_path
from .hub import describe_hf_dir, load_hf_dir
from .snapshot import Snapshot
from .spec import ModelSpec
from .tokenizer import Tokenizer
from .synthetic import synthetic_state

_CACHE: dict[ModelSpec, Snapshot] = {}


def load_snapshot(spec: ModelSpec) -> Snapshot:
    """Resolve a model spec to a snapshot; loaded once per process."""
    if spec not in _CACHE:
        _CACHE.clear()  # keep one model's weights in memory, not every model ever asked for
        _CACHE[spec] = _load(spec)
    return _CACHE[spec]


def _load(spec: ModelSpec) -> Snapshot:
    snap = load_source(spec)
    if spec.first_layers is not None:
        snap = snap.truncated(spec.first_layers)
    if spec.adapter:
        a = dict(spec.adapter)
        unknown = sorted(set(a) - {"id", "rank", "seed", "scale"})
        if unknown:
            raise ConfigError(f"unknown adapter keys {unknown} (known: id, rank, seed, scale)")
        if int(a.get("rank", 4)) < 1:
            raise ConfigError(f"adapter rank must be a positive integer (got rank={a.get('rank')})")
        snap = snap.with_adapter(seeded_adapter(snap.args, str(a.get("id", "lora")), int(a.get("rank", 4)),
                                                int(a.get("seed", 1)), float(a.get("scale", 1.0))))
    return snap


def load_source(spec: ModelSpec) -> Snapshot:
    """A snapshot of the spec's source, loaded now (without the adapter and the per-process cache)."""
    src = spec.source
    if src in MODEL_PRESETS:
        args = MODEL_PRESETS[src].replace(**dict(spec.overrides)) if spec.overrides else MODEL_PRESETS[src]
        budget.check_model(args, src)  # before a single weight is allocated
        return Snapshot(src, args, synthetic_state(args, spec.seed))
    if not (src.startswith(("hf:", "gguf:")) or src == "smollm2"):
        raise ConfigError(f"model source must be one of {', '.join(MODEL_PRESETS)}, hf:<dir>, gguf:<file>, "
                          f"smollm2 (got {src!r})")
    if spec.overrides:
        raise ConfigError(f"model size overrides apply to synthetic models only (source {src!r})")
    if src.startswith("hf:"):
        try:
            return load_hf_dir(src[3:])
        except UnsupportedModel as e:  # the transformers engine may still run it; any other engine refuses
            try:
                return describe_hf_dir(src[3:], str(e))
            except ModelLoadError as why:  # transformers cannot run it either: say both
                raise ModelLoadError(f"{why}; and our engine does not implement it: {e}") from None
    path = smollm2_path() if src == "smollm2" else src[5:]
    if not os.path.isfile(path):  # the loader's own message, before the cache hashes the file
        return load_gguf(path, src)
    return model_cache.cached(path, "native", lambda: load_gguf(path, src), cache_entries.save_snapshot,
                              lambda entry: cache_entries.load_snapshot(entry, src, Tokenizer))
