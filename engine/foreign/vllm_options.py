"""The vllm engine's own options, the table ``[run.vllm]`` (plain data, no vLLM): read and checked with the rest of a
config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..shared.errors import ConfigError, check_positive

# vLLM's own arguments that prefill-diff sets from its own configuration, or never lets a config choose
VLLM_REFUSED_ARGS = {"model": "[model] source", "tokenizer": "nothing (prompts go to vLLM as token ids)",
                     "trust_remote_code": "nothing (code from a model directory is never run)",
                     "dtype": "[run] dtype", "kv_cache_dtype": "[cache] dtype (fp8_e4m3, fp8_e5m2)",
                     "skip_tokenizer_init": "nothing", "enforce_eager": "nothing", "max_logprobs": "nothing",
                     "enable_prefix_caching": "[run.vllm] prefix_caching", "block_size": "[run.vllm] block_size"}


@dataclass(frozen=True)
class VllmOptions:
    """[run.vllm]: vLLM in the user's own Python environment (engine/foreign/vllm_engine.py).

    ``python`` is the interpreter of that environment (else $PREFILL_DIFF_VLLM_PYTHON, else this one when it has
    vLLM); it is never recorded in a trace, so a trace can never choose what runs. ``engine_args`` go to
    vLLM's ``LLM()`` as they are, checked by vLLM's own EngineArgs before the model loads."""
    python: str | None = None
    engine_args: dict = field(default_factory=dict)
    prefix_caching: bool = False
    warm: bool = False  # first fill the prefix cache with each prompt's leading full blocks, then prefill
    block_size: int = 32
    kv_cache_mib: int = 256  # vLLM's KV cache space, in MiB (its automatic sizing fails on small CPU machines)

    def __post_init__(self):
        if self.python is not None and (not isinstance(self.python, str) or not self.python.strip()):
            raise ConfigError(f"python must be the path of a Python interpreter (got {self.python!r})")
        if not isinstance(self.engine_args, dict):
            raise ConfigError(f"engine_args must be a table of vLLM LLM() arguments (got {self.engine_args!r})")
        refused = sorted(set(self.engine_args) & set(VLLM_REFUSED_ARGS))
        if refused:
            raise ConfigError("engine_args may not set " + "; ".join(
                f"{k} (set by {VLLM_REFUSED_ARGS[k]})" for k in refused))
        for key in ("prefix_caching", "warm"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false (got {getattr(self, key)!r})")
        if self.warm and not self.prefix_caching:
            raise ConfigError("warm = true fills vLLM's prefix cache: it needs prefix_caching = true")
        check_positive("block_size", self.block_size, 4096)
        check_positive("kv_cache_mib", self.kv_cache_mib, 1 << 20)

    def __hash__(self):  # engine_args is a dict: frozen dataclasses hash their fields
        return hash((self.python, tuple(sorted((k, repr(v)) for k, v in self.engine_args.items())),
                     self.prefix_caching, self.warm, self.block_size, self.kv_cache_mib))
