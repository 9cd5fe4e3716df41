"""cli/outputs.py: where a verdict goes. Output paths are checked before any work with precise refusals, each
text report is written to its file or to stdout ('-'), files are replaced whole or not at all, and emit's exit
status follows the verdict."""
from __future__ import annotations

import errno
import io
import json
import os
import re
import stat
import sys
import threading
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from rich.console import Console

from prefill_diff.cli import outputs
from prefill_diff.cli.outputs import (FORMATS, STDOUT_REPORTS, Reports, check_out_dir, check_output_file,
                                      check_outputs, emit, stdout_taken, write_reports, write_text)
from prefill_diff.cli.terminal import TextOut
from prefill_diff.dumps.placement import TraceExistsError
from prefill_diff.engine.shared.errors import PrefillDiffError
from prefill_diff.verify.report import compare_traces

from ..verify._traces import make_spec, policy, record

CANNOT_SHOW = "the injected fault cannot show on this model"


def _report(kind: str = "fail", n_layers: int = 1, ref_name: str = "ref", strict: bool = False):
    """A Report of two small traces. fail: layer 0's mid differs by 0.5 at sample 1, token 2, channel 3;
    incomparable: the candidate's dim is 12, not 8; inconclusive: the candidate recorded a fault that cannot
    show; fail-at-1: layer 1's mid differs (of three layers)."""
    ref = make_spec(n_layers=n_layers)
    cand = ref.copy()
    if kind == "fail":
        cand.row("mid", 1, 2)[3] += 0.5
    elif kind == "fail-at-1":
        cand.row("mid", 1, 2, layer=1)[3] += 0.5
    elif kind == "incomparable":
        cand = make_spec(n_layers=n_layers, dim=12)
    elif kind == "inconclusive":
        cand.meta["record"] = {"fault": {"cannot_show": CANNOT_SHOW}}
    report = compare_traces(record(ref, name=ref_name), record(cand, name="cand"), policy())
    return replace(report, strict=strict)


def _console():
    return Console(file=io.StringIO(), width=200, color_system=None)


