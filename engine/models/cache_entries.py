"""What an entry of the converted-model cache (engine/models/model_cache.py) holds: written once, read back every run.

Two kinds, kept apart on purpose: the native engine's snapshot (our float32 master weights under our names, and
the tokenizer transformers built from the GGUF metadata) and transformers' own model (what its GGUF loader
built). This module's source is part of every entry's version (``model_cache.versions``): changing how an entry
is written makes the entries written before stale.
"""
from __future__ import annotations

import json
import os
from typing import Callable

from .args import ModelArgs
from .model_cache import Entry


# -- the native engine's snapshot: float32 weights under our names, the GGUF's tokenizer

WEIGHTS = "weights.safetensors"


def save_snapshot(snap, directory: str) -> dict:
    """Write a snapshot's weights and tokenizer; returns what ``load_snapshot`` needs besides them."""
    from safetensors.torch import save_file  # deferred: safetensors imports torch
    state = dict(snap.state)
    tied = snap.args.tie_embeddings and state.get("output.weight") is state.get("tok_embeddings.weight")
    if tied:
        del state["output.weight"]  # one tensor in the file; load_snapshot ties it again
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, WEIGHTS))
    if snap.tokenizer is not None:
        snap.tokenizer.tok.save_pretrained(directory)
    return {"args": snap.args.as_dict(), "weights_digest": snap.weights_digest, "tied_output": tied,
            "tokenizer": snap.tokenizer is not None}


def load_snapshot(entry: Entry, source: str, wrap_tokenizer: Callable):
    """The snapshot ``save_snapshot`` wrote, named ``source`` (the trace's model identity is unchanged)."""
    from safetensors.torch import load_file  # deferred: torch

    from .snapshot import Snapshot  # deferred: torch
    meta = entry.meta
    state = load_file(os.path.join(entry.dir, WEIGHTS))
    if meta["tied_output"]:
        state["output.weight"] = state["tok_embeddings.weight"]
    args = ModelArgs.from_dict(meta["args"])
    tokenizer = None
    if meta["tokenizer"]:
        from transformers import AutoTokenizer  # deferred: seconds to import
        tokenizer = wrap_tokenizer(AutoTokenizer.from_pretrained(entry.dir, local_files_only=True))
    return Snapshot(source, args, state, tokenizer=tokenizer, _digest=meta["weights_digest"])


# -- the transformers engine's model: what transformers' own GGUF loader built

def save_hf_model(model, directory: str) -> dict | None:
    """transformers' model as a checkpoint directory (config.json, model.safetensors), for a float32 model only:
    one loaded in a lower precision would lose bits a later float32 run needs (that run converts and stores).

    ``save_pretrained`` refuses a GGUF-loaded model (its quantizer is "not serializable"), so the files are
    written here: the config without its quantization_config (the weights are already dequantised), every
    tensor of the state dict once (tensors sharing storage are tied: transformers ties them again on load)."""
    import torch  # deferred: this module stays light for the CLI's option parsing
    from safetensors.torch import save_file
    if model.dtype != torch.float32:
        return None
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("quantization_config", None)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return {"dtype": "float32"}
