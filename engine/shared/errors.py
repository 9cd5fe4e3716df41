"""Named exceptions every package raises, the "did you mean" their messages give, and the interrupt flag: part
of the shared leaf (engine/shared/).

The CLI turns every ``PrefillDiffError`` into exit status 2.
"""
from __future__ import annotations

import difflib


class PrefillDiffError(Exception):
    """Bad usage or bad input: reported in one line, exit status 2."""


class ConfigError(PrefillDiffError):
    """A configuration file, preset or option is invalid."""


class PreconditionError(PrefillDiffError):
    """An input violates a prefill precondition (contract §2.1) and was refused before layer 0."""

    def __init__(self, rule: str, detail: str):
        self.rule = rule
        super().__init__(f"precondition {rule}: {detail}")


class MaskError(PreconditionError):
    """A valid query row has no visible key, so its softmax is undefined (contract §2.2-§2.3)."""


class CacheInvariantError(PrefillDiffError):
    """A KV cache invariant (contract §2.2 box) does not hold after prefill."""


class ModelLoadError(PrefillDiffError):
    """A model source cannot be loaded (missing file, unsupported architecture)."""


class UnsupportedModel(ModelLoadError):
    """A well-formed checkpoint of an architecture or setting our engine does not implement (transformers may
    still run it)."""


def did_you_mean(word, choices, fmt: str = " (did you mean {}?)") -> str:
    """``fmt`` filled with the closest of ``choices`` to a misspelt ``word``, or "" when none is close (an error
    message's hint)."""
    near = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return fmt.format(near[0]) if near else ""


INTERRUPT = {"seen": False}  # set by the CLI's SIGINT handler (read between layers by the trace recorder)


def check_positive(name: str, v, limit: int = 2 ** 31 - 1) -> None:
    """Refuse ``v`` unless it is an integer from 1 to ``limit`` (a bool is not an integer here)."""
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit:
        raise ConfigError(f"{name} must be an integer from 1 to {limit} (got {v!r})")