def _layer_rows(md: str) -> list[int]:
    """The layer numbers of the Markdown per-layer table's rows."""
    table = md.split("#### Per-layer", 1)[1].split("####", 1)[0]
    return [int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", table, re.M)]


# -- the formats -----------------------------------------------------------------------------------------------

def test_every_text_report_is_a_field_of_reports_with_its_option():
    assert list(FORMATS) == ["json", "junit", "markdown"] == list(STDOUT_REPORTS)
    assert {k: (f.option, f.what) for k, f in FORMATS.items()} == {
        "json": ("--json", "the JSON report"), "junit": ("--junit", "the JUnit report"),
        "markdown": ("--markdown", "the Markdown report")}
    assert all(hasattr(Reports(), k) for k in FORMATS)


def _check_json(text: str):
    d = json.loads(text)
    assert d["verdict"] == "fail"
    fb = d["first_break"]
    assert (fb["layer"], fb["tensor"], fb["sample"], fb["position"], fb["channel"]) == (0, "mid", 1, 2, 3)
    assert fb["max_abs_error"] == pytest.approx(0.5, abs=1e-6)


def _check_junit(text: str):
    root = ET.fromstring(text)
    assert root.tag == "testsuites" and root.get("failures") == "1"
    failed = [tc.get("name") for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert failed == ["layer 000"]


def _check_markdown(text: str):
    assert text.splitlines()[0] == "### prefill-diff: FAILED"
    assert "layer 0 mid" in text


CHECKS = {"json": _check_json, "junit": _check_junit, "markdown": _check_markdown}


@pytest.mark.parametrize("key", list(FORMATS))
def test_each_report_is_written_to_its_file_and_nothing_else(key, tmp_path, capsys):
    path = tmp_path / f"report.{key}"
    write_reports(_report(), Reports(**{key: str(path)}))
    CHECKS[key](path.read_text(encoding="utf-8"))
    assert os.listdir(tmp_path) == [path.name]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("key", list(FORMATS))
def test_each_report_goes_to_stdout_for_a_dash_as_in_its_file(key, tmp_path, capsys):
    report = _report()
    write_reports(report, Reports(**{key: "-"}))
    out = capsys.readouterr().out
    CHECKS[key](out)
    write_reports(report, Reports(**{key: str(tmp_path / "r")}))
    in_file = (tmp_path / "r").read_text(encoding="utf-8")
    assert out == (in_file + "\n" if key == "json" else in_file)  # JSON ends its line on stdout


def test_several_reports_each_go_to_their_own_destination(tmp_path, capsys):
    report = _report()
    write_reports(report, Reports(json=str(tmp_path / "r.json"), junit="-", markdown=str(tmp_path / "r.md")))
    _check_junit(capsys.readouterr().out)
    _check_json((tmp_path / "r.json").read_text(encoding="utf-8"))
    _check_markdown((tmp_path / "r.md").read_text(encoding="utf-8"))


def test_junit_on_an_ascii_stdout_writes_character_references(monkeypatch):
    """A trace name with é and ✓ on a stdout that holds only ASCII: still XML, and the same text when parsed."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", TextOut(stream))
    write_reports(_report("pass", ref_name="réf ✓"), Reports(junit="-"))
    stream.flush()
    data = raw.getvalue()
    assert max(data) < 128 and b"&#233;" in data and b"&#10003;" in data
    suite = ET.fromstring(data.decode("ascii")).find("testsuite")
    assert suite.get("name") == "prefill-diff: réf ✓ vs cand"


@pytest.mark.parametrize("layers,rows", [("all", [0, 1, 2]), ("failing", [1]), ("auto", [0, 1, 2])])
def test_markdown_shows_the_layer_rows_that_layers_asks_for(layers, rows, tmp_path):
    path = tmp_path / "r.md"
    write_reports(_report("fail-at-1", n_layers=3), Reports(markdown=str(path), layers=layers))
    assert _layer_rows(path.read_text(encoding="utf-8")) == rows


# -- checks before any work ------------------------------------------------------------------------------------

@pytest.mark.parametrize("given,message", [
    ({"json": "-", "junit": "-"}, "--json - and --junit - both ask for stdout; send one of them to a file"),
    ({"junit": "-", "markdown": "-"}, "--junit - and --markdown - both ask for stdout; send one of them to a file"),
    ({"json": "-", "markdown": "-", "plot": "p.png"},
     "--json - and --markdown - both ask for stdout; send one of them to a file"),
    ({"json": "-", "junit": "-", "markdown": "-"},
     "--json - and --junit - and --markdown - all ask for stdout; send all but one of them to a file"),
])
def test_two_reports_on_stdout_are_refused(given, message):
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(**given))
    assert str(e.value) == message


@pytest.mark.parametrize("key", list(FORMATS))
def test_one_report_on_stdout_is_allowed_and_takes_stdout(key, tmp_path):
    others = {k: str(tmp_path / f"r.{k}") for k in FORMATS if k != key}
    out = Reports(**{key: "-"}, **others)
    check_outputs(out)
    assert stdout_taken(out)
    assert not stdout_taken(Reports(**others)) and not stdout_taken(Reports(plot="-"))


def test_bad_paths_are_refused_naming_the_option_the_path_and_why(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = {
        str(tmp_path): f"cannot write --json (the JSON report) {tmp_path}: it is a directory",
        str(tmp_path / "no" / "r.json"):
            f"cannot write --json (the JSON report) {tmp_path / 'no' / 'r.json'}: directory {tmp_path / 'no'} "
            "does not exist",
        str(tmp_path / "file" / "r.json"):
            f"cannot write --json (the JSON report) {tmp_path / 'file' / 'r.json'}: {tmp_path / 'file'} is not a "
            "directory",
        str(tmp_path / ("a" * 300 + ".json")):
            "cannot write --json (the JSON report): its file name is 305 bytes, more than the 255 the file system "
            f"allows ({'a' * 40}...)",
    }
    for path, message in cases.items():
        with pytest.raises(PrefillDiffError) as e:
            check_outputs(Reports(json=path))
        assert str(e.value) == message


@pytest.mark.parametrize("key", ["junit", "markdown"])
def test_each_report_is_checked_under_its_own_name(key, tmp_path):
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(**{key: str(tmp_path)}))
    assert str(e.value) == f"cannot write {FORMATS[key].option} ({FORMATS[key].what}) {tmp_path}: it is a directory"


def test_a_directory_where_no_file_can_be_created_is_refused_with_the_os_reason(tmp_path, monkeypatch):
    """The directory is probed by creating a file in it; the probe's error is the reason given."""
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)
    path = tmp_path / "r.md"
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(markdown=str(path)))
    assert str(e.value) == (f"cannot write --markdown (the Markdown report) {path}: directory {tmp_path} is not "
                            "writable (Permission denied)")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_read_only_file_system_directory_is_refused():
    """/proc takes no new file, even for root."""
    with pytest.raises(PrefillDiffError, match=r"^cannot write --junit \(the JUnit report\) /proc/r\.xml: directory "
                                               r"/proc is not writable \(.+\)$"):
        check_outputs(Reports(junit="/proc/r.xml"))


