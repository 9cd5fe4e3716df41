"""Named exceptions. The CLI turns every ``PrefillDiffError`` into exit status 2.

This module imports nothing heavy, so every package may import it.
"""


class PrefillDiffError(Exception):
    """Bad usage or bad input: reported in one line, exit status 2."""


class ConfigError(PrefillDiffError):
    """A configuration file, preset or option is invalid."""


class PreconditionError(PrefillDiffError):
    """An input violates a prefill precondition (seed §2.1) and was refused before layer 0."""

    def __init__(self, rule: str, detail: str):
        self.rule = rule
        super().__init__(f"precondition {rule}: {detail}")


class MaskError(PreconditionError):
    """A valid query row has no visible key, so its softmax is undefined (seed §2.2-§2.3)."""


class CacheInvariantError(PrefillDiffError):
    """A KV cache invariant (seed §2.2 box) does not hold after prefill."""


class ModelLoadError(PrefillDiffError):
    """A model source cannot be loaded (missing file, unsupported architecture)."""


INTERRUPT = {"seen": False}  # set by the CLI's SIGINT handler (see dumps.recorder._check_interrupt)
