"""Content digests of tensors: what identifies weights, adapters and quantised weights."""
from __future__ import annotations

import hashlib

import torch


def digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order; shared tensors count once."""
    h = hashlib.sha256()
    seen = set()
    for name in sorted(tensors):
        t = tensors[name]
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return "sha256:" + h.hexdigest()
