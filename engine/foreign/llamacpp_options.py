"""The llama.cpp engine's own options, the table ``[run.llamacpp]`` (plain data, no llama-cpp-python): read and
checked with the rest of a config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError, check_positive

GGML_MAX_N_THREADS = 512  # ggml's own limit on a computation's threads (ggml.h)
LLAMACPP_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # ggml type names


@dataclass(frozen=True)
class LlamaCppOptions:
    """[run.llamacpp]: llama.cpp's own knobs. The defaults are llama.cpp's own."""
    flash_attn: bool | str = "auto"  # true | false | "auto" (llama.cpp decides; on a CPU it turns it on)
    n_ubatch: int = 512  # physical batch: tokens per graph computation
    n_batch: int = 2048  # logical batch: tokens per llama_decode call
    type_k: str = "f16"  # KV cache types (ggml names)
    type_v: str = "f16"
    n_threads: int = 0  # 0: the CPUs this process may use that the load leaves free, 1-4 (llama.cpp's default: 4)
    gguf_type: str = "f32"  # a model that is not a GGUF file is converted to one with these weights: f32 | f16

    def __post_init__(self):
        if self.flash_attn not in (True, False, "auto"):
            raise ConfigError(f"flash_attn must be true, false or \"auto\" (got {self.flash_attn!r})")
        for key in ("n_ubatch", "n_batch"):
            check_positive(key, getattr(self, key))
        if not isinstance(self.n_threads, int) or isinstance(self.n_threads, bool) or \
                not 0 <= self.n_threads <= GGML_MAX_N_THREADS:
            raise ConfigError(f"n_threads must be an integer from 0 (automatic) to {GGML_MAX_N_THREADS}, ggml's "
                              f"limit (got {self.n_threads!r})")
        for key in ("type_k", "type_v"):
            if getattr(self, key) not in LLAMACPP_CACHE_TYPES:
                raise ConfigError(f"{key} must be one of {', '.join(LLAMACPP_CACHE_TYPES)} "
                                  f"(got {getattr(self, key)!r})")
        if self.type_v not in ("f32", "f16", "bf16") and self.flash_attn is False:
            raise ConfigError(f"llama.cpp needs flash attention for a quantized V cache "
                              f"(type_v={self.type_v!r} with flash_attn=false)")
        if self.gguf_type not in ("f32", "f16"):
            raise ConfigError(f"gguf_type must be 'f32' or 'f16' (got {self.gguf_type!r})")
