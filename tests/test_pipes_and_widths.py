"""A reader that goes away keeps the verdict's exit status; optional outputs are checked before any work; piped
output honours COLUMNS and never breaks a phrase; progress on a pipe is one line per phase (-q: none); inspect's
and cache prune's words say what they show."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from prefill_diff.cli.main import cli

ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY")}
CMD = [sys.executable, "-m", "prefill_diff.cli.main"]


def closed_stdout(args, **kw) -> subprocess.CompletedProcess:
    """Run the CLI with a stdout whose reader has already gone (`| head -0`): every write meets EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(CMD + list(args), stdout=w, stderr=subprocess.PIPE, text=True, env=kw.get("env", ENV),
                              timeout=600)
    finally:
        os.close(w)


def first_line(args) -> tuple[int, str]:
    """`CMD | head -1` under pipefail: the exit status of CMD and the line head printed."""
    script = "set -o pipefail; " + " ".join(f"'{a}'" for a in CMD + list(args)) + " | head -1"
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=ENV, timeout=600)
    return res.returncode, res.stdout


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipes")
    for name, preset in (("ref", "reference"), ("cand", "batched-left"), ("bad", "fault:skip-kv")):
        res = CliRunner().invoke(cli, ["record", preset, "-o", str(d / f"{name}.h5")])
        assert res.exit_code == 0, res.output
    return d


# -- a closed stdout keeps the verdict's status ------------------------------------------------------------

