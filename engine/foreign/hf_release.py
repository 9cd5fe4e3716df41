"""What the installed transformers release can run, asked without importing more of it than the question needs: its
version, and the refusals that depend on it (sdpa for Gemma 2, tensor parallelism before 5.13)."""
from __future__ import annotations

import importlib.metadata
import inspect
import re


LOWEST = (5, 0)  # the oldest transformers release the engine runs: pyproject's [hf] extra, tested in CI


def release() -> str | None:
    """The installed transformers release (read from its metadata, without importing it), or None."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release_tuple(version: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2])


def _sdpa_refusal(args) -> str | None:
    """Why transformers' sdpa attention cannot run the model, or None. Its sdpa kernel has no score soft-capping,
    which Gemma 2 applies: transformers 5.21 and later refuse Gemma 2 under sdpa whatever its config
    (Gemma2PreTrainedModel._supports_sdpa is False); earlier releases run it and silently leave
    attn_logit_softcapping out."""
    if args.arch != "gemma2":
        return None
    try:
        from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel
    except ImportError:  # no transformers: build_model says which extra installs it
        return None
    eager = "attn_implementation = \"eager\" runs it (the transformers preset)"
    if not getattr(Gemma2PreTrainedModel, "_supports_sdpa", True):
        return f"transformers refuses sdpa for Gemma 2 (no soft-capping) in release {release()}; {eager}"
    if args.attn_softcap is not None:
        return (f"transformers' sdpa has no soft-capping: release {release()} would run Gemma 2 without its "
                f"attn_logit_softcapping={args.attn_softcap}; {eager}")
    return None


def _tp_refusal() -> str | None:
    """Why this transformers release cannot shard a model as the engine records it, or None. DistributedConfig
    takes tp_size from transformers 5.13 on; earlier releases shard by tp_plan="auto" and a tp_size given to
    from_pretrained, and there (5.0 measured) the attention's o_proj receives every head, not the rank's."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # no transformers: build_model says which extra installs it
        return None
    if "tp_size" in inspect.signature(DistributedConfig).parameters:
        return None
    return (f"transformers' tensor parallelism needs transformers 5.13 or later, whose DistributedConfig takes "
            f"tp_size (found transformers {release()})")
