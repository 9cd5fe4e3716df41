"""The fsdp2 engine's own options, the table ``[run.fsdp2]`` (plain data, no torch): read and checked with the rest
of a config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError
from .hf_options import ATTN_IMPLEMENTATIONS, LOADS, check_choice

POLICY_DTYPES = ("float32", "bfloat16", "float16")  # what torch's MixedPrecisionPolicy casts to here


@dataclass(frozen=True)
class Fsdp2Options:
    """[run.fsdp2]: transformers' model under torch FSDP2 (``fully_shard``), run data parallel as a trainer runs it."""
    param_dtype: str | None = None  # MixedPrecisionPolicy.param_dtype; None: the run's dtype (what the forward computes in)
    reduce_dtype: str = "float32"  # MixedPrecisionPolicy.reduce_dtype (gradients only: a forward never reduces)
    ranks: int = 2  # processes (gloo on 127.0.0.1), each a data-parallel rank with its share of the prompts
    reshard_after_forward: bool = True  # fully_shard's: free each layer's gathered parameters after its forward
    load: str = "dtype"  # dtype: load in the param dtype (from_pretrained(dtype=...)); cast: float32, then .to()
    attn_implementation: str = "eager"  # eager | sdpa, as the transformers engine

    def __post_init__(self):
        if self.param_dtype is not None:
            check_choice("param_dtype", self.param_dtype, POLICY_DTYPES)
        check_choice("reduce_dtype", self.reduce_dtype, POLICY_DTYPES)
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or not 1 <= self.ranks <= 64:
            raise ConfigError(f"[run.fsdp2] ranks must be an integer from 1 to 64 (got ranks={self.ranks!r})")
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(f"[run.fsdp2] reshard_after_forward must be true or false "
                              f"(got reshard_after_forward={self.reshard_after_forward!r})")
        check_choice("load", self.load, LOADS)
        check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
