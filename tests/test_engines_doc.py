"""docs/engines.md describes the registry as it is: its field table names every EngineInfo field, and its worked
example is the vLLM entry of engine/registry.py (its summary elided)."""
from __future__ import annotations

import ast
import re
from dataclasses import fields, replace
from pathlib import Path

from prefill_diff.engine import registry

DOC = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text(encoding="utf-8")


def test_engines_doc_field_table_names_every_engine_info_field():
    table = DOC.split("The entry (`EngineInfo`) declares, as data:")[1].split("\n\n")[1]
    documented = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {f.name for f in fields(registry.EngineInfo)}


def test_engines_doc_example_entry_is_the_registry_entry():
    block = DOC.split("**The registry entry**")[1].split("```python")[1].split("```")[0]
    call = ast.parse(block.strip(), mode="eval").body
    assert isinstance(call, ast.Call) and call.func.id == "EngineInfo"
    named = {f.name for f in fields(registry.EngineInfo)}
    assert {k.arg for k in call.keywords} <= named
    entry = eval(compile(ast.Expression(call), "docs/engines.md", "eval"), vars(registry))  # noqa: S307
    real = registry.ENGINES[entry.name]
    assert "..." in entry.summary  # elided in the doc
    assert replace(entry, summary=real.summary) == real
