"""What the installed package holds: the documents (docs/*.md as prefill_diff.docs; the tool says where they
are), and `python -m prefill_diff`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set:
    """The files of a wheel built from a clean copy of the source tree (no build/ left from an earlier build)."""
    from importlib import metadata
    if tuple(int(x) for x in metadata.version("setuptools").split(".")[:2]) < (74, 1):
        pytest.skip("building without isolation needs the backend pyproject.toml names (setuptools>=74.1)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__",
                                                             "*.so", "*.h5", "tests"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    wheel, = tmp.glob("prefill_diff-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


@pytest.mark.slow
def test_the_wheel_ships_the_docs(wheel_names):
    """A non-editable install gets the documents: they are package data of prefill_diff.docs."""
    assert {f"prefill_diff/docs/{d}.md" for d in DOCS} <= wheel_names, sorted(wheel_names)


def test_the_wheel_runs_as_python_m_prefill_diff(wheel_names):
    """prefill_diff holds only __main__.py: it stays a namespace over cli, engine, dumps, verify, jobs and docs."""
    assert "prefill_diff/__main__.py" in wheel_names and "prefill_diff/__init__.py" not in wheel_names
    assert {n.split("/")[1] for n in wheel_names if n.startswith("prefill_diff/") and n.count("/") > 1} == \
        {"cli", "engine", "dumps", "verify", "jobs", "docs"}


def test_the_wheel_ships_every_module_of_the_source_tree(wheel_names):
    """pyproject.toml lists the packages one by one: a subpackage it misses is absent from a non-editable install
    (an editable one still finds it), so every .py of the four packages must be in the wheel."""
    sources = {f"prefill_diff/{p.relative_to(ROOT).as_posix()}" for pkg in ("cli", "engine", "dumps", "verify")
               for p in (ROOT / pkg).rglob("*.py") if "toplevel" not in p.parts}
    assert sources, "no source modules found"
    assert not sources - wheel_names, sorted(sources - wheel_names)


def test_python_m_prefill_diff_is_the_cli(tmp_path):
    res = subprocess.run([sys.executable, "-m", "prefill_diff", "docs"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.split()[0] == DOCS[0], res.stderr
