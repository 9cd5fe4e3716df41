"""What people and CI logs see (issue 17): unwrapped verdicts, fitted tables, marks without colour, --layers,
-v, the stats-level panel, JUnit/JSON on stdout, --strict, inspect's drill-down, flags refused up front,
progress only on a terminal, and the plot's data."""
from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from rich.console import Console

from prefill_diff.verify.formats.json_report import to_json
from prefill_diff.verify.formats.terminal import BAD, layer_table, print_report, shown_layers

ENV = {k: v for k, v in os.environ.items() if k != "COLUMNS"}


def render(report, width, **kw) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    print_report(console, report, **kw)
    return console.file.getvalue()


@pytest.fixture(scope="module")
def reports():
    from prefill_diff.jobs import run as run_pair
    return {c: run_pair("reference", c).report for c in ("fault:skip-kv", "fault:gqa-mapping", "batched-left")}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Traces of the reference at every level, and of fault:gqa-mapping at the stats level."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d = tmp_path_factory.mktemp("traces")
    out = {}
    for name, args in (("full", ("reference", "--level", "full")), ("sampled", ("reference", "--level", "sampled")),
                       ("stats", ("reference", "--level", "stats")),
                       ("gqa_stats", ("fault:gqa-mapping", "--level", "stats")),
                       ("seed", ("reference", "--model", "seed-2.8"))):
        out[name] = d / f"{name}.h5"
        res = CliRunner().invoke(cli, ["record", args[0], "-o", str(out[name]), *args[1:]])
        assert res.exit_code == 0, res.output
    return out


# -- lines that survive pipes and narrow terminals ------------------------------------------------

@pytest.mark.slow
def test_verdict_is_one_unwrapped_line_when_piped_at_any_width():
    for cols in (None, "40"):
        env = dict(ENV, **({"COLUMNS": cols} if cols else {}))
        out = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "run", "reference", "fault:skip-kv", "-q"],
                             capture_output=True, text=True, env=env)
        assert out.returncode == 1
        assert out.stdout.endswith("\n") and out.stdout.count("\n") == 1, out.stdout
        line = out.stdout.rstrip("\n")
        assert line == line.rstrip() and line.startswith("FAILED | layer 2 cache length | sample 0 pos 69 |")
        assert out.stderr == ""  # no progress display when stderr is not a terminal


@pytest.mark.slow
def test_header_verdict_and_notes_are_never_wrapped(reports):
    rep = reports["fault:skip-kv"]
    for width in (40, 80):
        lines = render(rep, width).splitlines()
        assert rep.verdict_line() in lines
        assert any(l.startswith("reference: reference (trace not kept, full level)  candidate: fault:skip-kv")
                   and l.endswith("policy: float32") for l in lines)
        for n in rep.notes:
            assert "note: " + n in lines


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_layer_table_drops_columns_by_priority_and_never_cuts_a_number(reports, width):
    rep = reports["fault:gqa-mapping"]
    out = render(rep, width)
    table = out.split("error growth")[0]
    assert "…" not in table
    shown = [w for w in ("layer_input", "cache_keys", "cache_values", "attn_update", "mid", "mlp_update",
                         "layer_output")]
    for lr in rep.layers:
        row = next(l for l in table.splitlines() if re.match(rf"\s*{lr.layer}\s", l))
        nums = re.findall(r"\d\.\de[+-]\d\d", row)
        assert all(len(n) == 7 for n in nums)
        assert len(nums) >= 2  # attn_update and layer_output are always kept
    if width < 120:
        m = re.search(r"columns not shown at width (\d+): ([a-z_, ]+)", out)
        assert m and int(m.group(1)) == width
        dropped = [d.strip() for d in m.group(2).split(",")]
        assert "layer_output" not in dropped and "attn_update" not in dropped
        assert all(d in shown for d in dropped)
        assert "layer_input" in dropped  # the first to go: it equals the previous layer's output
    rows = [l for l in table.split("columns not shown")[0].splitlines()[1:]  # header and rule lines never wrap
            if not l.startswith("rule: ")]
    assert max(len(l) for l in rows) <= width


def test_out_of_tolerance_cells_are_marked_without_colour(reports):
    bad = reports["fault:gqa-mapping"]
    table, _ = layer_table(bad, 200)
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(table)
    text = console.file.getvalue()
    row0 = next(l for l in text.splitlines() if re.match(r"\s*0\s", l))
    assert BAD not in render(reports["batched-left"], 200).split("(✗: out of tolerance)", 1)[1]  # past the title
    want = sum(1 for t in bad.layers[0].tensors if not t and t.tensor != "attn_heads")
    assert row0.count(BAD) == want > 0
    good = render(reports["batched-left"], 200)
    assert "PASSED" in good


def test_cache_column_shows_the_cache_length_break_in_its_row(reports):
    out = render(reports["fault:skip-kv"], 120).split("error growth")[0]
    rows = {int(m.group(1)): l for l in out.splitlines() if (m := re.match(r"\s*(\d)\s", l))}
    assert rows[2].rstrip().endswith("length" + BAD)
    assert all(rows[i].rstrip().endswith("ok") for i in (0, 1, 3))


