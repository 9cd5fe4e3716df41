"""The vLLM releases the worker runs (engine/foreign/vllm_worker.py SUPPORTED): the check on fake versions, the
worker refusing before it imports vLLM, and the tool refusing an environment's release before either side runs.
No vLLM needed: a fake environment holds a package named vllm with the version under test."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from prefill_diff.engine.foreign import vllm_env, vllm_worker
from prefill_diff.engine.foreign.vllm_engine import ENV, frames

ROOT = Path(__file__).resolve().parents[3]
LOW, HIGH = vllm_worker.SUPPORTED


@pytest.mark.parametrize("version", ["0.29.0", "0.30.2", "0.31.1", "0.32.0", "0.32.0+cpu", "0.32.1.dev3+g1a2b3c",
                                     "0.29.0rc1", "0.32.5.post1"])
def test_a_release_in_the_range_is_run(version):
    assert vllm_worker.unsupported(version, "/env/bin/python") is None


@pytest.mark.parametrize("version", ["0.28.0", "0.28.2+cpu", "0.24.0", "0.9.2", "0.33.0", "0.33.0.dev1+cpu", "1.0.0",
                                     "0.290.0", "", "dev", "unknown"])
def test_a_release_outside_the_range_is_refused_naming_both(version):
    why = vllm_worker.unsupported(version, "/env/bin/python")
    assert why is not None and "\n" not in why
    assert f"vLLM {LOW} to {HIGH}" in why and "/env/bin/python" in why, why
    assert f"has vLLM {version or '(no version)'}:" in why, why


def test_the_range_is_two_releases_in_order_and_the_setup_installs_one_inside_it():
    lo, hi = vllm_worker.release(LOW), vllm_worker.release(HIGH)
    assert lo is not None and hi is not None and lo <= hi
    pinned = vllm_env.VLLM.split("==")[1]
    assert vllm_worker.unsupported(pinned, "x") is None, vllm_env.VLLM


def test_the_docs_state_the_range_the_worker_holds():
    said = f"vLLM {LOW} to {HIGH}"
    for doc in ("README.md", "docs/engines.md"):
        assert said in (ROOT / doc).read_text(encoding="utf-8"), doc


def test_the_worker_refuses_a_release_before_importing_it(monkeypatch):
    """The metadata's version is read before ``import vllm`` (an older vLLM may fail inside the import)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # run() sets them; restored afterwards
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(vllm_worker, "installed_version", lambda: "0.28.0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import would fail: the refusal must come first
    with pytest.raises(vllm_worker.InputError, match=rf"runs vLLM {LOW} to {HIGH}, .* has vLLM 0\.28\.0:"):
        vllm_worker.run(lambda: pytest.fail("the request was read"), None)


def test_the_worker_checks_the_imported_version_when_no_metadata_names_it(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(vllm_worker, "installed_version", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0.dev1+cpu"))
    with pytest.raises(vllm_worker.InputError, match=r"has vLLM 0\.33\.0\.dev1\+cpu:"):
        vllm_worker.run(lambda: pytest.fail("the request was read"), None)


def test_the_workers_refusal_is_an_input_error_frame_exit_2(monkeypatch):
    """main() answers an unsupported release with one error frame of kind input: the tool's WorkerFailed, exit 2."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(vllm_worker, "installed_version", lambda: "0.28.0")
    r, w = os.pipe()
    assert vllm_worker.main(["vllm_worker.py", str(w)]) == 2
    with os.fdopen(r, "rb") as stream:
        got = [head for head, _ in frames(stream)]
    assert [h["type"] for h in got] == ["error"] and got[0]["kind"] == "input", got
    assert "has vLLM 0.28.0" in got[0]["message"]


# -- through the tool: an environment's release is refused before either side runs -------------------------

def test_an_environment_with_an_older_vllm_is_one_line_exit_2_before_any_side_runs(run_cli, monkeypatch, tmp_path,
                                                                                    fake_vllm_python):
    python = fake_vllm_python("0.28.0")
    monkeypatch.setenv(ENV, python)
    res = run_cli("run", "reference", "vllm", "--out", tmp_path / "out")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"runs vLLM {LOW} to {HIGH}, and the environment of {python} has vLLM 0.28.0:" in res.output, res.output
    assert not list((tmp_path / "out").glob("*.h5"))  # the reference was not recorded either


def test_an_environment_with_a_release_in_the_range_is_taken(monkeypatch, fake_vllm_python):
    from prefill_diff.engine.config import load_side
    from prefill_diff.engine.prepared import prepare
    python = fake_vllm_python(f"{HIGH}.0+cpu")
    monkeypatch.setenv(ENV, python)
    assert prepare(load_side("vllm")).extras["python"] == python


def test_the_probe_reads_the_version_as_the_worker_does(fake_vllm_python):
    from prefill_diff.engine.foreign.vllm_engine import PROBE
    python = fake_vllm_python("0.30.1")
    import inspect
    probe = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True, check=True)
    worker = subprocess.run([python, "-I", "-c", inspect.getsource(vllm_worker.installed_version)
                             + "\nprint(installed_version())"], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == worker.stdout.strip() == "0.30.1"

