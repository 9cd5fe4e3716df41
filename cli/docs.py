"""The documents installed with prefill-diff (docs/*.md, the package ``prefill_diff.docs``): where they are.

Hints and messages cite them ("contract.md §2.11"); `prefill-diff docs` lists them with their installed paths
and prints one. Does not import torch.
"""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from ..engine.shared.errors import ConfigError


def installed() -> dict[str, Path]:
    """Document name (its file's stem: contract, tolerances, ...) -> its installed path.

    ``prefill_diff.docs`` holds no code (a namespace package): its directory is read from the import system,
    since importlib.resources refuses the non-directory entries an editable install puts on its path."""
    try:
        spec = importlib.util.find_spec("prefill_diff.docs")
    except ModuleNotFoundError:
        spec = None
    dirs = [Path(d) for d in (spec.submodule_search_locations or ()) if Path(d).is_dir()] if spec else []
    return {f.stem: f for d in dirs for f in sorted(d.glob("*.md"))}


def title(path: Path) -> str:
    """A document's first heading, without its '#'."""
    with open(path, encoding="utf-8") as f:
        return f.readline().lstrip("#").strip()


def find(name: str) -> Path:
    """The installed document NAME (contract, contract.md); ConfigError naming the documents there are."""
    docs = installed()
    stem = name[:-3] if name.endswith(".md") else name
    if stem in docs:
        return docs[stem]
    near = difflib.get_close_matches(stem, list(docs), n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise ConfigError(f"no document named {name!r}{hint} (documents: {', '.join(docs) or 'none installed'})")