def test_token_text_is_one_unbreakable_word():
    from prefill_diff.verify.formats.text import token_repr
    assert token_repr(" Paris") == "'␣Paris'" and " " not in token_repr(" a b\n")
    assert "\\n" in token_repr("\n")  # control characters visible


# -- --layers, -v, the stats-level panel ------------------------------------------------------------

@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 16-layer synthetic model; the candidate skips a KV write at layer 8."""
    from prefill_diff.jobs import run as run_pair
    d = tmp_path_factory.mktemp("deep")
    (d / "ref.toml").write_text('preset = "reference"\n[model]\nn_layers = 16\n')
    (d / "cand.toml").write_text('preset = "reference"\n[model]\nn_layers = 16\n[fault]\nname = "skip-kv"\nlayer = 8\n')
    return run_pair(str(d / "ref.toml"), str(d / "cand.toml")).report


@pytest.mark.slow
def test_layers_auto_shows_the_first_break_neighbourhood_and_counts_the_rest(deep):
    assert deep.first_break.layer == 8 and len(deep.layers) == 16
    assert shown_layers(deep, "auto") == [6, 7, 8, 9, 10, 15]
    assert shown_layers(deep, "all") == list(range(16))
    assert shown_layers(deep, "failing") == [lr.layer for lr in deep.layers if not lr]
    out = render(deep, 120)
    assert re.search(r"^\s*…\s*$", out, re.M)
    m = re.search(r"(\d+) more layers not shown \((\d+) within tolerance", out)
    assert m and int(m.group(1)) == 10 and int(m.group(2)) == sum(1 for i, lr in enumerate(deep.layers)
                                                                 if i not in (6, 7, 8, 9, 10, 15) and lr)
    full = render(deep, 120, which="all").split("error growth")[0]
    assert "more layers not shown" not in full
    assert sum(1 for l in full.splitlines() if re.match(r"\s*\d+\s+(\d|-)", l)) == 16


def test_layers_failing_on_a_pass_says_so_instead_of_an_empty_table(reports):
    out = render(reports["batched-left"], 120, which="failing")
    assert "--layers failing: no layer is out of tolerance (4 compared); --layers all shows every layer" in out
    assert "layer_" not in out and "more layers not shown" not in out
    failing = render(reports["fault:skip-kv"], 120, which="failing")
    assert "no layer is out of tolerance" not in failing and "layer_" in failing


@pytest.mark.slow
def test_compile_time_of_a_compiled_side_is_a_note(run_cli, traces, tmp_path):
    import shutil

    import h5py
    cand = tmp_path / "compiled.h5"
    shutil.copy(traces["full"], cand)
    with h5py.File(cand, "a") as f:
        meta = json.loads(f.attrs["meta"])
        meta["record"]["timing"] = {"compile_s": 12.34, "prefill_s": 0.0456}
        del f.attrs["meta"]
        f.attrs["meta"] = np.bytes_(json.dumps(meta))
    res = run_cli("compare", traces["full"], cand, "--json", tmp_path / "r.json")
    said = ("candidate: torch.compile took 12.3 s before the prefill (not in the prefill's time; the prefill itself "
            "took 0.0456 s)")
    assert res.exit_code == 0 and f"note: {said}" in res.output
    assert said in json.loads((tmp_path / "r.json").read_text())["notes"]
    assert "torch.compile" not in run_cli("compare", traces["full"], traces["full"]).output


@pytest.mark.slow
def test_top_ids_not_in_the_other_sides_top_5_are_marked_in_words(reports):
    from prefill_diff.jobs import run as run_pair
    from prefill_diff.verify.formats.terminal import final_table
    rep = run_pair("reference", "fault:last-column").report
    assert any(set(r[:5]) != set(c[:5]) for _, r, c in rep.final.top)
    assert any(set(r[:5]) == set(c[:5]) for _, r, c in rep.final.top)

    def words(ids, other):
        return " ".join(f"{i}*" if i not in other[:5] else str(i) for i in ids[:5])
    for width in (120, 50):  # side by side, and the narrow layout (reference above candidate)
        console = Console(width=width, file=io.StringIO(), color_system=None)
        console.print(final_table(rep, width))
        lines = console.file.getvalue().splitlines()
        assert lines[-1].strip() == "*: not in the other side's top 5"
        for s, r, c in rep.final.top:
            at = next(n for n, line in enumerate(lines) if re.match(rf"\s*{s}\s", line))
            row = " ".join(lines[at:at + 2])
            assert f"{words(r, c)} " in row + " " and f"{words(c, r)} " in row + " ", (width, row)
    assert "*" not in render(reports["batched-left"], 120).split("final logits")[1]


def test_verbose_prints_every_metric_of_the_failing_layer(reports):
    rep = reports["fault:gqa-mapping"]
    out = " ".join(render(rep, 100, verbose=True).split())
    assert "layer 0 (the first break's layer), every metric per tensor:" in out
    at = rep.layers[0].tensor("attn_update")
    for word in ("mean abs", "cosine", "max rel", "out of tolerance", "worst at sample", "would pass with atol >="):
        assert word in out
    assert f"mean abs {at.mean_abs:.3g}" in out and f"cosine {at.cosine:.3g}" in out
    assert f"{at.n_bad} out of tolerance" in out


def test_stats_level_first_break_is_short_said_once_and_titled_as_statistics(run_cli, traces):
    res = run_cli("compare", traces["stats"], traces["gqa_stats"])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    verdict = lines[-1]
    assert verdict.startswith("FAILED | layer 0 ") and "statistic error=" in verdict and len(verdict) < 120
    assert "per-layer largest error of the statistics" in res.output
    panel = res.output[res.output.index("first break"):]
    body = re.sub(r"[│╭╮╰╯─]", " ", panel)
    flat = " ".join(body.split())
    assert flat.count("statistics (min, max, mean, rms per sample)") == 1


def test_one_name_per_state(reports, run_cli, traces):
    out = render(reports["fault:gqa-mapping"], 200)
    header = next(l for l in out.splitlines() if l.strip().startswith("layer") and "mid" in l)
    assert " U " not in header + " "
    res = run_cli("inspect", traces["full"], "--layer", 0)
    assert " mid " in res.output and " U " not in res.output


# -- JUnit and JSON for CI, --strict ---------------------------------------------------------------

@pytest.mark.slow
def test_junit_to_stdout_with_no_none_properties(run_cli, tmp_path):
    res = run_cli("run", "reference", "fault:skip-kv", "--junit", "-")
    assert res.exit_code == 1 and not (tmp_path / "-").exists()
    root = ET.fromstring(res.output.split("?>", 1)[1])
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert "None" not in props.values() and props["reference"] == "trace not kept"
    assert props["verdict"] == "fail"
    assert [f.get("type") for f in root.iter("failure")] == ["cache_length"]  # the JSON's break kind
    assert run_cli("run", "reference", "batched-left", "--junit", "-", "--json", "-").exit_code == 2


def test_junit_types_a_metadata_break_as_an_error(run_cli, traces, tmp_path):
    xml = tmp_path / "r.xml"
    res = run_cli("compare", traces["full"], traces["seed"], "--junit", xml)
    assert res.exit_code == 2
    root = ET.fromstring(xml.read_text().split("?>", 1)[1])
    assert [e.get("type") for e in root.iter("error")] == ["metadata"]
    assert not list(root.iter("failure")) and root.get("errors") == "1"


def test_junit_marks_layers_not_reached_by_fail_fast_as_skipped(run_cli, tmp_path):
    from junitparser import JUnitXml, Skipped
    xml = tmp_path / "r.xml"
    res = run_cli("run", "reference", "fault:gqa-mapping", "--fail-fast", "--junit", xml)
    assert res.exit_code == 1
    cases = {c.name: c for s in JUnitXml.fromfile(str(xml)) for c in s}
    assert set(cases) == {"layer 000", "layer 001", "layer 002", "layer 003", "final"}
    for name in ("layer 001", "layer 002", "layer 003", "final"):
        assert any(isinstance(r, Skipped) for r in cases[name].result), name
    assert not any(isinstance(r, Skipped) for r in cases["layer 000"].result)


@pytest.mark.slow
def test_fail_fast_says_what_it_did_not_compare_and_that_its_sides_were_in_memory(run_cli, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "fault:skip-kv", "--fail-fast", "--json", out)
    rep = json.loads(out.read_text())
    assert res.exit_code == 1 and rep["stopped_early"]
    assert rep["checks_not_done"] == ["--fail-fast stopped at layer 2 of 4 (layers 0..3): layer 3 and the final "
                                      "logits and top ids not compared"]
    assert rep["reference"]["in_memory"] and rep["reference"]["file"] is None
    res = run_cli("run", "reference", "fault:skip-kv", "--fail-fast")
    text = " ".join(res.output.split())
    assert "reference: reference (in memory, full level) candidate: fault:skip-kv (in memory, full level)" in text
    assert "not checked: --fail-fast stopped at layer 2 of 4" in text


def test_junit_hint_only_on_the_first_break_and_later_failures_cite_it(reports):
    """fault:gqa-mapping breaks every layer: each stays a failure (CI counts them); only the first explains."""
    from junitparser import Failure, JUnitXml
    from prefill_diff.verify.formats.junit import to_junit
    rep = reports["fault:gqa-mapping"]
    suites = JUnitXml.fromstring(to_junit(rep))
    failures = {c.name: r for s in suites for c in s for r in c.result if isinstance(r, Failure)}
    assert {"layer 000", "layer 001", "layer 002", "layer 003", "final logits"} <= set(failures)
    first = failures.pop("layer 000")
    assert first.message == rep.verdict_line().removeprefix("FAILED | ") and "\nhint: " in first.text
    for name, f in failures.items():
        assert f.message.startswith("after the first break at layer 0 attn_update: "), name
        assert "\n" not in f.message and "hint:" not in (f.text or ""), name
    # the type is the JSON's break kind
    assert {f.type for f in failures.values()} | {first.type} == {"value", "top_ids"}
    assert all(int(s.failures) == len(failures) + 1 for s in suites)


def test_junit_says_how_long_each_case_took_and_counts_as_junitparser_does(run_cli, tmp_path):
    from junitparser import JUnitXml
    xml = tmp_path / "r.xml"
    assert run_cli("run", "reference", "fault:skip-kv", "--junit", xml).exit_code == 1
    root = ET.parse(xml).getroot()
    assert root.tag == "testsuites" and {"tests", "failures", "errors", "skipped", "time"} <= set(root.attrib)
    for el in root.iter():  # a plain decimal everywhere, as Surefire's schema (xs:decimal) and consumers read it
        if "time" in el.attrib:
            assert re.fullmatch(r"\d+\.\d+", el.get("time")), el.get("time")
    suites = JUnitXml.fromfile(str(xml))
    for suite in suites:
        written = (suite.tests, suite.failures, suite.errors, suite.skipped, suite.time)
        cases = list(suite)
        assert all(c.time is not None and c.time >= 0 for c in cases) and suite.time > 0
        assert sum(c.time for c in cases) <= suite.time + 1e-5
        suite.update_statistics()
        assert (suite.tests, suite.failures, suite.errors, suite.skipped) == written[:4]


def test_junit_suite_is_named_after_the_two_traces_compared(run_cli, traces, tmp_path):
    xml = tmp_path / "r.xml"
    assert run_cli("compare", traces["full"], traces["sampled"], "--junit", xml).exit_code == 0
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite.get("name") == f"prefill-diff: {traces['full']} vs {traces['sampled']}"


def test_junit_fails_a_final_break_that_no_candidate_check_carries(reports):
    """A first break in the final stage from the twin's own numerics (check 2): the JUnit fails with the verdict."""
    from dataclasses import replace
    from junitparser import Failure, JUnitXml
    from prefill_diff.verify.breaks import Break
    from prefill_diff.verify.formats.junit import to_junit
    twin = Break(stage="final", kind="value", check="numerics", tensor="logits", message="the twin breaks")
    for b in (twin, replace(twin, tensor="some_new_tensor")):
        rep = replace(reports["batched-left"], first_break=b)
        failing = [(c.name, r.type) for s in JUnitXml.fromstring(to_junit(rep)) for c in s for r in c.result
                   if isinstance(r, Failure)]
        assert failing == [(f"final {b.tensor}", "value")]


