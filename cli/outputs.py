"""Where a verdict goes: output paths checked before any work, then the JSON, JUnit, plot and human reports."""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import click

from ..dumps.recorder import TraceExistsError
from ..engine.errors import PrefillDiffError
from ..verify.junit import to_junit
from ..verify.plot import plot_errors  # matplotlib itself is imported only when a plot is drawn
from .render import print_line, print_report, verdict_text
from .terminal import xml_for_stdout

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def check_outputs(out: dict) -> None:
    """Report paths that can be found bad before any model loads: two reports on stdout, unwritable paths."""
    if out["json"] == "-" and out["junit"] == "-":
        raise PrefillDiffError("--json - and --junit - both ask for stdout; send one of them to a file")
    _check_reports(out["json"], out["junit"], out["plot"])


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


def _check_reports(json_path, junit_path, plot_path) -> None:
    check_output_file(json_path, "--json (the JSON report)")
    check_output_file(junit_path, "--junit (the JUnit report)")
    if plot_path is not None:
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


def emit(report, out: dict, console, not_reached=()) -> int:
    """Write machine reports, print the human one on ``console``; returns the exit status of the verdict.

    ``not_reached``: layers a --fail-fast run never compared (JUnit marks them skipped). Under ``--strict`` the
    report itself holds an INCONCLUSIVE pass as a failure, so every format says the same verdict.
    """
    report = replace(report, strict=bool(out["strict"]))
    if out["json"] == "-":
        click.echo(report.to_json())
    elif out["json"]:
        write_text(out["json"], report.to_json())
    if out["junit"] == "-":
        click.echo(xml_for_stdout(to_junit(report, not_reached=not_reached)), nl=False)
    elif out["junit"]:
        write_text(out["junit"], to_junit(report, not_reached=not_reached))
    if out["plot"]:
        plot_errors(report, out["plot"])
    if "-" not in (out["json"], out["junit"]):
        if out["quiet"]:
            print_line(console, verdict_text(report), (" | ",))
        else:
            print_report(console, report, which=out["layers"], verbose=out["verbose"])
    if report.incomparable:
        return EXIT_BAD_INPUT  # incomparable traces (docs/report-format.md): reported, not a tolerance verdict
    return EXIT_PASS if report else EXIT_FAIL


def write_text(path, text):
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e.strerror}") from None
