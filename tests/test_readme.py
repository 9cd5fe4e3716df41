"""The README's examples stay true: the Commands block runs, in order, with the exit statuses it states."""
from __future__ import annotations

import pytest
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # every README command run as a process

ROOT = Path(__file__).resolve().parents[1]


def command_block() -> list[tuple[list[str], int]]:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Commands\n(.*?)(?=^## )", text, re.M | re.S).group(1)
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    out = []
    for line in block.splitlines():
        cmd, _, comment = line.partition("#")
        if not cmd.strip():
            continue
        m = re.search(r"exit (\d)", comment)
        out.append((shlex.split(cmd)[1:], int(m.group(1)) if m else 0))
    return out


def test_readme_commands_run_as_documented(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmds = command_block()
    assert {c[0] for c, _ in cmds} >= {"run", "record", "compare", "inspect", "ledger", "presets"}
    for args, want in cmds:
        res = run_cli(*args)
        assert res.exit_code == want, (args, res.output[-2000:])
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.xml").exists()
    assert (tmp_path / "errors.png").exists() and (tmp_path / "ref.h5").exists()


def test_readme_quick_start_has_two_lines_and_ci_runs_the_second():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick start\s*\n.*?```sh\n(.*?)```", text, re.M | re.S).group(1)
    lines = [l for l in block.splitlines() if l.strip() and not l.startswith("#")]
    assert len(lines) == 2
    assert lines[0].startswith("pip install") and "prefill-diff run reference batched-left" in lines[0]
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_console_examples_are_what_the_tool_prints():
    """Every ```console block's `$ prefill-diff ...` output is reproduced by the tool at 80 columns."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```console\n\$ (prefill-diff [^\n]*)\n(.*?)```", text, re.S)
    assert blocks
    for cmd, want in blocks:
        out = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", *shlex.split(cmd)[1:]],
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
        got = "\n".join(l.rstrip() for l in out.stdout.splitlines())
        assert got == want.rstrip("\n"), cmd


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    """The "From Python" block is real code: it runs, and its assertion holds."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## From Python\n(.*?)(?=^## )", text, re.M | re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (From Python)", "exec"), {})
    assert (tmp_path / "ref.h5").exists() and (tmp_path / "traces" / "cand.h5").exists()
    assert "PASSED" in capsys.readouterr().out


def _ci_gate() -> tuple[list[str], str, list[str]]:
    """The CI gate's baseline command, the serving config it gates, and the workflow's compare command."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## CI gate\n(.*?)(?=^## )", text, re.M | re.S).group(1)
    record = re.search(r"```sh\n(prefill-diff record [^\n]*)\n```", section).group(1)
    compare = re.search(r"- run: (prefill-diff compare [^\n#]*)", section).group(1)
    serving = re.search(r"```toml\n(# configs/serving.toml\n.*?)```", text, re.S).group(1)
    return shlex.split(record)[1:], serving, shlex.split(compare)[1:]


def test_readme_ci_recipe_runs_as_written_with_its_bf16_config(run_cli, tmp_path, monkeypatch):
    """The baseline with its golden and twin, then the workflow's compare of the bf16 serving config: a pass,
    judged against measured bf16 noise. The old recipe (a declared float32 rule) fails it on rounding alone,
    and its hint names the fix."""
    from junitparser import JUnitXml
    monkeypatch.chdir(tmp_path)
    record, serving, compare = _ci_gate()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "serving.toml").write_text(serving)
    (tmp_path / "tests").mkdir()
    assert "bfloat16" in serving
    res = run_cli(*record)
    assert res.exit_code == 0, res.output
    assert {p.name for p in (tmp_path / "tests").iterdir()} == {"baseline.h5", "baseline.golden.h5",
                                                                "baseline.twin-bfloat16.h5"}
    res = run_cli(*compare)
    rep = json.loads((tmp_path / "prefill.json").read_text())
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["rule"].startswith("calibrated:"), rep["rule"]
    assert sum(int(s.failures) for s in JUnitXml.fromfile("prefill.xml")) == 0
    # the recipe as it was: a float32 rule declared in the baseline fails the bf16 candidate
    assert run_cli("record", "reference", "-o", "old.h5", "--policy", "float32").exit_code == 0
    res = run_cli("compare", "old.h5", "configs/serving.toml", "--json", "old.json")
    old = json.loads((tmp_path / "old.json").read_text())
    assert res.exit_code == 1 and old["rule"].startswith("declared rule")
    assert "--twin-of bfloat16" in old["diagnosis"] and "numeric drift" not in old["diagnosis"], old["diagnosis"]