def test_an_existing_report_is_written_in_place_without_probing_but_a_trace_is_probed(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old")
    probes = []

    def refuse(*a, **k):
        probes.append(k.get("dir"))
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)
    check_output_file(path, "--json (the JSON report)")
    assert probes == []
    with pytest.raises(PrefillDiffError) as e:
        check_output_file(path, "the trace")
    assert str(e.value) == f"cannot write the trace {path}: directory {tmp_path} is not writable (Read-only file system)"
    assert probes == [str(tmp_path)]


def test_an_existing_file_without_write_permission_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old")
    real = os.access
    monkeypatch.setattr(outputs.os, "access", lambda p, mode, **k: False if os.fspath(p) == str(path) and
                        mode == os.W_OK else real(p, mode, **k))
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(json=str(path)))
    assert str(e.value) == f"cannot write --json (the JSON report) {path}: permission denied"


def test_an_existing_file_without_force_is_refused(tmp_path):
    path = tmp_path / "t.h5"
    check_output_file(path, "the trace", force=False)  # absent: fine
    path.write_bytes(b"")
    with pytest.raises(TraceExistsError) as e:
        check_output_file(path, "the trace", force=False)
    assert str(e.value) == f"{path} exists; pass --force to overwrite it"


def test_stdout_and_no_path_are_not_files_to_check():
    for path in (None, "-"):
        check_output_file(path, "--json (the JSON report)", force=False)


@pytest.mark.parametrize("name,ext", [("p.txt", "'.txt'"), ("p", "'(no extension)'"), ("p.png.gz", "'.gz'")])
def test_a_plot_in_an_unsupported_format_is_refused(name, ext, tmp_path):
    path = tmp_path / name
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(plot=str(path)))
    assert str(e.value) == f"--plot {path}: unsupported format {ext} (use .png, .svg, .pdf)"


def test_a_plot_path_is_checked_like_a_report(tmp_path):
    for name in ("p.png", "p.SVG", "p.Pdf"):
        check_outputs(Reports(plot=str(tmp_path / name)))
    path = tmp_path / "missing" / "p.png"
    with pytest.raises(PrefillDiffError) as e:
        check_outputs(Reports(plot=str(path)))
    assert str(e.value) == f"cannot write --plot (the plot) {path}: directory {tmp_path / 'missing'} does not exist"


def test_out_dir_is_created_with_parents_or_refused(tmp_path):
    d = tmp_path / "a" / "b"
    check_out_dir(str(d))
    assert d.is_dir()
    check_out_dir(None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrefillDiffError) as e:
        check_out_dir(str(tmp_path / "file"))
    assert str(e.value) == f"--out {tmp_path / 'file'}: cannot create the directory (File exists)"


# -- write_text: whole or not at all ---------------------------------------------------------------------------

def test_write_text_creates_and_replaces_a_file_leaving_nothing_beside_it(tmp_path):
    path = tmp_path / "r.md"
    write_text(path, "first ✓\n")
    assert path.read_text(encoding="utf-8") == "first ✓\n"
    write_text(str(path), "second")
    assert path.read_text(encoding="utf-8") == "second"
    assert os.listdir(tmp_path) == ["r.md"]


def test_a_failed_replacement_keeps_the_old_file_whole_and_leaves_no_partial(tmp_path, monkeypatch):
    """A full disk at the rename: the old report stays as it was, the partial file is removed."""
    path = tmp_path / "r.json"
    path.write_text("old report")

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(outputs.os, "replace", full)
    with pytest.raises(PrefillDiffError) as e:
        write_text(path, "new report")
    assert str(e.value) == f"cannot write {path}: {os.strerror(errno.ENOSPC)}"
    assert path.read_text() == "old report"
    assert os.listdir(tmp_path) == ["r.json"]


