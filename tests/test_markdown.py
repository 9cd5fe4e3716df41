"""Reports for CI pages and pull requests: the Markdown summary (--markdown, $GITHUB_STEP_SUMMARY), the
GitHub Actions ``::error`` annotation, and foreign text that can break neither."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
from markdown_it import MarkdownIt

from prefill_diff.cli.outputs import markdown
from prefill_diff.verify.breaks import Break
from prefill_diff.verify.formats.github import workflow_error
from prefill_diff.verify.formats.markdown import md, to_markdown

HOSTILE = "a | b `c` <script>&amp; *d* [e](f) $x$ ~~s~~\n# heading\r\n::warning::x %0A, @user"


def html(text: str) -> str:
    """Markdown rendered as GitHub does its structure: CommonMark with tables and strikethrough."""
    return MarkdownIt("commonmark").enable("table").enable("strikethrough").render(text)


def cells(row_html: str) -> list[str]:
    return re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row_html, re.S)


def rows(text: str) -> list[list[str]]:
    """Every table row of the rendered Markdown, as lists of cell contents."""
    return [cells(r) for r in re.findall(r"<tr>(.*?)</tr>", html(text), re.S)]


@pytest.fixture(scope="module")
def reports():
    from prefill_diff.jobs import run as run_pair
    return {c: run_pair("reference", c).report for c in ("fault:gqa-mapping", "batched-left")}


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 16-layer synthetic model; the candidate skips a KV write at layer 8."""
    from prefill_diff.jobs import run as run_pair
    d = tmp_path_factory.mktemp("deep")
    (d / "ref.toml").write_text('preset = "reference"\n[model]\nn_layers = 16\n')
    (d / "cand.toml").write_text('preset = "reference"\n[model]\nn_layers = 16\n[fault]\nname = "skip-kv"\nlayer = 8\n')
    return run_pair(str(d / "ref.toml"), str(d / "cand.toml")).report


# -- what the summary holds --------------------------------------------------------------------------

def test_markdown_holds_the_verdict_first_break_layer_table_final_ids_and_hint(reports):
    rep = reports["fault:gqa-mapping"]
    text = markdown(rep)
    page = html(text)
    assert "<h3>prefill-diff: FAILED</h3>" in page
    assert f"<strong>{rep.verdict_line().replace('>', '&gt;')}</strong>" in page  # the verdict line, as printed
    assert "15866 of 15872 values of attn_update out of tolerance (&gt;99.9%)" in page  # the first break's message
    assert "<blockquote>\n<p>hint: At layer 0 only query head 0 of 4 differs" in page
    table = rows(text)
    head, layers, final = table[0], table[1:5], table[6:]
    # the terminal's columns (attn_heads is not one), a cache column, a row per layer, ✗ where out of tolerance
    assert head == ["layer", "layer_input", "cache_keys", "cache_values", "attn_update", "mid", "mlp_update",
                    "layer_output", "cache"]
    assert [r[0] for r in layers] == ["0", "1", "2", "3"]
    assert layers[0][1:5] == ["0", "0", "0", "2.6e+00 ✗"] and layers[0][-1] == "ok"
    assert table[5] == ["sample", "logits max abs", "reference top", "candidate top"]
    assert final[0] == ["0", "1.3e+00 ✗", "71 21 79 43 6", "71 8 10 21 79"]


def test_markdown_of_a_pass_has_no_first_break_and_no_mark(reports):
    text = markdown(reports["batched-left"])
    assert text.startswith("### prefill-diff: PASSED\n") and "First break" not in text
    assert not [c for r in rows(text) for c in r if "✗" in c]
    assert "**PASSED \\| 4/4 layers, logits and cache within tolerance**" in text


@pytest.mark.slow
def test_markdown_shows_the_layers_the_terminal_shows_and_counts_the_rest(deep):
    table = rows(markdown(deep, "auto"))
    layers = [r[0] for r in table[1:] if r and r[0] not in ("sample",)][:7]
    assert layers == ["6", "7", "8", "9", "10", "…", "15"]
    text = markdown(deep, "auto")
    assert "10 more layers not shown (" in text and "`--layers all` shows every layer" in text
    every = markdown(deep, "all")
    assert "more layers not shown" not in every
    assert [r[0] for r in rows(every)[1:17]] == [str(i) for i in range(16)]
    every_tensor = rows(to_markdown(deep))  # no columns given: every tensor the layers have, every layer
    assert "attn_heads" in every_tensor[0] and [r[0] for r in every_tensor[1:17]] == [str(i) for i in range(16)]


# -- foreign text cannot add markup -----------------------------------------------------------------

def test_md_escapes_every_way_text_could_become_markup():
    page = html(md(HOSTILE))
    for tag in ("<script", "<code", "<em", "<a ", "<h1", "<del", "<table", "<ul", "<ol"):
        assert tag not in page, tag
    assert "\n" not in md(HOSTILE) and "\r" not in md(HOSTILE)
    assert md("<b>&amp;</b>") == "&lt;b&gt;&amp;amp;&lt;/b&gt;"  # no HTML: & < > as entities
    for lead in ("- x", "+ x", "1. x", "3) x", "# x", "> x", "=== x", "    x"):
        assert html(md(lead)) == f"<p>{lead.replace('>', '&gt;')}</p>\n", lead  # a paragraph, as written


