"""What a terminal shows while a model loads: our progress display, not the loaders' own bars and messages
(transformers, huggingface_hub, gguf), unless -v asks for them."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "bench"))
from bench_model_cache import write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.slow  # whole CLI processes on a pseudo-terminal, signals

pytest.importorskip("transformers")
pytest.importorskip("gguf")

LOADERS = ("Converting and de-quantizing GGUF tensors", "Loading weights")  # transformers' GGUF load


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def in_a_terminal(*args, cwd) -> tuple[int, str]:
    """prefill-diff ARGS with stdout and stderr on a 120x40 pseudo-terminal: (exit status, all it printed)."""
    main, term = pty.openpty()
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "HF_HUB_DISABLE", "TRANSFORMERS_"))}
    proc = subprocess.Popen([sys.executable, "-m", "prefill_diff.cli.main", *map(str, args)], stdin=term,
                            stdout=term, stderr=term, env={**env, "TERM": "xterm"}, cwd=cwd, close_fds=True)
    os.close(term)
    out = []
    while True:
        try:
            data = os.read(main, 1 << 16)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        out.append(data)
    os.close(main)
    return proc.wait(timeout=600), b"".join(out).decode("utf-8", "replace")


def test_record_in_a_terminal_shows_our_progress_not_the_loaders(tiny_gguf, tmp_path):
    code, out = in_a_terminal("record", "transformers", "--model", f"gguf:{tiny_gguf}", "--model-cache", "off",
                              "-o", tmp_path / "t.h5", cwd=tmp_path)
    assert code == 0, out[-2000:]
    assert "loading the model" in out and "wrote" in out
    assert not any(s in out for s in LOADERS), out[-2000:]


def test_run_verbose_shows_the_loaders_bars(tiny_gguf, tmp_path):
    code, out = in_a_terminal("run", "reference", "transformers", "--model", f"gguf:{tiny_gguf}", "--model-cache",
                              "off", "-v", cwd=tmp_path)
    assert code == 0, out[-2000:]
    assert all(s in out for s in LOADERS), out[-2000:]
