"""engine/registry.py: what an engine can do is declared in its entry, and the refusals name the engines that
declare it (the code asks the entry, never the engine's name)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from prefill_diff.cli.main import cli
from prefill_diff.engine import registry
from prefill_diff.engine.registry import ENGINES, OURS, having


def test_an_engine_is_named_in_words():
    assert ENGINES[OURS].words == "our engine" and ENGINES["vllm"].words == "the vllm engine"


def test_having_names_the_engines_that_declare_a_capability(monkeypatch):
    assert having("any_architecture") == "the transformers engine or the fsdp2 engine"
    assert having("ledger") == "our engine"
    monkeypatch.setitem(registry.ENGINES, "vllm", replace(ENGINES["vllm"], ledger=True))
    assert having("ledger") == "our engine or the vllm engine"
    monkeypatch.setattr(registry, "ENGINES", {})
    assert having("ledger") == "no engine"


@pytest.mark.parametrize("preset", ["transformers", "llama.cpp", "vllm"])
def test_the_ledger_of_an_engine_that_draws_none_is_refused_in_one_line(preset):
    res = CliRunner().invoke(cli, ["ledger", preset])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "the shape ledger is measured by our engine" in res.output and preset in res.output


def test_a_capability_moves_the_refusal_with_it(monkeypatch):
    """Declared, the capability is used: a stand-in engine that declares precisions_from_config has its
    precisions read from its configuration by record --twin-of."""
    from prefill_diff.jobs import sides
    with pytest.raises(Exception, match="precisions are known only once it has run"):
        sides.precisions_of("llama.cpp")
    monkeypatch.setitem(registry.ENGINES, "llama.cpp", replace(ENGINES["llama.cpp"], precisions_from_config=True))
    assert sides.precisions_of("llama.cpp")["dtype"] == "float32"
