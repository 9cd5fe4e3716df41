"""The documents ship with the package (docs/*.md as prefill_diff.docs) and the tool says where they are."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))


def test_docs_lists_every_document_with_its_installed_path(run_cli):
    res = run_cli("docs")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert [line.split()[0] for line in lines] == DOCS
    for line in lines:
        path = Path(line.split()[1])
        assert path.name == line.split()[0] + ".md" and path.is_file()


def test_docs_prints_a_document_and_suggests_a_name_for_a_typo(run_cli):
    res = run_cli("docs", "contract")
    assert res.exit_code == 0 and res.output == (ROOT / "docs" / "contract.md").read_text(encoding="utf-8")
    res = run_cli("docs", "contrat")
    assert res.exit_code == 2 and "did you mean contract?" in res.output and "trace-format" in res.output


def test_a_hint_that_cites_the_contract_says_where_to_read_it(run_cli, tmp_path):
    res = run_cli("run", "reference", "fault:gqa-mapping", "--json", tmp_path / "r.json")
    hint = json.loads((tmp_path / "r.json").read_text())["diagnosis"]
    assert res.exit_code == 1 and "§2.11 row 4" in hint and "`prefill-diff docs contract`" in hint


def build_wheel(tmp_path) -> Path:
    """A wheel of a clean copy of the source tree (no build/ left over from an earlier build)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__",
                                                             "*.so", "*.h5", "tests"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    wheel, = tmp_path.glob("prefill_diff-*.whl")
    return wheel


def test_the_wheel_ships_the_docs(tmp_path):
    """A non-editable install gets the documents: they are package data of prefill_diff.docs."""
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"prefill_diff/docs/{d}.md" for d in DOCS} <= names, sorted(names)
