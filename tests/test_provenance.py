"""Provenance: the version, command line and time that traces and JSON reports record, and `--version`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import pytest

from prefill_diff.dumps import provenance as prov
from prefill_diff.engine.shared.errors import ConfigError


def test_time_honours_source_date_epoch(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert prov.timestamp() == "2023-11-14T22:13:20Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "")  # empty: unset, as reproducible-build tools read it
    assert prov.timestamp().endswith("Z") and prov.timestamp() != "2023-11-14T22:13:20Z"


@pytest.mark.parametrize("bad", ["yesterday", "-5", "1.5", "99999999999999"])
def test_a_bad_source_date_epoch_is_refused(monkeypatch, bad):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", bad)
    with pytest.raises(ConfigError, match=r"SOURCE_DATE_EPOCH must be a whole number of seconds"):
        prov.timestamp()


def test_record_refuses_a_bad_source_date_epoch_before_recording(run_cli, tmp_path, monkeypatch):
    from prefill_diff import jobs
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "tomorrow")
    monkeypatch.setattr(jobs, "_import_sides", lambda: pytest.fail("the model was loaded"))
    res = run_cli("record", "reference", "-o", tmp_path / "t.h5")
    assert res.exit_code == 2 and "SOURCE_DATE_EPOCH must be" in res.output and "'tomorrow'" in res.output
    assert not (tmp_path / "t.h5").exists()


def test_command_line_is_text_whatever_the_arguments():
    argv = ["/usr/local/bin/prefill-diff", "run", "a b", "\udcff[red]x", "\x1b[31m"]
    text = prov.command_line(argv)
    assert text.startswith("prefill-diff run 'a b' ") and "\\xff[red]x" in text
    text.encode("utf-8")  # no lone surrogates: storable as JSON text and UTF-8
    long = prov.command_line(["prefill-diff", "--tokens", ",".join(["5"] * 10_000)])
    assert len(long) < prov.ARGV_LIMIT + 40 and long.endswith("characters in all)")


def _record(tmp_path, name, *extra, epoch="1700000000"):
    """`record` in a new process (its own command line), with SOURCE_DATE_EPOCH set."""
    out = tmp_path / name
    env = {**os.environ, "SOURCE_DATE_EPOCH": epoch}
    res = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "record", "reference", "-o", out,
                          "--tokens", "5,6,7", *extra], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.slow
def test_a_trace_records_version_command_line_and_time(tmp_path, run_cli):
    path = _record(tmp_path, "[bold]t.h5")
    with h5py.File(path) as f:
        p = json.loads(f.attrs["meta"])["provenance"]
    assert p["version"] == prov.version() and p["version"] != "unknown"
    assert p["time"] == "2023-11-14T22:13:20Z"
    assert p["argv"] == f"python -m prefill_diff.cli.main record reference -o '{path}' --tokens 5,6,7"
    res = run_cli("inspect", path)  # the command line is shown as plain text: its [bold] stays as typed
    assert res.exit_code == 0 and f"recorded by prefill-diff {p['version']} at {p['time']}: {p['argv']}" in res.output


@pytest.mark.slow
def test_two_recordings_with_source_date_epoch_have_the_same_metadata(tmp_path):
    a, b = _record(tmp_path, "a.h5"), _record(tmp_path, "b.h5")
    with h5py.File(a) as fa, h5py.File(b) as fb:
        ma, mb = json.loads(fa.attrs["meta"]), json.loads(fb.attrs["meta"])
    assert ma.pop("provenance")["argv"].replace("a.h5", "b.h5") == mb.pop("provenance")["argv"]
    assert ma == mb


@pytest.mark.slow
def test_the_json_report_records_its_provenance_and_each_trace_s(tmp_path, run_cli, monkeypatch):
    ref = _record(tmp_path, "ref.h5", epoch="86400")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    res = run_cli("compare", ref, ref, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["provenance"]["time"] == "1970-01-01T00:00:00Z" and r["provenance"]["version"] == prov.version()
    assert isinstance(r["provenance"]["argv"], str)
    assert r["reference"]["provenance"]["time"] == "1970-01-02T00:00:00Z"


def test_version_names_torch_and_python_without_importing_torch():
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "try:\n    cli(['--version'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    import platform
    from importlib import metadata
    assert lines[0] == f"prefill-diff, version {prov.version()}"
    assert f"torch {metadata.version('torch')}, Python {platform.python_version()}" in lines
    assert lines[-1] == "False", out.stdout + out.stderr
