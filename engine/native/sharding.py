"""Our Transformer sharded over a tensor-parallel group (engine/parallel.py), Megatron-style:

    column-parallel (ColwiseParallel): wq, wk, wv by whole query / KV heads; w1 (gate), w3 (up) by rows
    row-parallel (RowwiseParallel):    wo, w2 — each rank's partial product, then all_reduce(SUM)

Each rank's local head map ⌊l·(H_kv/N)/(H_q/N)⌋ is the global one shifted. Embeddings, norms and the output
projection are replicated. The two tensor-parallel faults (tp-missing-allreduce, tp-kv-shard) are applied here.
"""
from __future__ import annotations

import torch

from ..parallel import TPContext


def shard(tp: TPContext, model) -> None:
    """Megatron-style sharding of our Transformer with DTensor's parallelize_module (in place)."""
    from torch.distributed.tensor import Partial  # DTensor: imported only by tensor-parallel runs
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i, block in enumerate(model.layers):
        p = f"layers.{i}"
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        unreduced = tp.fault == "tp-missing-allreduce" and i == 0
        # the fault: layer 0's output projection returns each rank's partial sum, never all-reduced
        plan[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=Partial()) if unreduced else RowwiseParallel()
        plan[f"{p}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(model, tp.mesh, plan)
    local = tp.local_args(model.args)
    for block in model.layers:
        block.attention.n_heads, block.attention.n_kv_heads = local.n_heads, local.n_kv_heads


def kv_for_attention(tp: TPContext, layer: int, keys: torch.Tensor, values: torch.Tensor):
    """What this rank's query heads attend over. Under fault tp-kv-shard the last rank reads, at layer 0,
    the KV heads of the rank before it (every rank takes part in the exchange, as a real one would)."""
    if tp.fault != "tp-kv-shard" or layer != 0:
        return keys, values
    import torch.distributed as dist
    ks = [torch.empty_like(keys) for _ in range(tp.world)]
    vs = [torch.empty_like(values) for _ in range(tp.world)]
    dist.all_gather(ks, keys.contiguous())
    dist.all_gather(vs, values.contiguous())
    if tp.rank == tp.world - 1:
        return ks[tp.rank - 1], vs[tp.rank - 1]
    return keys, values