@pytest.mark.slow
def test_strict_fails_an_inconclusive_pass(run_cli, tmp_path):
    from junitparser import Failure, JUnitXml
    args = ("run", "reference", "fault:gqa-mapping", "--model", "seed-2.8", "-q")
    res = run_cli(*args)
    assert res.exit_code == 0 and "INCONCLUSIVE" in res.output and res.output.startswith("PASSED")
    strict = run_cli(*args, "--strict", "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml")
    assert strict.exit_code == 1
    # every format says the same verdict: the line, the JSON and a failing JUnit case named for it
    assert strict.output.startswith("FAILED (strict) | ") and "| INCONCLUSIVE: " in strict.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "fail" and rep["verdict_line"].startswith("FAILED (strict)")
    suites = JUnitXml.fromfile(str(tmp_path / "r.xml"))
    failing = [c.name for s in suites for c in s if any(isinstance(r, Failure) for r in c.result)]
    assert failing == ["inconclusive (strict)"]
    assert all(int(s.failures) == 1 for s in suites)


# -- inspect ---------------------------------------------------------------------------------------

def test_inspect_shows_cache_values_at_full_level(run_cli, traces):
    from prefill_diff.dumps.reader import Trace
    res = run_cli("inspect", traces["full"], "--layer", 1, "--tensor", "cache_keys", "--sample", 0,
                  "--channel", "17-19", "--json")
    s = json.loads(res.output)
    v = s["values"]
    with Trace(traces["full"]) as t:
        keys = t.read(t.layer(1).cache("keys"), (0,))  # [H, T, D]
        n = int(t.layer(1).cache_lengths[0])
    D = keys.shape[2]
    want = np.stack([keys[c // D, :n, c % D] for c in (17, 18, 19)], axis=1)
    assert v["channels"] == [17, 18, 19] and np.allclose(np.array(v["head"]), want)
    assert len(v["rows"]) == n


def test_inspect_position_channel_and_logits(run_cli, traces):
    from prefill_diff.dumps.reader import Trace
    res = run_cli("inspect", traces["full"], "--layer", 2, "--tensor", "mid", "--sample", 1, "--position", 3,
                  "--channel", 37, "--json", "-")
    v = json.loads(res.output)["values"]
    with Trace(traces["full"]) as t:
        cols, toks = t.cells(1)
        row = t.read(t.layer(2).state("mid"), (1,))
        want = row[cols[list(toks).index(3)], 37]
        logits = t.final["logits"][0]
    assert v["rows"] == [3] and v["channels"] == [37] and v["head"] == [[pytest.approx(float(want))]]
    for level in ("full", "stats"):
        res = run_cli("inspect", traces[level], "--tensor", "logits", "--sample", 0, "--channel", "0-3")
        assert res.exit_code == 0
        nums = re.search(r"^\s+\d+\s+(-?\d.*)$", res.output.split("values of logits")[1], re.M).group(1).split()
        assert np.allclose([float(x) for x in nums], logits[:4], rtol=1e-3)


def test_inspect_says_what_sampled_and_stats_levels_hold(run_cli, traces):
    res = run_cli("inspect", traces["sampled"], "--layer", 1, "--tensor", "cache_values", "--sample", 0)
    assert res.exit_code == 0 and "sampled level: declared subset of positions and channels" in res.output
    res = run_cli("inspect", traces["stats"], "--layer", 1, "--tensor", "cache_keys", "--sample", 0)
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "stats level: no values of cache_keys of layer 1 in this trace" in out
    assert "this trace keeps statistics" in out


@pytest.mark.slow
def test_inspect_at_80_columns_cuts_no_number_and_prints_no_repr(traces):
    for level in ("full", "stats"):
        out = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "inspect", str(traces[level])],
                             capture_output=True, text=True, env=dict(ENV, COLUMNS="80"))
        assert out.returncode == 0
        assert "…" not in out.stdout.split("per-layer statistics")[1]
        assert "{'" not in out.stdout and "':" not in out.stdout
        assert re.search(r"cache: dtype float32", out.stdout)


def test_inspect_json_takes_a_file(run_cli, traces, tmp_path):
    out = tmp_path / "s.json"
    res = run_cli("inspect", traces["stats"], "--json", out)
    assert res.exit_code == 0 and res.output == "" and json.loads(out.read_text())["level"] == "stats"
    assert json.loads(run_cli("inspect", traces["stats"], "--json").output)["level"] == "stats"
    res = run_cli("inspect", traces["stats"], "--json", tmp_path / "x.h5")
    assert res.exit_code == 2 and not (tmp_path / "x.h5").exists()


# -- flags that do what they say --------------------------------------------------------------------

def test_compare_of_two_traces_refuses_model_and_prompt(run_cli, traces):
    res = run_cli("compare", traces["full"], traces["full"], "--model", "smollm2", "--prompt", "hi")
    assert res.exit_code == 2
    assert "--model and --prompt do not apply when comparing two traces" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_errors_found_before_any_model_loads(run_cli, traces, monkeypatch, tmp_path):
    import prefill_diff.jobs.sides as recording

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(recording, "prepare_side", no_load)
    res = run_cli("record", "reference", "-o", traces["full"])
    assert res.exit_code == 2 and "exists; pass --force" in res.output
    res = run_cli("run", "reference", "sdpa", "--model", "smollm2", "--prompt", " ")
    assert res.exit_code == 2 and "--prompt number 1 is empty" in res.output
    res = run_cli("run", "reference", "sdpa", "--json", tmp_path / "no" / "such" / "r.json")
    assert res.exit_code == 2 and "cannot write --json" in res.output and "does not exist" in res.output


def test_compare_full_with_sampled_names_the_level_used(run_cli, traces, tmp_path):
    out = tmp_path / "r.json"
    run_cli("compare", traces["full"], traces["sampled"], "--json", out)
    skipped = json.loads(out.read_text())["checks_not_done"]
    assert not any("(stats level)" in s for s in skipped)
    assert any(s.startswith("cache_keys: compared as statistics only (levels full and sampled") for s in skipped)
    assert "values compared on the sampled subset only (sampled level)" in skipped


def test_ledger_says_what_a_chunked_call_shows(run_cli):
    res = run_cli("ledger", "chunked")
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "prefill call 1 of 3 (chunked: shapes of its first chunk of up to 4 tokens)" in out
    assert "one prefill call," in " ".join(run_cli("ledger").output.split())


# -- a terminal: presets wrap at words, progress is drawn on it and goes away ---------------------

def pty_run(args, cols):
    import fcntl
    import pty
    import select
    import termios
    m, s = pty.openpty()
    fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "prefill_diff.cli.main", *args], stdin=s, stdout=s, stderr=s,
                         env=ENV, close_fds=True)
    os.close(s)
    out = b""
    while True:
        r, _, _ = select.select([m], [], [], 120)
        if not r:
            break
        try:
            d = os.read(m, 65536)
        except OSError:
            break
        if not d:
            break
        out += d
    p.wait()
    os.close(m)
    return p.returncode, out.decode(errors="replace")


