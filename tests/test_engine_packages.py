"""An engine's missing package (engine/registry.py ``needs``, checked by prepared.prepare): one line naming the
extra that installs it, exit status 2, before any model loads. A missing package is simulated in this process:
its modules are taken out of ``sys.modules`` and a finder ahead of every other one says it does not exist, as
``import`` and ``importlib.util.find_spec`` find it where it is not installed."""
from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from prefill_diff.engine import prepared
from prefill_diff.engine.config import load_side
from prefill_diff.engine.presets import PRESETS
from prefill_diff.engine.foreign.vllm_engine import ENV
from prefill_diff.engine.foreign.vllm_worker import SUPPORTED
from prefill_diff.engine.registry import ENGINES, MissingPackage

ROOT = Path(__file__).resolve().parents[1]
HIGH = SUPPORTED[1]
OPTIONAL = ("transformers", "safetensors", "tokenizers", "gguf", "llama_cpp", "vllm", "matplotlib", "accelerate")


class _Absent(importlib.abc.MetaPathFinder):
    """A finder that says the packages ``names`` (and their submodules) are not installed."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _uninstall(monkeypatch, *names) -> None:
    """``names`` as if not installed, for one test (monkeypatch puts everything back)."""
    for key in [k for k in sys.modules if k.split(".")[0] in names]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setattr(sys, "meta_path", [_Absent(names), *sys.meta_path])


def _preset_of(engine: str) -> str:
    """The first preset that runs on ``engine``."""
    return next(name for name in PRESETS if load_side(name).run.engine == engine)


NEEDED = [(name, module, extra) for name, info in ENGINES.items() for module, extra, *_ in info.needs]
OWN_COMMAND = [(name, module, how[0]) for name, info in ENGINES.items() for module, _, *how in info.needs if how]


def test_every_foreign_engine_declares_what_it_imports():
    assert {name for name, info in ENGINES.items() if info.needs} == {"transformers", "fsdp2", "llama.cpp", "vllm",
                                                                      "torchtitan"}
    assert not ENGINES["native"].needs  # ours runs on torch, numpy and h5py alone


@pytest.mark.parametrize("engine, module, extra", NEEDED)
def test_each_declared_package_is_in_the_extra_it_names(engine, module, extra):
    if any(m == module for _, m, _ in OWN_COMMAND):
        return  # installed by its own command (below), not by the extra
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dists = [d.split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in extras[extra]]
    assert any(d.replace("-", "_").startswith(module) for d in dists), (module, extra, dists)


@pytest.mark.parametrize("engine, module, how", OWN_COMMAND)
def test_a_package_installed_by_its_own_command_is_installed_by_the_readme_test_line(engine, module, how):
    """torchtitan's own requirements conflict with transformers' (its datasets<4.8 wants huggingface_hub<2): it is
    installed with --no-deps, by the README's test line, which CI runs."""
    line = next(l for l in (ROOT / "README.md").read_text().splitlines() if '-e ".[test]"' in l)
    spec = how.split("--no-deps", 1)[1].split()
    assert "--no-deps" in how and all(f'"{s}"' in line or f" {s} " in line for s in spec), (how, line)


@pytest.mark.parametrize("engine, module, extra", NEEDED)
def test_a_missing_package_is_one_line_naming_the_extra_before_any_model_loads(engine, module, extra, run_cli,
                                                                               monkeypatch, fake_vllm_python):
    if engine == "vllm":  # an environment with vLLM is found (the worker never starts): what prefill-diff's own lacks
        monkeypatch.setenv(ENV, fake_vllm_python(f"{HIGH}.0"))
    _uninstall(monkeypatch, module)
    loaded = []
    real = prepared.load_snapshot
    monkeypatch.setattr(prepared, "load_snapshot", lambda spec: loaded.append(spec) or real(spec))
    preset = _preset_of(engine)
    with pytest.raises(MissingPackage, match=rf"the {engine} engine needs .*{module}"):
        prepared.prepare(load_side(preset))
    assert not loaded
    res = run_cli("run", "reference", preset, "--model", "synthetic")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"pip install 'prefill-diff[{extra}]'" in res.output and module in res.output, res.output
    for _, m, how in OWN_COMMAND:  # a package its extra cannot install: the message gives the command that does
        assert (how in res.output) == (m == module), res.output
    assert not loaded  # not even the reference's model: both sides' engines are checked first


def test_our_engine_needs_no_optional_package(run_cli, monkeypatch):
    _uninstall(monkeypatch, *OPTIONAL)
    res = run_cli("run", "reference", "packed", "--json", "-")
    assert res.exit_code == 0, res.output
