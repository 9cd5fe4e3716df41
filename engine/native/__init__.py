"""Our engine: the contract's decoder (model.py), its attention kernels and KV cache, prefill() over every
execution path (prefill.py, engine.py), and what is applied to a built model from outside (LoRA, int8 weights,
torch.compile, tensor parallelism)."""
