"""Adding an engine, walked through with a stub: one registry entry, one module (check, plan, execute) and its
options class — and nothing else in the project. The stub is registered at run time exactly as an entry in
engine/registry.py's ENGINES would be, its module and options put where the registry loads them by name; then the
CLI reads its [run.<table>], refuses what it does not declare naming it, runs it, records and compares it."""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from prefill_diff.engine import registry

STUB = "prefill_diff.engine.stub_engine"  # where the registry would find its module: engine/stub_engine.py


@dataclass(frozen=True)
class StubOptions:
    """[run.stub]: one option of the stub's own."""
    threads: int = 1


def _check(prep) -> None:
    """The stub's own business only: its option's range."""
    from prefill_diff.engine.shared.errors import ConfigError
    if prep.side.run.options.threads < 1:
        raise ConfigError(f"threads must be at least 1 (got {prep.side.run.options.threads})")


def _plan(prep, positions, pad, tp) -> None:
    """A prefill engine of its own: here our model's code, built from the run's neutral settings alone."""
    from prefill_diff.engine.calls import plan_calls
    from prefill_diff.engine.native.prefill import Engine, NumericalConfig
    prep.engine = Engine(prep.snapshot, NumericalConfig(dtype=prep.side.run.dtype))
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)


def _execute(prep, recorder):
    from prefill_diff.engine.calls import Placement
    from prefill_diff.engine.native.settings import CacheConfig
    torch.set_num_threads(prep.side.run.options.threads)
    for c in prep.calls:  # one call after another: a layer is complete once every call has passed it
        gen = prep.engine.steps(c.ids, c.mask, c.positions, CacheConfig(invariants="record"),
                                recorder=Placement(recorder, c.runs, c.samples))
        for _ in gen:
            pass
    yield from range(prep.snapshot.args.n_layers)
    return prep.record


@pytest.fixture
def stub(monkeypatch):
    module = types.ModuleType(STUB)
    module.check, module.plan, module.execute, module.StubOptions = _check, _plan, _execute, StubOptions
    monkeypatch.setitem(sys.modules, STUB, module)
    entry = registry.EngineInfo("stub", "stub_engine", "a stub engine: our model's code behind the seam",
                                "stub_engine:StubOptions", "stub", registry.Computes(("float32", "float64")),
                                batching=("unbatched", "left"))
    monkeypatch.setitem(registry.ENGINES, "stub", entry)
    return entry


def _config(tmp_path, body: str):
    cfg = tmp_path / "stub.toml"
    cfg.write_text('[run]\nengine = "stub"\n' + body)
    return cfg


def test_a_new_engine_is_an_entry_a_module_and_its_options(stub, run_cli, tmp_path):
    cfg = _config(tmp_path, 'batching = "left"\n[run.stub]\nthreads = 1\n')
    res = run_cli("run", "reference", cfg, "--json", tmp_path / "r.json", "--out", tmp_path)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["candidate"]["engine"]["name"] == "stub"
    from prefill_diff.dumps.reader import Trace
    with Trace(tmp_path / "cand.h5") as t:
        assert t.meta["side"]["run"]["stub"] == {"threads": 1}


def test_a_new_engine_is_refused_what_it_does_not_declare_by_name(stub, run_cli, tmp_path):
    res = run_cli("run", "reference", _config(tmp_path, 'batching = "packed"\nchunk_size = 4\n'))
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "the stub engine does not run batching='packed'; chunked prefill (chunk_size=4) (our engine runs it)" \
        in res.output
    res = run_cli("run", "reference", _config(tmp_path, '[run.stub]\nthreds = 2\n'))
    assert res.exit_code == 2 and "unknown key [run.stub] threds (did you mean threads?)" in res.output
    res = run_cli("run", "reference", _config(tmp_path, '[run.native]\nkernel = "sdpa"\n'))
    assert res.exit_code == 2 and "[run.native] sets options of engine = \"native\"" in res.output
