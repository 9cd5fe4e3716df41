"""Where a verdict goes: output paths checked before any work, then the JSON, JUnit, Markdown, plot and human
reports, and on GitHub Actions the step summary and an error annotation."""
from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Callable

import click

from ..dumps.placement import TraceExistsError
from ..engine.shared.errors import PrefillDiffError
from ..engine.shared.untrusted import check_name_length, partial_sibling, visible
from ..verify.formats.github import workflow_error
from ..verify.formats.json_report import to_json
from ..verify.formats.junit import to_junit
from ..verify.formats.markdown import to_markdown
from ..verify.formats.plot import plot_errors  # matplotlib itself is imported only when a plot is drawn
from ..verify.formats.terminal import COLUMNS, print_report, shown_layers, verdict_text
from ..verify.formats.text import plain, print_line
from .terminal import keep_status_if_stdout_closes, xml_for_stdout

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


@dataclass(frozen=True)
class Reports:
    """Where a verdict goes and how much of it: the report options (--json, --junit, --markdown: a file or '-'
    for stdout; --plot: a file; -q, -v, --layers, --strict)."""
    json: str | None = None
    junit: str | None = None
    markdown: str | None = None
    plot: str | None = None
    quiet: bool = False
    verbose: bool = False
    layers: str = "auto"
    strict: bool = False


@dataclass(frozen=True)
class Format:
    """A report written as text to a file, or ('-') to stdout: its option, its name in messages, its text
    (from the report, the report options and the layers a --fail-fast run never reached) and how that text
    goes to stdout."""
    option: str
    what: str
    text: Callable
    for_stdout: Callable[[str], str] = lambda text: text


def markdown(report, which: str = "auto") -> str:
    """The Markdown report with the layer rows and columns the terminal shows (--layers)."""
    return to_markdown(report, shown=shown_layers(report, which), columns=[name for name, _, _ in COLUMNS])


# Every text report, by its field of Reports: the one dispatch (the plot is a picture: --plot, a file only; the
# terminal's report is printed by emit)
FORMATS = {
    "json": Format("--json", "the JSON report", lambda report, out, not_reached: to_json(report),
                   lambda text: text + "\n"),
    "junit": Format("--junit", "the JUnit report",
                    lambda report, out, not_reached: to_junit(report, not_reached=not_reached), xml_for_stdout),
    "markdown": Format("--markdown", "the Markdown report",
                       lambda report, out, not_reached: markdown(report, out.layers)),
}
STDOUT_REPORTS = tuple(FORMATS)  # the reports that '-' sends to stdout


def check_outputs(out: Reports) -> None:
    """Report paths that can be found bad before any model loads: two reports on stdout, unwritable paths."""
    on_stdout = [f"--{k} -" for k in STDOUT_REPORTS if getattr(out, k) == "-"]
    if len(on_stdout) > 1:
        raise PrefillDiffError(f"{' and '.join(on_stdout)} all ask for stdout; send all but one of them to a file"
                               if len(on_stdout) > 2 else
                               f"{' and '.join(on_stdout)} both ask for stdout; send one of them to a file")
    for key, fmt in FORMATS.items():
        check_output_file(getattr(out, key), f"{fmt.option} ({fmt.what})")
    _check_plot(out.plot)


def stdout_taken(out: Reports) -> bool:
    """A machine report goes to stdout ('-'): the human report is not printed, nothing else is written there."""
    return any(getattr(out, k) == "-" for k in STDOUT_REPORTS)


PLOT_FORMATS = (".png", ".svg", ".pdf")