@pytest.mark.slow
def test_presets_wrap_at_word_boundaries_on_a_narrow_terminal():
    from prefill_diff.engine.presets import PRESETS
    rc, out = pty_run(["presets"], 60)
    assert rc == 0
    lines = out.replace("\r", "").splitlines()
    assert max(len(l) for l in lines) < 60
    words = {w for l in lines for w in l.split()}
    for name, (desc, _) in PRESETS.items():
        assert name in words and all(w in words for w in desc.split()), name


@pytest.mark.slow
def test_progress_is_drawn_on_a_terminal_and_lines_when_piped(tmp_path):
    rc, out = pty_run(["record", "reference", "-o", str(tmp_path / "t.h5")], 100)
    assert rc == 0 and "loading the model" in out and "wrote" in out
    assert "\x1b[2K" in out  # the display erased itself (transient) before the result line
    piped = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "record", "reference", "-o",
                            str(tmp_path / "u.h5")], capture_output=True, text=True, env=ENV)
    assert piped.returncode == 0 and "recording" not in piped.stdout and "\x1b" not in piped.stderr
    assert piped.stderr.splitlines()[0].startswith("prefill-diff: loading the model (")  # a line per phase


@pytest.mark.slow
def test_quiet_silences_transformers_loading_bars_on_a_terminal():
    pytest.importorskip("transformers")
    rc, out = pty_run(["run", "reference", "transformers", "--model", "smollm2", "--prompt", "Hi", "-q"], 100)
    assert rc == 0, out[-2000:]
    assert "Converting and de-quantizing" not in out and "Loading weights" not in out
    assert out.replace("\r", "").strip().splitlines()[-1].endswith("within tolerance\x1b[0m") or \
        "PASSED | 1/" in out or "PASSED | 30/30" in out


