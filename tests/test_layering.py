"""The package layering, enforced: data flows engine -> dumps -> verify -> cli, and nothing imports to its right.

Run as a script (`python tests/test_layering.py`) it prints the package graph and the line counts per package.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("engine", "dumps", "verify", "jobs", "cli")  # the data flow; a package may import only from its left
# where each package's files are: the jobs (prefill_diff.jobs) sit in the package root's folder, cli/toplevel
FOLDERS = {"engine": "engine", "dumps": "dumps", "verify": "verify", "jobs": "cli/toplevel/jobs", "cli": "cli"}
# the shared leaf, which imports nothing of ours but itself: the error classes, the handling of untrusted input and the
# precisions' names (the engine modules dumps and verify may import)
SHARED = "engine.shared"
LEAVES = (SHARED, "engine.shared.errors", "engine.shared.untrusted", "engine.shared.precisions",
          "engine.shared.trace_recorder", "engine.shared.op_replay")
# what dumps and verify may import of the engine: the shared leaf, and ModelArgs (engine/models/args.py: plain data, no
# torch, importing only the leaf), whose fields the trace's meta.model.args are (dumps/meta_fields.py derives their
# checks from it, not from a copy)
TRACE_VOCABULARY = LEAVES + ("engine.models.args",)
THIRD_PARTY_HEAVY = ("torch", "transformers", "llama_cpp", "gguf", "vllm")  # never imported by dumps or verify
VLLM_WORKER = "engine.foreign.vllm_worker"  # runs in vLLM's own environment, as a script: the one module that imports vllm
# the modules the worker loads by their path, in vLLM's process (never imported in ours): they may import vllm too
WORKER_SIDE = (VLLM_WORKER, "engine.foreign.vllm_probes", "engine.foreign.vllm_decode", "engine.foreign.vllm_ops")
# our engine is one engine among the others: the registry loads it by its module's name (engine/registry.py), as it
# loads every engine, and no other module imports it
NATIVE = "engine.native"
# the edges into our engine that remain: none (the registry loads its module and its options by name)
INTO_NATIVE = set()
# the engine's vocabulary and its leaf, beneath every engine: they import no engine
BENEATH_ENGINES = ("engine.models", SHARED)
ENGINES = (NATIVE, "engine.foreign")


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """'engine.native.model' -> its file, for every module of the four packages and their subpackages (a
    package's ``__init__.py`` is the package: 'engine.native')."""
    out = {}
    for pkg in ORDER:
        root = ROOT / FOLDERS[pkg]
        for f in sorted(root.rglob("*.py")):
            parts = (pkg, *f.relative_to(root).with_suffix("").parts)
            if "toplevel" not in parts:
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _resolve(mod: str, node: ast.ImportFrom, is_package: bool = False) -> list[str]:
    """The project modules an ``from ... import ...`` names (relative, or absolute under prefill_diff)."""
    if node.level:
        here = mod.split(".") if is_package else mod.split(".")[:-1]  # the package the module sits in
        base = here[:len(here) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    elif node.module and node.module.startswith("prefill_diff."):
        target = node.module[len("prefill_diff."):]
    elif node.module == "prefill_diff":  # `from prefill_diff import jobs`
        target = ""
    else:
        return []
    names = [f"{target}.{a.name}".lstrip(".") for a in node.names if f"{target}.{a.name}".lstrip(".") in modules()]
    return names or ([target] if target else [])


def imports() -> dict[str, dict[str, int]]:
    """module -> {imported project module or third-party top name: line}, every import in the file (module
    level and inside functions alike)."""
    mods = modules()
    graph = defaultdict(dict)
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                found = _resolve(mod, node, path.name == "__init__.py") if (node.level or (node.module or "").startswith("prefill_diff")) \
                    else [node.module.split(".")[0]] if node.module else []
            elif isinstance(node, ast.Import):
                found = [a.name[len("prefill_diff."):] if a.name.startswith("prefill_diff.") else a.name.split(".")[0]
                         for a in node.names]
            else:
                continue
            for target in found:
                if (ROOT / (target.replace(".", "/") + ".c")).exists():
                    continue  # a compiled module of ours (dumps/_kernels.c): it imports nothing
                if target in mods or target.split(".")[0] not in ORDER:
                    graph[mod].setdefault(target, node.lineno)
                elif target.rsplit(".", 1)[0] in mods:  # `from .x import name`: the module x
                    graph[mod].setdefault(target.rsplit(".", 1)[0], node.lineno)
    return graph


def project_edges() -> dict[str, dict[str, int]]:
    mods = modules()
    return {m: {t: ln for t, ln in deps.items() if t in mods and t != m} for m, deps in imports().items()}


@pytest.mark.slow
def test_the_parser_sees_the_imports_it_must_judge():
    """The checks below are only as good as this: known edges of the code must be found."""
    edges = project_edges()
    assert "engine.shared.errors" in edges["dumps.reader"]
    assert "engine.native.kv_cache" in edges["engine.native.prefill"]
    assert "engine.models.budget" in edges["engine.prepared"]  # `from .models import budget`
    assert "dumps.reader" in edges["verify.report"] or any(m.startswith("dumps.") for m in edges["verify.report"])
    assert "jobs" in edges["cli.main"] and "jobs.sides" in edges["jobs"]  # `from .. import jobs`, `from . import sides`
    assert "torch" in imports()["engine.native.model"]


@pytest.mark.slow
def test_nothing_imports_from_a_package_to_its_right():
    bad = [f"{m} (line {ln}) imports {t}" for m, deps in project_edges().items() for t, ln in deps.items()
           if ORDER.index(t.split(".")[0]) > ORDER.index(m.split(".")[0])]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("pkg", ["dumps", "verify"])
def test_dumps_and_verify_import_neither_torch_nor_the_engine(pkg):
    bad = [f"{m} (line {ln}) imports {t}" for m, deps in imports().items() if m.split(".")[0] == pkg
           for t, ln in deps.items()
           if t in THIRD_PARTY_HEAVY or (t.startswith("engine") and t not in TRACE_VOCABULARY)]
    assert not bad, "\n".join(bad)


def test_what_dumps_may_import_of_the_models_imports_only_the_shared_leaf():
    for mod in TRACE_VOCABULARY:
        outside = [t for t in project_edges().get(mod, ()) if not t.startswith(SHARED)]
        assert not outside, (mod, outside)


@pytest.mark.slow
def test_only_the_vllm_worker_imports_vllm_and_it_imports_nothing_of_ours():
    """vLLM changes process-wide state when imported: it never enters prefill-diff's process. The worker and the
    modules it loads by path run in vLLM's; they import nothing of ours."""
    bad = [f"{m} (line {ln})" for m, deps in imports().items() if m not in WORKER_SIDE for t, ln in deps.items()
           if t == "vllm"]
    assert not bad, "\n".join(bad)
    assert "vllm" in imports()[VLLM_WORKER]
    for mod in WORKER_SIDE:
        assert not project_edges().get(mod), (mod, project_edges().get(mod))


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_shared_leaf_imports_nothing_of_ours_but_itself(leaf):
    outside = [t for t in project_edges().get(leaf, ()) if not t.startswith(SHARED)]
    assert not outside, outside


def test_every_module_of_the_shared_leaf_is_listed():
    assert sorted(m for m in modules() if m.startswith(SHARED)) == sorted(LEAVES)


def _within(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in ((packages,) if isinstance(packages, str) else packages))


def test_nothing_outside_our_engine_imports_it():
    bad = [f"{m} (line {ln}) imports {t}" for m, deps in project_edges().items() if not _within(m, NATIVE)
           for t, ln in deps.items() if _within(t, NATIVE) and (m, t) not in INTO_NATIVE]
    assert not bad, "\n".join(bad)


def test_the_registry_loads_our_engine_by_its_module_name():
    from prefill_diff.engine.registry import ENGINES as REGISTERED
    assert "engine." + REGISTERED["native"].module in modules()
    assert not any(_within(t, NATIVE) for t in project_edges()["engine.registry"])


def test_the_models_and_the_shared_leaf_import_no_engine():
    """No arrow back up inside engine/: the model vocabulary and the leaf lie beneath every engine."""
    bad = [f"{m} (line {ln}) imports {t}" for m, deps in project_edges().items() if _within(m, BENEATH_ENGINES)
           for t, ln in deps.items() if _within(t, ENGINES)]
    assert not bad, "\n".join(bad)


def _cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None
    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.slow
def test_no_import_cycle():
    cycle = _cycle(project_edges())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None


@pytest.mark.slow
def test_importing_dumps_and_verify_loads_no_torch():
    """The same rule, at run time: what the modules import transitively."""
    mods = [m for m in modules() if m.split(".")[0] in ("dumps", "verify")]
    code = "import sys\n" + "".join(f"import prefill_diff.{m}\n" for m in mods) + \
        "print(sorted(m for m in ('torch', 'transformers', 'llama_cpp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def package_graph() -> dict[tuple[str, str], int]:
    """(from package, to package) -> number of module-level edges between them."""
    count = defaultdict(int)
    for m, deps in project_edges().items():
        for t in deps:
            a, b = m.split(".")[0], t.split(".")[0]
            if a != b:
                count[(a, b)] += 1
    return dict(count)


if __name__ == "__main__":
    for (a, b), n in sorted(package_graph().items(), key=lambda x: (ORDER.index(x[0][0]), ORDER.index(x[0][1]))):
        print(f"{a:>7} -> {b:<7} {n} imports")
    for pkg in ORDER:
        files = [f for f in sorted((ROOT / FOLDERS[pkg]).rglob("*.py")) if pkg != "cli" or "toplevel" not in f.parts]
        lines = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)
        print(f"{pkg:>7}: {len(files)} files, {lines} lines")


# -- engine names are the registry's ------------------------------------------------------------------------

def _engine_modules() -> dict[str, str]:
    """Engine name -> the dotted prefix of its own modules (ours: the whole engine/native package)."""
    from prefill_diff.engine.registry import ENGINES
    return {name: "engine." + info.module.rsplit(".", 1)[0] if info.module.startswith("native.")
            else "engine." + info.module for name, info in ENGINES.items()}


def engine_name_comparisons(source: str, names) -> list[tuple[int, str]]:
    """(line, name) of each comparison (==, !=, in, not in) with an engine's name as a string constant, or a
    tuple/list/set of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if any(isinstance(c, ast.Attribute) and c.attr == "modules" for c in node.comparators):
            continue  # `"transformers" in sys.modules`: a package, not an engine
        for side in (node.left, *node.comparators):
            consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [(node.lineno, c.value) for c in consts
                      if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names]
    return found


def test_no_engine_name_is_compared_outside_the_registry_and_its_own_module():
    """What an engine can do is a capability in its registry entry; code elsewhere asks the entry, never the
    name (a new engine then touches the registry and its own module only)."""
    own = _engine_modules()
    bad = []
    for mod, path in modules().items():
        if mod == "engine.registry":
            continue
        hits = engine_name_comparisons(path.read_text(encoding="utf-8"), set(own))
        bad += [f"{mod}:{line} compares {name!r}" for line, name in hits if not mod.startswith(own[name])]
    assert not bad, bad


def test_the_engine_name_check_finds_a_comparison():
    src = ('if run.engine not in ("native", "transformers"):\n    pass\nx = engine == "vllm"\ny = a == "other"\n'
           'z = "transformers" in sys.modules\n')
    assert engine_name_comparisons(src, {"native", "transformers", "vllm"}) == \
        [(1, "native"), (1, "transformers"), (3, "vllm")]
