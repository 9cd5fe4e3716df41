"""``meta.record.transformers`` and ``meta.record.fsdp2``: what the transformers engine (engine/foreign/hf_engine.py)
and the fsdp2 engine (engine/foreign/fsdp2_engine.py) record about how they loaded and ran transformers' model,
declared as plain data (no torch) and registered in engine/registry.py (``record_section``); rows as in
vllm_record.py: (field, kind, options, since, meaning).

The buffers' dtypes make the loader trap visible: a model loaded in float32 and cast with ``model.to(bfloat16)`` holds
RoPE's ``inv_freq`` in bfloat16, one loaded with ``dtype=bfloat16`` (and FSDP2's mixed precision, which casts
parameters only) keeps it in float32.
"""
LOADS = ("dtype", "cast")  # hf_options.LOADS (this declaration imports nothing: a test reads it without its engine)

LOADED = (
    ("load", "text", {"choices": LOADS}, "1.4", "how the weights reached the compute dtype: dtype (loaded in it) or "
     "cast (loaded in float32, then model.to(dtype), buffers included)"),
    ("buffers", "obj", {}, "1.4", "{buffer name: dtype} of the model as it ran (RoPE's inv_freq among them)"),
)

TRANSFORMERS = LOADED

FSDP2 = LOADED + (
    ("torch", "text", {}, "1.4", "the torch release that ran fully_shard"),
    ("parameters", "obj", {}, "1.4", "{dtype: parameters} as FSDP2 holds them, sharded (its policy casts them to "
     "param_dtype for each forward)"),
    ("policy", "obj", {}, "1.4", "the MixedPrecisionPolicy and fully_shard's settings (fully_shard wraps each "
     "decoder layer, then the root)"),
    ("policy.param_dtype", "text", {}, "1.4", "the dtype each forward's gathered parameters are cast to"),
    ("policy.reduce_dtype", "text", {}, "1.4", "the dtype gradients would be reduced in (no forward reduces)"),
    ("policy.reshard_after_forward", "boolean", {}, "1.4", "whether a layer's gathered parameters are freed after "
     "its forward"),
    ("split", "text", {"choices": ("strided",)}, "1.4", "how the prompts are dealt to the ranks: strided, rank r "
     "of N runs samples r, r + N, r + 2N, ..."),
    ("ranks", "array", {}, "1.4", "per rank, what it ran"),
    ("ranks[].rank", "integer", {"lo": 0}, "1.4", "the rank"),
    ("ranks[].samples", "integer", {"lo": 0}, "1.4", "how many samples it ran (the split says which)"),
    ("ranks[].forwards", "integer", {"lo": 0}, "1.4", "its model forwards for those samples"),
    ("ranks[].idle_forwards", "integer", {"lo": 0}, "1.4", "forwards of one padding token it ran besides, so that "
     "every rank joins as many all-gathers as the busiest (not recorded)"),
    ("ranks[].startup_s", "number", {"lo": 0, "none": True}, "1.4", "spawn to process group ready"),
    ("ranks[].prepare_s", "number", {"lo": 0}, "1.4", "loading the model and wrapping it in fully_shard"),
    ("ranks[].forward_s", "number", {"lo": 0}, "1.4", "its forwards, recorded"),
)