def test_foreign_text_in_a_report_cannot_break_the_summary(reports):
    rep = reports["fault:gqa-mapping"]
    hostile = replace(rep, notes=(HOSTILE,), inconclusive=(HOSTILE,), skipped=(HOSTILE,), diagnosis=HOSTILE,
                      ref={**rep.ref, "origin": HOSTILE, "file": "x|y.h5"}, cand={**rep.cand, "origin": HOSTILE},
                      token_text={"71": HOSTILE, "21": "|", "8": "`"})
    text = markdown(hostile)
    page = html(text)
    for tag in ("<script", "<code", "<em", "<a ", "<h1", "<del", "<ul>\n<li>a"):
        assert tag not in page, tag
    table = rows(text)
    assert all(len(r) == 9 for r in table[:5]) and all(len(r) == 4 for r in table[5:])  # no cell split or merged
    assert "71:'a | b" in table[6][2] and "21:'|'" in table[6][2] and "8:'`'" in table[6][3]
    assert page.count("<h3>") == 1 and page.count("<h4>") == 3  # the report's own headings only
    lines = text.splitlines()
    assert sum(1 for l in lines if l.startswith("- note: ")) == 1  # one line per note, whatever it holds


# -- the CLI: --markdown, $GITHUB_STEP_SUMMARY, ::error ---------------------------------------------

def test_markdown_goes_to_a_file_or_alone_to_stdout(run_cli, tmp_path):
    out = tmp_path / "r.md"
    res = run_cli("run", "reference", "fault:skip-kv", "--markdown", out)
    assert res.exit_code == 1 and res.stdout.splitlines()[-1].startswith("FAILED | layer 2 cache length")
    assert out.read_text(encoding="utf-8").startswith("### prefill-diff: FAILED\n")
    res = run_cli("run", "reference", "fault:skip-kv", "--markdown", "-")
    assert res.exit_code == 1 and res.stdout == out.read_text(encoding="utf-8")  # and no human report
    for other in (("--json", "-"), ("--junit", "-")):
        res = run_cli("run", "reference", "batched-left", "--markdown", "-", *other)
        assert res.exit_code == 2 and f"{other[0]} - and --markdown - both ask for stdout" in res.output
    res = run_cli("run", "reference", "batched-left", "--markdown", tmp_path / "no" / "r.md")
    assert res.exit_code == 2 and "cannot write --markdown (the Markdown report)" in res.output


@pytest.mark.slow
def test_github_actions_step_summary_and_one_error_line_for_the_first_break(run_cli, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n", encoding="utf-8")
    env = {"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)}
    res = run_cli("run", "reference", "fault:skip-kv", env=env)
    assert res.exit_code == 1
    errors = [l for l in res.stdout.splitlines() if l.startswith("::")]
    assert errors == [l for l in res.stdout.splitlines() if l.startswith("::error title=prefill-diff%3A layer 2 "
                                                                           "cache length::FAILED | layer 2 cache")]
    assert len(errors) == 1 and "%0Ahint: " in errors[0]
    assert res.stdout.splitlines()[-1].startswith("FAILED | ")  # the verdict line stays the last line
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("earlier step\n### prefill-diff: FAILED\n")  # appended, never overwritten
    res = run_cli("run", "reference", "batched-left", env=env)
    assert res.exit_code == 0 and "::" not in res.stdout  # nothing on a pass
    assert summary.read_text(encoding="utf-8").count("### prefill-diff: PASSED") == 1
    # a report on stdout stays parseable: the annotation goes to stderr
    res = run_cli("run", "reference", "fault:skip-kv", "--json", "-", env=env)
    assert res.stdout.startswith("{") and res.stderr.startswith("::error title=")
    # without GITHUB_ACTIONS=true, no annotation
    res = run_cli("run", "reference", "fault:skip-kv", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert "::error" not in res.output


def test_an_unwritable_step_summary_is_a_warning_and_the_verdict_stands(run_cli, tmp_path):
    res = run_cli("run", "reference", "fault:skip-kv", "-q",
                  env={"GITHUB_STEP_SUMMARY": str(tmp_path / "no" / "summary.md")})
    assert res.exit_code == 1 and "warning: cannot append the step summary to" in res.stderr


def test_the_error_annotation_cannot_be_split_or_closed_early_by_trace_text(reports):
    rep = reports["fault:gqa-mapping"]
    fb = replace(rep.first_break, message=HOSTILE, tensor="a,b::c\nd")
    line = workflow_error(replace(rep, first_break=fb, diagnosis=HOSTILE))
    assert "\n" not in line and "\r" not in line
    props, message = re.fullmatch(r"::error (.*?)::(.*)", line).groups()
    assert props == "title=prefill-diff%3A layer 0 a%2Cb%3A%3Ac\\x0ad"  # ':' and ',' escaped in a property
    assert "%250A, @user" in message and "%0Ahint: a | b" in message  # a literal %0A stays literal
    assert workflow_error(reports["batched-left"]) is None


def test_a_strict_failure_is_annotated_too(reports):
    rep = replace(reports["batched-left"], inconclusive=("the fault cannot show here",), strict=True)
    line = workflow_error(rep)
    assert line.startswith("::error title=prefill-diff%3A INCONCLUSIVE (strict)::FAILED (strict) | ")
    assert line.endswith("%0AINCONCLUSIVE: the fault cannot show here")


def test_a_break_at_the_metadata_stage_is_titled_by_its_kind(reports):
    b = Break(stage="metadata", kind="coverage", message="1 of 3 reference samples have no counterpart in the "
              "candidate (not compared): samples [1]", samples=(1,))
    line = workflow_error(replace(reports["batched-left"], first_break=b))
    assert line.startswith("::error title=prefill-diff%3A the metadata stage (coverage)::FAILED | coverage | ")
