"""``meta.record.llama_cpp``: what the llama.cpp engine records about its run (engine/foreign/llamacpp_engine.py
``_run_meta``), declared as plain data beside the engine (no llama-cpp-python) and registered in
engine/registry.py (``record_section``). The recorder checks the section against it, strictly (an undeclared key
is refused), when the job hands it over; dumps/meta_fields.py reads the rows (``section_fields``).

Each row: (field, kind, options, since, meaning), as engine/foreign/vllm_record.py describes them.
"""
RECORD = (
    ("version", "text", {"none": True}, "1.1", "llama-cpp-python's version"),
    ("gguf", "text", {"none": True}, "1.1", "the GGUF file it loaded (null: one converted from the model)"),
    ("converted_from_snapshot", "text", {"none": True}, "1.1",
     "the weight type of the GGUF converted from the model (null: the model was a GGUF file)"),
    ("arch", "text", {}, "1.1", "the GGUF's architecture"),
    ("weight_types", "obj", {}, "1.1", "ggml type -> the number of tensors of that type"),
    ("weight_quant", "text", {"none": True}, "1.1", "the main quantized type, or null"),
    ("flash_attn", "boolean", {}, "1.1", "whether flash attention ran, as resolved"),
    ("flash_attn_setting", "one_of", {"values": (True, False, "auto")}, "1.1", "[run.llamacpp] flash_attn"),
    ("type_k", "text", {}, "1.1", "the K cache's type (ggml name)"),
    ("type_v", "text", {}, "1.1", "the V cache's type (ggml name)"),
    ("n_ubatch", "integer", {"lo": 1}, "1.1", "tokens per graph computation"),
    ("n_batch", "integer", {"lo": 1}, "1.1", "tokens per llama_decode call"),
    ("n_threads", "integer", {"lo": 1}, "1.1", "the threads it ran on"),
    ("kv_unified", "boolean", {}, "1.1", "one KV buffer shared by the sequences"),
    ("use_extra_bufts", "boolean", {}, "1.1", "llama.cpp's repacked weight buffers"),
)