# -- a terminal's width: lines fold at their fields, tables and value grids fit ---------------------

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen_lines(out: str) -> list:
    """What a terminal shows of a pty's output: escape sequences dropped, each line as its last \r left it."""
    return [line.split("\r")[-1] for line in ESCAPES.sub("", out).replace("\r\n", "\n").split("\n")]


def on_terminal(report, width) -> list:
    console = Console(force_terminal=True, width=width, file=io.StringIO(), color_system=None, highlight=False)
    print_report(console, report)
    return console.file.getvalue().splitlines()


def folded(lines: list, first: str) -> list:
    """The line that starts with ``first`` and its indented continuation lines."""
    i = next(i for i, line in enumerate(lines) if line.startswith(first))
    j = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith("  ")), len(lines))
    return lines[i:j]


@pytest.mark.parametrize("width", [80, 120])
def test_header_and_verdict_fold_between_their_fields_on_a_terminal(reports, width):
    from dataclasses import replace
    from rich.cells import cell_len
    from prefill_diff.verify.formats.terminal import header_text
    rep = reports["fault:gqa-mapping"]
    d = "/tmp/prefill-diff-traces"  # every field fits a line; the whole header does not fit 120 columns
    rep = replace(rep, ref=dict(rep.ref, file=f"{d}/ref.h5"), cand=dict(rep.cand, file=f"{d}/cand.h5"))
    lines = on_terminal(rep, width)
    assert max(cell_len(line) for line in lines) <= width
    header = folded(lines, "reference: ")
    assert len(header) == (3 if width == 80 else 2) and header[1].startswith("  candidate: ")
    assert [f for line in header for f in line.strip().split("  ")] == header_text(rep).plain.split("  ")
    verdict = folded(lines, "FAILED |")
    assert " ".join(line.strip() for line in verdict) == rep.verdict_line()
    assert len(verdict) == (2 if width == 80 else 1) and all(line.endswith(" |") for line in verdict[:-1])
    piped = render(rep, width).splitlines()  # not a terminal: one line each, whatever the width
    assert header_text(rep).plain in piped and rep.verdict_line() in piped