def writable_dir(d: str, what: str) -> None:
    """d exists, is a directory, and a file can be created in it (probed: permissions, read-only mounts, /proc)."""
    if not os.path.isdir(d):
        raise PrefillDiffError(f"cannot write {what}: {d} is not a directory" if os.path.exists(d) else
                               f"cannot write {what}: directory {d} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".prefill-diff-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {what}: directory {d} is not writable ({e.strerror})") from None


def check_output_file(path, what: str, force: bool = True) -> None:
    """An output file can be written where it is asked for; checked before any work, so no verdict is lost."""
    if path is None or path == "-":
        return
    path = str(path)
    check_name_length(path, what)
    if os.path.isdir(path):
        raise PrefillDiffError(f"cannot write {what} {path}: it is a directory")
    if os.path.exists(path):
        if not force:
            raise TraceExistsError(f"{path} exists; pass --force to overwrite it")
        if not os.access(path, os.W_OK):
            raise PrefillDiffError(f"cannot write {what} {path}: permission denied")
        if what != "the trace":  # an existing report file (or /dev/stdout) is written in place
            return
    writable_dir(os.path.dirname(os.path.abspath(path)), f"{what} {path}")


def _check_plot(plot_path) -> None:
    if plot_path is not None:
        if importlib.util.find_spec("matplotlib") is None:  # found now, not after the run
            raise PrefillDiffError(f"--plot {plot_path} needs matplotlib, which is not installed: "
                                   "pip install 'prefill-diff[plot]'")
        ext = os.path.splitext(str(plot_path))[1].lower()
        if ext not in PLOT_FORMATS:
            raise PrefillDiffError(f"--plot {plot_path}: unsupported format {ext or '(no extension)'!r} "
                                   f"(use {', '.join(PLOT_FORMATS)})")
        check_output_file(plot_path, "--plot (the plot)")


def check_out_dir(out_dir) -> None:
    """run --out DIR: created now (with parents) and probed, before any model is loaded."""
    if out_dir is None:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise PrefillDiffError(f"--out {out_dir}: cannot create the directory ({e.strerror})") from None
    writable_dir(out_dir, f"traces into --out {out_dir}")


def emit(report, out: Reports, console, not_reached=(), preface: str | None = None) -> int:
    """Write machine reports, print the human one on ``console`` (after the line ``preface``, if any); returns the
    exit status of the verdict: 0 pass, 1 fail, 2 for traces that cannot be compared (docs/report-format.md).

    Files are written first (reports, plot, the step summary), stdout last, so that a reader of stdout that goes
    away (``| head -1``) loses nothing written to files, and the command still exits with the verdict's status.
    ``not_reached``: layers a --fail-fast run never compared (JUnit marks them skipped). Under ``--strict`` the
    report itself holds an INCONCLUSIVE pass as a failure, so every format says the same verdict.
    """
    report = replace(report, strict=bool(out.strict))
    status = EXIT_BAD_INPUT if report.incomparable else EXIT_PASS if report else EXIT_FAIL
    keep_status_if_stdout_closes(status)
    write_reports(report, out, not_reached, to_stdout=False)
    if out.plot:
        plot_errors(report, out.plot)
    github_actions(report, out)
    write_reports(report, out, not_reached, to_stdout=True)
    if not stdout_taken(out):
        if out.quiet:
            print_line(console, verdict_text(report), (" | ",))
        else:
            if preface:
                print_line(console, plain(preface, style="dim"))
            print_report(console, report, which=out.layers, verbose=out.verbose)
    return status


def write_reports(report, out: Reports, not_reached=(), to_stdout: bool | None = None) -> None:
    """Every text report asked for (FORMATS), each to its file or ('-') to stdout; ``to_stdout`` True or False:
    only those that go to stdout, or only those that go to files."""
    for key, fmt in FORMATS.items():
        dest = getattr(out, key)
        if not dest or (to_stdout is not None and (dest == "-") != to_stdout):
            continue
        text = fmt.text(report, out, not_reached)
        if dest == "-":
            click.echo(fmt.for_stdout(text), nl=False)
        else:
            write_text(dest, text)


def github_actions(report, out: Reports) -> None:
    """On GitHub Actions: the Markdown report appended to $GITHUB_STEP_SUMMARY, and an ``::error`` line for a
    failed verdict (on stdout, where the runner reads commands; on stderr when stdout carries a report)."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            with open(summary, "a", encoding="utf-8") as f:
                f.write(markdown(report, out.layers) + "\n")
        except OSError as e:  # the verdict still stands: say so on stderr, never lose the exit status
            click.echo(f"warning: cannot append the step summary to {visible(summary)} ({e.strerror})", err=True)
    line = workflow_error(report) if os.environ.get("GITHUB_ACTIONS") == "true" else None
    if line is not None:
        click.echo(line, err=stdout_taken(out))


def write_text(path, text):
    """``text`` into the file at ``path``, whole or not at all: a regular file (or a new one) is written beside
    itself and renamed into place, so that a full disk leaves no truncated report; anything else (a FIFO,
    /dev/stderr, a symbolic link: renaming over it would replace the link, not write where it points) is
    written as it is."""
    path = os.fspath(path)
    try:
        regular = not os.path.lexists(path) or (os.path.isfile(path) and not os.path.islink(path))
    except OSError:
        regular = False
    if not regular:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise PrefillDiffError(f"cannot write {path}: {e.strerror}") from None
        return
    tmp = partial_sibling(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise PrefillDiffError(f"cannot write {path}: {e.strerror}") from None