@pytest.mark.parametrize("cand, status", [("cand", 0), ("bad", 1)])
def test_compare_into_a_closed_pipe_exits_with_the_verdict(traces, cand, status):
    for extra in ((), ("-q",), ("--json", "-"), ("--junit", "-"), ("-v",)):
        res = closed_stdout(["compare", str(traces / "ref.h5"), str(traces / f"{cand}.h5"), *extra])
        assert res.returncode == status, (extra, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr


def test_compare_under_head_keeps_a_pass_and_a_failure(traces):
    rc, line = first_line(["compare", str(traces / "ref.h5"), str(traces / "cand.h5")])
    assert rc == 0 and line.startswith("reference:"), (rc, line)
    rc, line = first_line(["compare", str(traces / "ref.h5"), str(traces / "bad.h5")])
    assert rc == 1 and line.startswith("reference:"), (rc, line)


def test_reports_to_files_are_written_though_stdout_is_closed(traces, tmp_path):
    res = closed_stdout(["compare", str(traces / "ref.h5"), str(traces / "bad.h5"), "--json",
                         str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    assert res.returncode == 1 and (tmp_path / "r.json").stat().st_size > 0 and (tmp_path / "r.xml").exists()


def test_inspect_and_listings_into_a_closed_pipe_exit_0(traces):
    for args in (["inspect", str(traces / "ref.h5")], ["inspect", str(traces / "ref.h5"), "--json"],
                 ["docs", "contract"]):
        res = closed_stdout(args)
        assert res.returncode == 0 and "Exception ignored" not in res.stderr, (args, res.returncode, res.stderr)
    rc, line = first_line(["inspect", str(traces / "ref.h5")])
    assert rc == 0 and str(traces / "ref.h5") in line


@pytest.mark.slow
def test_run_under_head_exits_with_the_verdict():
    rc, line = first_line(["run", "reference", "batched-left"])
    assert rc == 0 and line.startswith("reference:"), (rc, line)
    res = closed_stdout(["run", "reference", "fault:skip-kv", "-q"])
    assert res.returncode == 1, res.stderr


# -- optional outputs are checked before any work -------------------------------------------------------

def test_plot_without_matplotlib_is_refused_before_any_work(monkeypatch, tmp_path):
    import importlib.util
    from prefill_diff import jobs
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    ran = []
    monkeypatch.setattr(jobs, "run", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(jobs, "compare", lambda *a, **k: ran.append(1))
    for args in (["run", "reference", "batched-left"], ["compare", "a.h5", "b.h5"]):
        res = CliRunner().invoke(cli, [*args, "--plot", str(tmp_path / "e.png"), "--json", str(tmp_path / "r.json")])
        assert res.exit_code == 2 and "--plot" in res.output and "pip install 'prefill-diff[plot]'" in res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert ran == [] and not (tmp_path / "r.json").exists()


# -- widths when piped --------------------------------------------------------------------------------------

def test_inspect_values_honour_columns_when_piped(traces):
    args = ["inspect", str(traces / "ref.h5"), "--layer", "2", "--tensor", "mlp_update", "--sample", "1",
            "--channel", "0-20"]
    for cols in (60, 80):
        res = subprocess.run(CMD + args, capture_output=True, text=True, env=dict(ENV, COLUMNS=str(cols)))
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        values = [l for l in lines if re.match(r"^\s+\d+\s+-?\d", l)]
        assert values and max(len(l) for l in values) <= cols, max(map(len, lines))
        assert "ch 20" in res.stdout  # every asked channel is shown, in blocks


def test_verbose_metric_lines_are_whole_when_piped(traces):
    res = subprocess.run(CMD + ["compare", str(traces / "ref.h5"), str(traces / "bad.h5"), "-v", "--layers",
                                "failing"], capture_output=True, text=True, env=dict(ENV, COLUMNS="80"))
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    metric = [l for l in lines if re.match(r"^(layer_input|attn_update|mid|mlp_update|layer_output) \(", l)]
    assert len(metric) >= 4, res.stdout
    for l in metric:  # one line each: no phrase broken onto the next line
        assert "would pass with" in l or "not compared" in l, l
    assert not any(re.match(r"^(of the row norm|channel|rtol|or row_rtol)", l) for l in lines), res.stdout


def test_nothing_is_cut_at_80_columns(traces):
    res = subprocess.run(CMD + ["compare", str(traces / "ref.h5"), str(traces / "bad.h5"), "--layers", "failing"],
                         capture_output=True, text=True, env=dict(ENV, COLUMNS="80"))
    assert res.returncode == 1
    assert "…" not in res.stdout, res.stdout  # rich's mark of a cut cell
    table = [l for l in res.stdout.splitlines() if l.startswith((" layer", "     2", " ───", "╭", "│", "╰"))]
    assert len(table) >= 5 and max(len(l) for l in table) <= 80, table


# -- progress on a pipe ---------------------------------------------------------------------------------------

@pytest.mark.slow  # three whole processes of the CLI
def test_progress_on_a_pipe_is_one_line_per_phase_and_q_silences_it(tmp_path):
    res = subprocess.run(CMD + ["run", "reference", "batched-left"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0, res.stderr
    phases = res.stderr.splitlines()
    assert all(l.startswith("prefill-diff: ") and l.endswith(" s)") for l in phases), phases
    said = "\n".join(phases)
    for phase in ("loading the model", "reference: recording", "candidate: recording", "comparing"):
        assert phase in said, said
    assert "0/?" not in said and len(phases) < 12
    quiet = subprocess.run(CMD + ["run", "reference", "batched-left", "-q"], capture_output=True, text=True, env=ENV)
    assert quiet.returncode == 0 and quiet.stderr == ""
    rec = subprocess.run(CMD + ["record", "reference", "-o", str(tmp_path / "t.h5"), "-q"], capture_output=True,
                         text=True, env=ENV)
    assert rec.returncode == 0 and rec.stderr == "" and rec.stdout.startswith("wrote ")


def test_a_step_of_unknown_length_shows_no_count():
    from rich.progress import Progress as RichProgress
    from prefill_diff.cli.display import _Count
    p = RichProgress(disable=True)
    p.add_task("comparing", total=None)
    p.add_task("candidate: layers", total=4, completed=2)
    step, side = p.tasks
    assert _Count().render(step).plain == "" and _Count().render(side).plain == "2/4"


# -- words ------------------------------------------------------------------------------------------------------

def test_inspect_says_the_gathered_position_and_its_token(traces):
    res = subprocess.run(CMD + ["inspect", str(traces / "ref.h5")], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0
    assert "gathered at" in res.stdout and "gathered token" not in res.stdout
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.dumps.inspect import summarize
    with Trace(str(traces / "ref.h5")) as t:
        rows = summarize(t)["final"]
        ids = t.samples
    for r in rows:  # the position is the sample's last token; the id is the token there
        assert r["gathered_position"] == len(ids[r["sample"]]) - 1 and r["gathered_id"] == ids[r["sample"]][-1]
        assert re.search(rf"\b{r['sample']}\s+pos {r['gathered_position']} \(id {r['gathered_id']}\)", res.stdout)


def test_prune_all_dry_run_says_why_in_words_that_fit_would_remove():
    from prefill_diff.engine.models.cache_listing import _why_go
    intact = type("Item", (), {"state": "intact", "used": 0.0})()
    why = _why_go(intact, everything=True, older_than=None, now=0.0)
    assert why is not None and "--all" in why and "is removed" not in why, why  # "would remove X: --all asks ..."
