"""``meta.record.vllm``: what the vllm engine records about its run (engine/foreign/vllm_engine.py ``_run_meta``),
declared as plain data beside the engine (no vLLM, no torch) and registered in engine/registry.py
(``record_section``). The recorder checks the section against it, strictly (an undeclared key is refused), when the
job hands it over; dumps/meta_fields.py reads the rows (``section_fields``).

Each row: (field, kind, options, since, meaning). ``kind`` names a check of dumps/meta_fields.py's vocabulary
(integer, number, text, boolean, one_of, obj, array) and ``options`` its arguments; ``NAME[].x`` is a key of the
items of list NAME; ``since`` is the trace format version that added the field.
"""
BF16_ROUNDINGS = ("nearest", "truncate", "other", "unknown")  # how its kernels round float32 to bfloat16

RECORD = (
    ("version", "text", {"none": True}, "1.1", "vLLM's version, in the environment it ran in"),
    ("torch", "text", {"none": True}, "1.1", "that environment's torch"),
    ("python", "text", {"none": True}, "1.1", "that environment's Python"),
    ("engine_args", "obj", {"none": True}, "1.1", "the arguments LLM() was given"),
    ("effective", "obj", {}, "1.1", "the engine configuration and the model config vLLM ran, in its own names"),
    ("attention_backend", "text", {"none": True}, "1.1", "its attention backend's class"),
    ("isa", "text", {"none": True}, "1.1", "the instruction set its CPU attention chose"),
    ("bf16_rounding", "text", {"choices": BF16_ROUNDINGS, "none": True}, "1.1",
     "how its kernels round float32 to bfloat16, learned from its rotary embedding (null below bfloat16's use)"),
    ("timing", "obj", {"none": True}, "1.1", "seconds spent"),
    ("timing.import_s", "number", {"lo": 0}, "1.1", "importing vLLM"),
    ("timing.load_s", "number", {"lo": 0}, "1.1", "loading the model"),
    ("timing.generate_s", "number", {"lo": 0}, "1.1", "the prefill"),
    ("logprobs", "obj", {"none": True}, "1.3", "with a response (decoded by vLLM, teacher-forced): vLLM's own "
     "log-probs of the forced tokens against log_softmax of the captured logits (null without a response)"),
    ("logprobs.mode", "text", {"none": True}, "1.3", "vLLM's logprobs_mode: raw_logprobs, the model's own (a processed "
     "log-prob of a forced token is 0 and is never compared)"),
    ("logprobs.tokens", "integer", {"lo": 0}, "1.3", "the response tokens compared"),
    ("logprobs.max_abs_diff", "number", {"lo": 0}, "1.3", "the largest |vLLM's log-prob - log_softmax(logits)|"),
    ("samples", "array", {}, "1.1", "per sample, what its scheduler did"),
    ("samples[].sample", "integer", {"lo": 0}, "1.1", "the sample"),
    ("samples[].steps", "integer", {"lo": 0}, "1.1", "the scheduler steps that computed it"),
    ("samples[].num_cached_tokens", "integer", {"lo": 0}, "1.1", "the tokens its prefix cache served"),
)
