"""What the commands draw on: rich consoles fitted to the output (a terminal's width; piped: COLUMNS, else a
generous fixed width), the progress display on stderr, and the model loaders' own chatter silenced."""
from __future__ import annotations

import logging
import os
import sys
import time

import click
from rich.console import Console
from rich.progress import BarColumn, Progress as RichProgress, ProgressColumn, SpinnerColumn, TextColumn
from rich.text import Text

from ..engine.shared.untrusted import visible


GENEROUS_WIDTH = 120  # columns of the report when stdout is not a terminal and COLUMNS is unset (CI logs, pipes)


class _Console(Console):
    """rich's Console, except that a closed stdout is not its own ``SystemExit(1)``: the BrokenPipeError reaches
    ``Cli.invoke``, which ends the command with the verdict's status."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def console(stderr: bool = False, terminal: bool | None = None, width: int | None = None):
    """Rich console: the terminal's width; not a terminal: COLUMNS, else a fixed generous width.

    ``terminal`` and ``width`` override what is detected (tests draw an 80-column terminal with them)."""
    c = _Console(stderr=stderr, highlight=False, force_terminal=terminal, width=width)
    if width is None and not c.is_terminal and not os.environ.get("COLUMNS"):
        c = _Console(stderr=stderr, highlight=False, force_terminal=terminal, width=GENEROUS_WIDTH)
    return c


def quiet_libraries(verbose: bool = False) -> None:
    """No progress bars or log chatter from the libraries that load models (transformers, huggingface_hub, gguf,
    tqdm) unless -v: our own progress display covers model loading.

    Set before transformers and tqdm are imported (they read the environment once); transformers, if already
    imported, is told directly."""
    if verbose:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    logging.getLogger("gguf").setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        from transformers.utils import logging as tlog
        tlog.disable_progress_bar()
        tlog.set_verbosity_error()


class _Count(ProgressColumn):
    """Layers done of the total, for a side's layers; nothing for a step of unknown length (no "0/?")."""

    def render(self, task) -> Text:
        return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)}")


class Progress:
    """What the command is doing, on stderr: a transient display on a terminal; where stderr is a pipe or a file
    (a CI log), one line per phase, with the seconds since the command started; nothing under -q.

    ``step(label)`` starts a phase (model load, compare); ``side(label)`` returns the per-layer callback a job
    calls while it records a side, with the layer total once the recorder knows it; ``sides()`` gives jobs
    both, as a callable with a ``phase`` method.
    """

    def __init__(self, quiet: bool = False):
        self.console = console(stderr=True)
        self.prog = None
        self.lines = not quiet and not self.console.is_terminal and _real_file(sys.stderr)
        self.start = time.monotonic()
        if not quiet and self.console.is_terminal:
            spinner = "dots" if getattr(sys.stderr, "unicode", True) else "line"  # dots: braille characters
            self.prog = RichProgress(SpinnerColumn(spinner), TextColumn("{task.description}"), BarColumn(),
                                     _Count(), transient=True, console=self.console)
        self._task = None

    def __enter__(self):
        if self.prog is not None:
            self.prog.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prog is not None:
            self.prog.__exit__(*exc)

    def step(self, label: str) -> None:
        if self.lines:
            click.echo(f"prefill-diff: {visible(label)} ({time.monotonic() - self.start:.1f} s)", err=True)
        if self.prog is None:
            return
        if self._task is not None:
            self.prog.remove_task(self._task)
        self._task = self.prog.add_task(label, total=None)

    def side(self, label: str):
        """The per-layer callback of one side's recording (None when nothing is shown)."""
        if self.prog is None:
            if self.lines:
                self.step(f"{label}: recording")
            return None
        self.step(f"{label}: layers")
        task = self._task

        def on_layer(layer):
            self.prog.update(task, completed=layer + 1)

        def set_total(n):
            self.prog.update(task, total=n)
        on_layer.set_total = set_total
        return on_layer

    def sides(self):
        """The jobs' progress: label -> per-layer callback of that side (or None), and ``.phase(label)`` for the
        steps between sides (comparing); None when nothing is shown."""
        if self.prog is None and not self.lines:
            return None

        def for_side(label):
            return self.side(label)
        for_side.phase = self.step
        return for_side


def _real_file(stream) -> bool:
    """``stream`` writes to a file descriptor (a pipe, a file): not a test harness's buffer."""
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False
