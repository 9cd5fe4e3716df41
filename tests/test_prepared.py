"""engine/prepared.py: what every engine refuses in one place, before the engine's own check is asked."""
from __future__ import annotations

import pytest

from prefill_diff.engine import registry

NO_FAULTS = [name for name, info in registry.ENGINES.items() if not info.faults]


def test_some_engines_inject_no_fault():
    assert "llama.cpp" in NO_FAULTS


@pytest.mark.parametrize("engine", NO_FAULTS)
def test_a_fault_an_engine_does_not_inject_is_refused_before_its_own_check(engine, run_cli, tmp_path, monkeypatch):
    """The registry's fault table refuses the fault in one line, exit 2, naming the engine and what it injects
    (none); the engine's check() is never reached, so it lists no faults of its own."""
    info = registry.engine(engine)
    monkeypatch.setattr(info.load(), "check", lambda prep: pytest.fail(f"{engine}'s check() was reached"))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\nengine = "{engine}"\n[fault]\nname = "skip-kv"\n')
    res = run_cli("record", cfg, "-o", tmp_path / "t.h5")
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"Error: the {engine} engine cannot inject fault skip-kv (it injects: "
                                               "none)"], res.output
    assert not (tmp_path / "t.h5").exists()