def test_writing_into_a_missing_directory_is_refused_and_creates_nothing(tmp_path):
    path = tmp_path / "missing" / "r.json"
    with pytest.raises(PrefillDiffError) as e:
        write_text(path, "x")
    assert str(e.value) == f"cannot write {path}: {os.strerror(errno.ENOENT)}"
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_written_as_it_is(tmp_path):
    """No file beside it, no rename: the reader at the other end gets the text and the FIFO stays a FIFO."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()), daemon=True)
    reader.start()
    write_text(fifo, "through the pipe ✓")
    reader.join(timeout=10)
    assert got == ["through the pipe ✓"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]


def test_a_link_to_a_regular_file_is_written_through(tmp_path):
    """As --json /dev/stdout with stdout redirected to a file: the file the link names gets the report."""
    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


# -- emit: the reports, the human one, the exit status ---------------------------------------------------------

@pytest.mark.parametrize("kind,strict,status", [
    ("pass", False, 0), ("pass", True, 0),
    ("fail", False, 1), ("fail", True, 1),
    ("incomparable", False, 2), ("incomparable", True, 2),
    ("inconclusive", False, 0), ("inconclusive", True, 1),
])
def test_emit_returns_the_exit_status_of_the_verdict(kind, strict, status):
    """0 pass, 1 fail, 2 traces that cannot be compared; --strict makes an INCONCLUSIVE pass a failure."""
    assert emit(_report(kind), Reports(quiet=True, strict=strict), _console()) == status


def test_strict_is_the_verdict_of_every_format(tmp_path):
    """Under --strict an INCONCLUSIVE pass is a failure in the JSON and JUnit reports too."""
    out = Reports(json=str(tmp_path / "r.json"), junit=str(tmp_path / "r.xml"), quiet=True, strict=True)
    emit(_report("inconclusive"), out, _console())
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["verdict"] == "fail" and d["inconclusive"] == [CANNOT_SHOW]
    root = ET.fromstring((tmp_path / "r.xml").read_text())
    assert root.get("failures") == "1"
    case = next(tc for tc in root.iter("testcase") if tc.find("failure") is not None)
    assert case.get("name") == "inconclusive (strict)" and case.find("failure").text == CANNOT_SHOW
    not_strict = Reports(json=str(tmp_path / "r.json"), quiet=True)
    emit(_report("inconclusive"), not_strict, _console())
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "pass"


def test_quiet_prints_only_the_verdict_line():
    console = _console()
    emit(_report("fail"), Reports(quiet=True), console)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAILED | layer 0 mid | sample 1 pos 2 | max_abs=5.0e-01")


def test_the_human_report_is_printed_unless_a_report_takes_stdout(capsys):
    console = _console()
    emit(_report("fail"), Reports(), console)
    shown = console.file.getvalue()
    assert "FAILED | layer 0 mid" in shown and len(shown.splitlines()) > 5
    assert capsys.readouterr().out == ""
    console = _console()
    assert emit(_report("fail"), Reports(json="-"), console) == 1
    assert console.file.getvalue() == ""
    _check_json(capsys.readouterr().out)


def test_on_github_actions_a_failure_is_annotated_and_summarised(tmp_path, monkeypatch, capsys):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert emit(_report("fail"), Reports(quiet=True), _console()) == 1
    out = capsys.readouterr()
    errors = [ln for ln in out.out.splitlines() if ln.startswith("::error")]
    assert len(errors) == 1 and errors[0].startswith("::error title=prefill-diff%3A layer 0 mid::FAILED | layer 0 mid")
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("earlier step\n### prefill-diff: FAILED\n")


def test_on_github_actions_the_annotation_goes_to_stderr_when_stdout_carries_a_report(monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    emit(_report("fail"), Reports(json="-"), _console())
    out = capsys.readouterr()
    _check_json(out.out)
    assert out.err.startswith("::error title=prefill-diff%3A layer 0 mid::")


def test_on_github_actions_a_pass_is_not_annotated(monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert emit(_report("pass"), Reports(quiet=True), _console()) == 0
    out = capsys.readouterr()
    assert "::error" not in out.out + out.err


def test_an_unwritable_step_summary_is_a_warning_and_the_verdict_stands(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))  # a directory
    assert emit(_report("fail"), Reports(quiet=True), _console()) == 1
    err = capsys.readouterr().err
    assert err == f"warning: cannot append the step summary to {tmp_path} ({os.strerror(errno.EISDIR)})\n"