def test_fold_keeps_words_and_numbers_whole():
    from rich.text import Text
    from prefill_diff.verify.formats.text import fold
    text = Text("a=1.5e-03, bb=supercalifragilistic, c=2.25e+01  d=x")
    for width in range(4, 60):
        lines = fold(text, width, ("  ", ", ")).plain.split("\n")
        assert " ".join(line.strip() for line in lines).split() == text.plain.split()
        assert all(len(line) <= width or " " not in line.strip() for line in lines)  # only a lone word overflows


@pytest.fixture
def terminal_80(monkeypatch):
    """The commands' stdout console as an 80-column terminal (stderr's is left alone: no progress display)."""
    from prefill_diff.cli import main
    real = main.console
    monkeypatch.setattr(main, "console", lambda stderr=False: real(stderr) if stderr else real(terminal=True, width=80))


@pytest.mark.slow
def test_run_and_inspect_fit_an_80_column_terminal(run_cli, traces, terminal_80):
    res = run_cli("run", "reference", "fault:gqa-mapping")
    lines = ESCAPES.sub("", res.output).splitlines()
    assert res.exit_code == 1 and max(len(line) for line in lines) <= 80
    assert folded(lines, "reference: ")[1].startswith("  candidate: ")
    args = ("inspect", traces["full"], "--layer", "1", "--tensor", "mid", "--sample", "0", "--channel", "0-9")
    lines = ESCAPES.sub("", run_cli(*args).output).splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len(folded(lines, "run reference: ")) > 1  # the run line, folded after its commas
    heads = [line.split() for line in lines if line.strip().startswith("pos ")]
    assert len(heads) == 2 and [w for h in heads for w in h if w != "ch" and w != "pos"] == [str(c) for c in range(10)]


