"""The documents installed with prefill-diff (cli/docs.py): the ones found are the docs/*.md files of the checkout this
test runs from (the same files, wherever the install put them), each with its first heading; a name not installed is
refused naming the closest document and all of them. Where the package is elsewhere, a stand-in package directory
holds the documents under test."""
from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

from prefill_diff.cli import docs
from prefill_diff.engine.shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def shelf(tmp_path, monkeypatch):
    """``prefill_diff.docs`` found in a directory of this test's own (and nowhere else)."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name != "prefill_diff.docs":
            return real(name, *args)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path)]
        return spec
    monkeypatch.setattr(docs.importlib.util, "find_spec", find_spec)
    return tmp_path


def test_the_installed_documents_are_the_checkouts_docs():
    found = docs.installed()
    assert {stem: p.read_bytes() for stem, p in found.items()} == {p.stem: p.read_bytes()
                                                                   for p in sorted((ROOT / "docs").glob("*.md"))}
    assert list(found) == sorted(found)
    assert {"contract", "tolerances", "trace-format"} <= set(found)
    assert all(p.is_file() for p in found.values())


def test_each_installed_documents_title_is_its_first_heading():
    for stem, path in docs.installed().items():
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# ") and docs.title(path) == first[2:].strip(), stem


def test_a_title_is_the_first_line_without_its_hashes(tmp_path):
    p = tmp_path / "a.md"
    p.write_text("##  Tolerances: atol, rtol  \n# Second\n", encoding="utf-8")
    assert docs.title(p) == "Tolerances: atol, rtol"
    p.write_text("# Contract — §2 «layers»\n", encoding="utf-8")
    assert docs.title(p) == "Contract — §2 «layers»"


def test_an_empty_document_has_an_empty_title(tmp_path):
    (tmp_path / "empty.md").write_bytes(b"")
    assert docs.title(tmp_path / "empty.md") == ""


def test_only_markdown_files_are_documents_in_name_order(shelf):
    for name in ("zeta.md", "alpha.md", "notes.txt", "plot.png", "mid.md"):
        (shelf / name).write_text("# x\n", encoding="utf-8")
    found = docs.installed()
    assert list(found) == ["alpha", "mid", "zeta"]
    assert found["alpha"] == shelf / "alpha.md"


def test_no_package_means_no_documents(monkeypatch):
    def missing(name, *args):
        raise ModuleNotFoundError(name)
    monkeypatch.setattr(docs.importlib.util, "find_spec", missing)
    assert docs.installed() == {}
    monkeypatch.setattr(docs.importlib.util, "find_spec", lambda name, *args: None)
    assert docs.installed() == {}


def test_a_package_directory_that_is_gone_holds_no_documents(shelf):
    shelf.rmdir()
    assert docs.installed() == {}


@pytest.mark.parametrize("name", ["contract", "contract.md"])
def test_a_document_is_found_by_its_name_with_or_without_md(name):
    assert docs.find(name) == docs.installed()["contract"]
    assert docs.find(name).read_bytes() == (ROOT / "docs" / "contract.md").read_bytes()


def test_a_misspelt_name_is_refused_with_the_closest_document():
    with pytest.raises(ConfigError) as e:
        docs.find("tolerance")
    listed = ", ".join(p.stem for p in sorted((ROOT / "docs").glob("*.md")))
    assert str(e.value) == f"no document named 'tolerance'; did you mean tolerances? (documents: {listed})"


def test_a_name_like_no_document_is_refused_without_a_guess(shelf):
    (shelf / "contract.md").write_text("# Contract\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        docs.find("xyzzy.md")
    assert str(e.value) == "no document named 'xyzzy.md' (documents: contract)"


def test_a_name_is_refused_when_no_document_is_installed(shelf):
    with pytest.raises(ConfigError) as e:
        docs.find("contract")
    assert str(e.value) == "no document named 'contract' (documents: none installed)"


@pytest.mark.parametrize("name", ["../README", "/etc/passwd", "docs/contract", ".md", ""])
def test_a_path_is_not_a_document_name(name):
    """Only an installed document's name is found: a path, even one to a real file, is refused."""
    with pytest.raises(ConfigError, match=r"^no document named "):
        docs.find(name)


def test_a_name_with_control_characters_is_shown_escaped(shelf):
    with pytest.raises(ConfigError) as e:
        docs.find("\x1b[2Jcontract\u202e")
    assert "\x1b" not in str(e.value) and "\u202e" not in str(e.value)
    assert str(e.value).startswith("no document named '\\x1b[2Jcontract\\u202e'")
