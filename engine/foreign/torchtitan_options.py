"""The torchtitan engine's own options, the table ``[run.torchtitan]`` (plain data, no torch): read and checked
with the rest of a config before any engine loads (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..shared.errors import ConfigError

ATTENTION = ("flex", "varlen")  # TorchTitan's attention backends for its language models


@dataclass(frozen=True)
class TorchTitanOptions:
    """[run.torchtitan]: TorchTitan's own model. ``attention``: its inner attention (flex_attention, compiled by
    inductor, TorchTitan's default; varlen_attn needs CUDA's flash attention). ``compile``: each TransformerBlock
    compiled as TorchTitan's trainer compiles it (``block.compile(fullgraph=True)``)."""
    attention: str = "flex"
    compile: bool = False

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION)} (got {self.attention!r})")
        if self.attention == "varlen":
            raise ConfigError("attention = \"varlen\" runs TorchTitan's varlen_attn, which calls "
                              "aten::_flash_attention_forward: CUDA only, no CPU kernel; prefill-diff runs "
                              "TorchTitan on the CPU: use attention = \"flex\"")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be true or false (got {self.compile!r})")
