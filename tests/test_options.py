"""The shared options' --help names everything the code knows: every built-in model (each synthetic family), every
tolerance policy and alias, every tolerance kind."""
from __future__ import annotations

import re

import pytest

from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.dumps.schema import TOL_KINDS
from prefill_diff.verify.tolerance import DTYPE_DEFAULTS, POLICY_ALIASES


def _names(help_text: str) -> set:
    """The words of a help text, wrapped lines joined (a name with hyphens may wrap only at a space)."""
    return set(re.findall(r"[\w:-]+(?:\.[\w-]+)*", " ".join(help_text.split())))


def _models_named(words: set) -> set:
    """The built-in model names a help text names: in full, or a synthetic family as synthetic:FAMILY's FAMILY."""
    return {name for name in MODEL_PRESETS if name in words or name.split(":")[-1] in words}


@pytest.mark.parametrize("command", ["run", "record", "compare", "ledger"])
def test_help_names_every_built_in_model_and_synthetic_family(run_cli, command):
    res = run_cli(command, "--help")
    assert res.exit_code == 0
    words = _names(res.output)
    assert "synthetic:FAMILY" in words
    assert _models_named(words) == set(MODEL_PRESETS), sorted(set(MODEL_PRESETS) - _models_named(words))
    assert len([n for n in MODEL_PRESETS if n.startswith("synthetic")]) >= 14  # synthetic and its families


@pytest.mark.parametrize("command", ["run", "record", "compare"])
def test_help_names_every_tolerance_policy_alias_and_kind(run_cli, command):
    words = _names(run_cli(command, "--help").output)
    for name in [*DTYPE_DEFAULTS, *POLICY_ALIASES, *TOL_KINDS]:
        assert name in words, name
