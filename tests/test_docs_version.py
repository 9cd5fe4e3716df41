"""The trace format version the documents state is the one the recorder writes (dumps/schema.py's FORMAT_VERSION):
every statement of the current version in README.md and docs/*.md, and what `prefill-diff docs` prints."""
from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from prefill_diff.cli.main import cli
from prefill_diff.dumps.schema import FORMAT_VERSION

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the ways a text states the version a trace is written in today (a version a feature arrived in, e.g. "since
# version 1.1" or "Rank traces (1.1)", is history and is not matched)
CURRENT = [re.compile(r"trace format,? version (\d+\.\d+)"),
           re.compile(r"\(format\s+version (\d+\.\d+)"),
           re.compile(r"This document describes `\"(\d+\.\d+)\"`"),
           re.compile(r"\| `format_version` \| string \| `\"(\d+\.\d+)\"`")]


def statements() -> list[tuple[str, int, str]]:
    """(file, line, version) for each statement of the current format version in the documents."""
    out = []
    for path in TEXTS:
        text = path.read_text(encoding="utf-8")
        for rx in CURRENT:
            for m in rx.finditer(text):
                out.append((path.name, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def test_documents_state_the_version_the_recorder_writes():
    found = statements()
    files = {f for f, _, _ in found}
    assert {"README.md", "trace-format.md"} <= files, found  # the title, the versioning rule, the table, README
    assert len(found) >= 4, found
    wrong = [s for s in found if s[2] != FORMAT_VERSION]
    assert not wrong, f"the recorder writes format {FORMAT_VERSION}; these say otherwise: {wrong}"


def test_docs_command_prints_the_version_the_recorder_writes():
    out = CliRunner().invoke(cli, ["docs", "trace-format"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0] == f"# prefill-diff trace format, version {FORMAT_VERSION}"