@pytest.mark.slow
def test_run_and_inspect_fit_a_real_80_column_terminal(traces):
    rc, out = pty_run(["run", "reference", "fault:gqa-mapping"], 80)
    lines = screen_lines(out)
    assert rc == 1 and max(len(line) for line in lines) <= 80, out
    assert folded(lines, "reference: ")[1].startswith("  candidate: ")
    rc, out = pty_run(["inspect", str(traces["full"]), "--layer", "1", "--tensor", "mid", "--sample", "0"], 80)
    assert rc == 0 and max(len(line) for line in screen_lines(out)) <= 80, out


# -- piped output: no trailing spaces; an ASCII stream: stand-ins, the same verdict and exit status --------

@pytest.mark.slow
def test_piped_output_has_no_trailing_spaces(run_cli, traces):
    for args in (("run", "reference", "fault:gqa-mapping"), ("compare", traces["stats"], traces["gqa_stats"]),
                 ("inspect", traces["full"]), ("ledger",), ("presets",)):
        res = run_cli(*args)
        assert res.exit_code in (0, 1) and res.output.count("\n") > 3, (args, res.output)
        assert [line for line in res.output.splitlines() if line != line.rstrip()] == [], args


def ascii_run(*args):
    return subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", *map(str, args)], capture_output=True,
                          env=dict(ENV, PYTHONIOENCODING="ascii"))


@pytest.mark.slow
def test_an_ascii_stdout_gets_stand_ins_and_the_same_verdict(traces):
    out = ascii_run("run", "reference", "fault:gqa-mapping")
    text, err = out.stdout.decode("ascii"), out.stderr.decode("ascii")  # every byte ASCII
    assert out.returncode == 1 and all(l.startswith("prefill-diff: ") for l in err.splitlines()), err  # phases
    assert "FAILED | layer 0 attn_update" in text and "(x: out of tolerance)" in text
    assert "2.7e+00x" in text and "[h.H_kv/H_q]" in text  # ✗, and the hint's ⌊h·H_kv/H_q⌋
    spark = re.search(r"log scale\): (\S+)$", text, re.M).group(1)
    assert len(spark) == 4 and set(spark) <= set("_-~=+*#@")
    out = ascii_run("inspect", traces["full"], "--layer", "1", "--tensor", "mid", "--sample", "0")
    assert out.returncode == 0 and out.stderr == b"" and "weights sha256:" in out.stdout.decode("ascii")


@pytest.mark.slow
def test_machine_reports_and_error_lines_on_ascii_streams(traces):
    out = ascii_run("run", "reference", "fault:gqa-mapping", "--json", "-")
    assert out.returncode == 1 and json.loads(out.stdout.decode("ascii"))["verdict"] == "fail"
    out = ascii_run("run", "reference", "fault:gqa-mapping", "--junit", "-")
    root = ET.fromstring(out.stdout.decode("ascii"))  # characters ASCII cannot hold as character references
    assert out.returncode == 1 and "⌊h·H_kv/H_q⌋" in root.find(".//failure").text
    out = ascii_run("inspect", traces["full"], "--json", "-")
    assert out.returncode == 0 and json.loads(out.stdout.decode("ascii"))["level"] == "full"
    out = ascii_run("run", "reference", "é")
    err = out.stderr.decode("ascii")
    assert out.returncode == 2 and err.startswith("Error: '?' is neither a preset nor a config file")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_an_internal_error_line_on_an_ascii_stderr(monkeypatch):
    from click.testing import CliRunner
    from prefill_diff import jobs
    from prefill_diff.cli.main import cli

    def broken(*a, **k):
        raise RuntimeError("a bug near ✗ and é")
    monkeypatch.setattr(jobs, "run", broken)
    res = CliRunner(charset="ascii").invoke(cli, ["run", "reference", "batched-left"])
    assert res.exit_code == 3 and "internal error: RuntimeError: a bug near x and ?" in res.stderr


# -- the plot's data ------------------------------------------------------------------------------

def test_plot_data_keeps_zeros_and_draws_them_below_the_scale(reports):
    from prefill_diff.verify.formats.plot import baseline, cache_breaks, plot_data
    rep = reports["fault:gqa-mapping"]
    d = plot_data(rep)
    assert d["cache_keys"]["max_abs"][0] == 0.0  # an exact zero stays zero (drawn on the baseline)
    positive = [v for s in d.values() for v in s["max_abs"] + s["allowed"] if v]
    assert baseline(positive) < min(positive) / 5
    assert cache_breaks(reports["fault:skip-kv"]) == [(2, "cache length")]
    assert cache_breaks(rep) == []


@pytest.mark.slow
def test_bound_floor_is_atol_plus_ntol_times_the_smallest_row_rms(tmp_path):
    """The plot's allowed-error line, checked against an independent computation from the trace."""
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.jobs import run as run_pair
    out = run_pair("reference", "sdpa", out_dir=str(tmp_path))
    rep = out.report
    tol = rep.policy.tol("layer_output", 1)
    with Trace(out.ref_path) as t:
        ds = t.layer(1).state("layer_output")
        rms = []
        for s in range(t.n_samples):
            cols, _ = t.cells(s)
            x = t.read(ds, (s,))[cols].astype(np.float64)
            rms.append(np.sqrt((x ** 2).mean(axis=1)).min())
    tr = rep.layers[1].tensor("layer_output")
    assert tr.bound_floor == pytest.approx(tol.atol + tol.ntol * min(rms), rel=1e-5)
    for lr in rep.layers:  # sdpa is float32 noise: every tensor is below its floor, and passes
        for t_ in lr.tensors:
            if t_.bound_floor is not None:
                assert t_.max_abs <= t_.bound_floor and t_


