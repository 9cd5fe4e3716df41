"""The built-in execution paths (``prefill-diff presets``): each a name, one line of what it does, and its change from
``reference`` in the nested shape of a config file (engine/config.py reads both the same way). Plain data."""
from __future__ import annotations

# Presets: one change from `reference` each, in the nested shape of a config file.
PRESETS: dict[str, tuple[str, dict]] = {
    "reference": ("one sample at a time, eager attention, float32, no reuse", {}),
    "batched-left": ("all prompts as one left-padded batch", {"run": {"batching": "left"}}),
    "batched-right": ("all prompts as one right-padded batch", {"run": {"batching": "right"}}),
    "packed": ("all prompts packed into one row, no padding (varlen, cu_seqlens)", {"run": {"batching": "packed"}}),
    "prefix-reuse": ("the first 4 tokens' KV come from an earlier request via the prefix cache",
                     {"reuse": {"prefix_len": 4}}),
    "sdpa": ("torch scaled_dot_product_attention kernel", {"run": {"native": {"kernel": "sdpa"}}}),
    "tiled": ("tiled online-softmax kernel (FlashAttention's algorithm), block 4",
              {"run": {"native": {"kernel": "tiled", "block_size": 4}}}),
    "chunked": ("prompt processed in chunks of 4 tokens against the growing cache", {"run": {"chunk_size": 4}}),
    "paged": ("paged KV cache: 4-token pages, non-contiguous, attention reads through the block table",
              {"run": {"native": {"cache_kind": "paged", "page_size": 4}}}),
    "kv-int8": ("int8 KV cache with per-token scales; attention reads it dequantised", {"cache": {"dtype": "int8"}}),
    "rotate-on-read": ("cache stores keys before RoPE and rotates them on read", {"run": {"native": {"key_rotation": "pre"}}}),
    "decode": ("the response written token by token: the prompt prefilled, then one decode step per response token "
               "against the growing cache, all samples as one left-padded batch (needs a response: --response)",
               {"run": {"decode": True, "batching": "left"}}),
    "decode-paged": ("decode steps over a paged KV cache (4-token pages) read through the block table",
                     {"run": {"decode": True, "batching": "left", "native": {"cache_kind": "paged", "page_size": 4}}}),
    "transformers-decode": ("Hugging Face transformers' own model writing the response token by token with its own "
                            "cache (past_key_values), all samples as one left-padded batch (needs a response)",
                            {"run": {"engine": "transformers", "decode": True, "batching": "left"}}),
    "float64": ("weights and activations in float64", {"run": {"dtype": "float64"}}),
    "bf16": ("weights and activations in bfloat16", {"run": {"dtype": "bfloat16"}}),
    "fp16": ("weights and activations in float16", {"run": {"dtype": "float16"}}),
    "w8": ("weight-only int8 quantisation, per-channel scales", {"run": {"weight_quant": "int8"}}),
    "transformers": ("Hugging Face transformers' own model, eager attention", {"run": {"engine": "transformers"}}),
    "transformers-sdpa": ("Hugging Face transformers' own model, sdpa attention",
                          {"run": {"engine": "transformers", "transformers": {"attn_implementation": "sdpa"}}}),
    "transformers-bf16": ("Hugging Face transformers' own model in bfloat16, loaded in it (dtype=bfloat16: RoPE's "
                          "inv_freq stays float32)", {"run": {"engine": "transformers", "dtype": "bfloat16"}}),
    "fsdp2": ("transformers' model under torch FSDP2 as a trainer runs it: fully_shard per layer and root, "
              "bfloat16 param dtype (float32 reduce), loaded in bfloat16, the prompts split over 2 gloo ranks",
              {"run": {"engine": "fsdp2", "dtype": "bfloat16"}}),
    "fsdp2-cast": ("fsdp2 with the loader trap: loaded in float32, then model.to(bfloat16), which casts RoPE's "
                   "inv_freq buffer too", {"run": {"engine": "fsdp2", "dtype": "bfloat16", "fsdp2": {"load": "cast"}}}),
    "tp2": ("our engine sharded over 2 tensor-parallel ranks (torch.distributed, gloo), per-rank traces",
            {"run": {"tp": 2}}),
    "compiled": ("each layer's norms and MLP compiled by torch.compile (inductor); compile time reported apart",
                 {"run": {"native": {"compile": True}}}),
    "transformers-tp2": ("transformers' own model over 2 tensor-parallel ranks (its TP plan, tp_size=2); "
                         "needs --model hf:DIR", {"run": {"engine": "transformers", "tp": 2}}),
    "llama.cpp": ("llama.cpp (llama-cpp-python), one sequence at a time; differs from llama.cpp's defaults: "
                  "flash attention off (default auto: on), KV cache f32 (default f16)",
                  {"run": {"engine": "llama.cpp",
                           "llamacpp": {"flash_attn": False, "type_k": "f32", "type_v": "f32"}}}),
    "llama.cpp-flash": ("llama.cpp, one sequence at a time, flash attention on, KV cache f16: llama.cpp's "
                        "defaults on a CPU (default flash auto: on)",
                        {"run": {"engine": "llama.cpp",
                                 "llamacpp": {"flash_attn": True, "type_k": "f16", "type_v": "f16"}}}),
    "llama.cpp-batched": ("llama.cpp, all prompts as sequences (seq_ids) of one batch in a unified KV cache; "
                          "differs from llama.cpp's defaults: flash attention off, KV cache f32",
                          {"run": {"engine": "llama.cpp", "batching": "packed",
                                   "llamacpp": {"flash_attn": False, "type_k": "f32", "type_v": "f32"}}}),
    "llama.cpp-decode": ("llama.cpp writing the response token by token: the prompt in one llama_decode, then one "
                         "llama_decode per response token against its cache (needs a response); flash attention off, "
                         "KV cache f32",
                         {"run": {"engine": "llama.cpp", "decode": True,
                                  "llamacpp": {"flash_attn": False, "type_k": "f32", "type_v": "f32"}}}),
    "vllm": ("vLLM, all prompts in one engine (its scheduler batches them), float32, prefix caching off",
             {"run": {"engine": "vllm", "batching": "packed"}}),
    "vllm-chunked": ("vLLM with a 32-token budget per step: every prompt longer than 32 tokens is prefilled in "
                     "chunks over several steps, sharing steps with the others",
                     {"run": {"engine": "vllm", "batching": "packed",
                              "vllm": {"engine_args": {"max_num_batched_tokens": 32}}}}),
    "vllm-prefix-cache": ("vLLM with its prefix cache warmed first with each prompt's leading full 32-token "
                          "blocks: every prompt that spans a block reuses it (a cache hit), the rest is computed",
                          {"run": {"engine": "vllm", "batching": "packed",
                                   "vllm": {"prefix_caching": True, "warm": True}}}),
    "vllm-bf16": ("vLLM in bfloat16", {"run": {"engine": "vllm", "batching": "packed", "dtype": "bfloat16"}}),
    "vllm-fp8-kv": ("vLLM in bfloat16 with an fp8 (e4m3) KV cache",
                    {"run": {"engine": "vllm", "batching": "packed", "dtype": "bfloat16"},
                     "cache": {"dtype": "fp8_e4m3"}}),
    "vllm-decode": ("vLLM writing the response in its own decode steps, teacher-forced (a logits processor leaves "
                    "each step the response's next token), all prompts in one engine, float32 (needs a response: "
                    "--response)",
                    {"run": {"engine": "vllm", "batching": "packed", "decode": True}}),
    "vllm-decode-bf16": ("vLLM decoding the response teacher-forced, in bfloat16 (needs a response: --response)",
                         {"run": {"engine": "vllm", "batching": "packed", "decode": True, "dtype": "bfloat16"}}),
    "torchtitan": ("TorchTitan's own model (the trainer's forward), every prompt packed into one row as it trains, "
                   "flex attention, float32", {"run": {"engine": "torchtitan", "batching": "packed"}}),
    "torchtitan-bf16": ("TorchTitan's own model, packed, flex attention, parameters in bfloat16 (RoPE's cache "
                        "float32, as under its mixed precision)",
                        {"run": {"engine": "torchtitan", "batching": "packed", "dtype": "bfloat16"}}),
    "fault:last-column": ("§2.11 row 1: gather takes the rectangle's last column (right padding)",
                          {"run": {"batching": "right"}, "fault": {"name": "last-column"}}),
    "fault:skip-kv": ("§2.11 row 2: one layer skips writing one KV position", {"fault": {"name": "skip-kv"}}),
    "fault:position-restart": ("§2.11 row 3: position ids restart at 0 after prefix reuse",
                               {"reuse": {"prefix_len": 4}, "fault": {"name": "position-restart"}}),
    "fault:gqa-mapping": ("§2.11 row 4: query head 0 reads the wrong KV head", {"fault": {"name": "gqa-mapping"}}),
    "fault:unmasked-padding": ("§2.11 row 5: padding keys not masked (left padding)",
                               {"run": {"batching": "left"}, "fault": {"name": "unmasked-padding"}}),
    "fault:adapter-mismatch": ("§2.11 row 6: reuse of a prefix cache built under another adapter, check bypassed",
                               {"reuse": {"prefix_len": 4, "cache_adapter": "other", "force": True},
                                "fault": {"name": "adapter-mismatch"}}),
    "fault:masked-row-softmax": ("§2.11 row 7: a fully masked padding row enters softmax (left padding)",
                                 {"run": {"batching": "left"}, "fault": {"name": "masked-row-softmax"}}),
    "fault:window-off-by-one": ("sliding-window layers see W+1 tokens, one more than their window (a model with "
                                "sliding-window layers and a prompt longer than W)",
                                {"fault": {"name": "window-off-by-one"}}),
    "fault:router-norm-topk": ("a mixture of experts' top-k weights renormalised where the model does not (or not "
                               "where it does): a wrong norm_topk_prob", {"fault": {"name": "router-norm-topk"}}),
    "fault:router-topk-off-by-one": ("a mixture of experts' router takes the experts ranked 2..k+1, not 1..k",
                                     {"fault": {"name": "router-topk-off-by-one"}}),
    "fault:shared-gate-dropped": ("Qwen2-MoE's shared expert added without its sigmoid gate",
                                         {"fault": {"name": "shared-gate-dropped"}}),
    "fault:decode-position": ("a decode step rotates and caches its token at the previous position (needs a "
                              "response: --response)", {"run": {"decode": True, "batching": "left"},
                                                         "fault": {"name": "decode-position"}}),
    "fault:decode-stale-cache": ("a decode step reads the cache without the entry it has just written (needs a "
                                 "response: --response)", {"run": {"decode": True, "batching": "left"},
                                                            "fault": {"name": "decode-stale-cache"}}),
    "fault:decode-mask": ("a left-padded sample's padding keys unmasked in its decode steps only (needs a response: "
                          "--response)", {"run": {"decode": True, "batching": "left"},
                                          "fault": {"name": "decode-mask"}}),
    "fault:stale-param": ("a weight sync left one parameter stale: layer 1's k_proj weight one ULP off after loading "
                          "(an identity failure naming it)", {"fault": {"name": "stale-param"}}),
    "fault:tp-missing-allreduce": ("tensor parallel, 2 ranks: layer 0's attention output projection is not "
                                   "all-reduced", {"run": {"tp": 2}, "fault": {"name": "tp-missing-allreduce"}}),
    "fault:tp-kv-shard": ("tensor parallel, 2 ranks: at layer 0 rank 1's query heads read rank 0's KV heads",
                          {"run": {"tp": 2}, "fault": {"name": "tp-kv-shard"}}),
    "fault:vllm-cache-write": ("inside vLLM: after the middle layer writes its cache, one slot of sample 0's keys is "
                               "overwritten with its neighbour's",
                               {"run": {"engine": "vllm", "batching": "packed"}, "fault": {"name": "cache-write"}}),
    "fault:vllm-position-restart": ("§2.11 row 3 inside vLLM: after a real prefix-cache hit the computed suffix's "
                                    "position ids restart at 0",
                                    {"run": {"engine": "vllm", "batching": "packed",
                                             "vllm": {"prefix_caching": True, "warm": True}},
                                     "fault": {"name": "position-restart"}}),
    "fault:vllm-decode-position": ("inside vLLM: a decode step's position id is the previous one (needs a response: "
                                   "--response)", {"run": {"engine": "vllm", "batching": "packed", "decode": True},
                                                   "fault": {"name": "decode-position"}}),
}