@pytest.mark.slow
def test_plot_is_written_for_a_break_and_a_pass(reports, tmp_path):
    from prefill_diff.verify.formats.plot import plot_errors
    for name, rep in reports.items():
        path = tmp_path / f"{name.replace(':', '_')}.png"
        plot_errors(rep, str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_refused_reuse_reason_is_words_not_a_dict_repr(run_cli, tmp_path):
    path = tmp_path / "am.h5"
    assert run_cli("record", "fault:adapter-mismatch", "-o", path).exit_code == 0
    res = run_cli("inspect", path)
    assert res.exit_code == 0
    out = " ".join(res.output.split())
    assert "{'" not in out and "None" not in out
    assert "adapter differs (cached: id other-adapter, digest sha256:" in out and "request: none)" in out


# -- calibrated failures and padding-only non-finite values, said the same everywhere ----------------

@pytest.fixture(scope="module")
def calibrated_failure(tmp_path_factory):
    """A bf16 candidate with another rope_theta, judged as values: fails the calibrated rule everywhere."""
    from prefill_diff.jobs import run as run_pair
    cand = tmp_path_factory.mktemp("cal") / "rope.toml"
    cand.write_text('[model]\nrope_theta = 20000.0\n[run]\ndtype = "bfloat16"\n')
    from prefill_diff.jobs import Judging
    rep = run_pair("reference", str(cand), judging=Judging(allow_identity=True)).report
    assert rep.policy.calibration is not None and not rep
    return rep


@pytest.mark.slow
def test_calibrated_failures_are_marked_in_the_final_table_and_counted_in_the_json(calibrated_failure):
    rep = calibrated_failure
    logits = rep.final.tensor("logits")
    assert not logits and logits.n_bad == 0 and logits.calib.bad_rows > 0  # no element rule: rows are judged
    js = json.loads(to_json(rep))["final"]["tensors"]["logits"]
    assert js["passed"] is False and js["n_bad"] == logits.calib.bad_rows and js["n_bad_unit"] == "rows"
    assert js["bad_samples"] == list(logits.calib.bad_samples) and js["bad_samples"]
    text = render(rep, 120)
    table = text[text.index("final logits and top ids"):]
    marked = [int(line.split()[0]) for line in table.splitlines()[3:] if line.strip() and BAD in line]
    assert marked == list(logits.calib.bad_samples), table


def test_the_plot_of_a_calibrated_verdict_draws_the_calibrated_allowance(calibrated_failure, tmp_path,
                                                                          monkeypatch):
    from matplotlib.figure import Figure
    from prefill_diff.verify.formats.plot import plot_data, plot_errors
    d = plot_data(calibrated_failure)
    k = calibrated_failure.layers[0].tensor("cache_keys").calib
    assert d["cache_keys"]["allowed"] == [None] * 4  # no element bound applies
    assert d["cache_keys"]["allowed_row"][0] == pytest.approx(k.allowed)
    assert d["cache_keys"]["max_row_rel"][0] == pytest.approx(k.max_cand_error)
    seen = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: seen.setdefault("fig", fig))
    plot_errors(calibrated_failure, str(tmp_path / "p.png"))
    top, low = seen["fig"].axes[:2]
    labels = top.get_legend_handles_labels()[1]
    assert any(lab.startswith("allowed row error") for lab in labels)
    assert not any(lab.startswith("allowed error floor") for lab in labels)  # never drawn here: not named
    assert "calibrated" in top.get_title() and "atol" not in top.get_title()
    assert any(line.get_linestyle() == "--" for line in low.get_lines())


@pytest.mark.slow
def test_padding_only_non_finite_cells_show_the_valid_error_and_the_break_names_every_sample(run_cli, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("run", "reference", "fault:masked-row-softmax", "--json", out)
    rep = json.loads(out.read_text())
    fb = rep["first_break"]
    assert res.exit_code == 1 and fb["padding"] and fb["samples"] == [1, 2]
    assert "| samples 1,2 | NaN/Inf in padding rows" in rep["verdict_line"]
    assert "(samples 1: " in fb["message"] and ", 2: " in fb["message"] and "the valid rows agree" in fb["message"]
    row0 = next(line for line in res.output.splitlines() if line.strip().startswith("0 "))
    assert "pad" + BAD in row0 and "NaN" not in row0, row0  # valid rows: error 0, padding rows: NaN
    assert "pad" + BAD + ": NaN/Inf in padding rows only" in res.output
    spark = next(line for line in res.output.splitlines() if line.startswith("error growth"))
    assert spark.rstrip().endswith("!!!")  # layers 1..3 carry NaN into valid rows
