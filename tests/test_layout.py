"""The layout's rules, read from the source: imports point down, and no file or function grows
past what a reader takes in at once.

A stage's code dependencies are the import closure of its script (``workflow.code_deps``), and
code files are part of the run identity, so an import that points up makes an unrelated edit
rerun stages and discard checkpoints. The direction: ``paco.core`` <- ``paco.data``,
``paco.models`` <- ``paco.judge`` <- ``paco.grpo`` <- the reporting tools (``paco.compare``,
``paco.results``); ``stages`` and ``workflow`` sit on top, and nothing in ``paco`` imports them.
Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the floor of each part of ``paco``: a module may import its own part and the floors below
FLOORS = {"paco.core": 0, "paco.data": 1, "paco.models": 1, "paco.judge": 2, "paco.serving": 3, "paco.grpo": 4,
          "paco.compare": 5, "paco.results": 5, "paco.benchmark": 5, "paco.pretrain": 5}
#: limits for the project's code (paco, stages, workflow, benchmarks)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _part(module: str) -> str | None:
    for part in sorted(FLOORS, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return None


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved), at any level."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from paco import judge` imports paco.judge
    return out


def _sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def test_the_rules_read_real_imports():
    """The reader sees lazy and relative imports (else the direction test could pass on nothing)."""
    trainer = imports(ROOT / "paco" / "grpo" / "trainer.py")
    assert any(m.startswith("paco.core") for m in trainer) and any(m.startswith("paco.grpo.") for m in trainer)
    assert len(_sources("paco")) > 50


@pytest.mark.parametrize("path", _sources("paco"), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    here = _part(_module_name(path))
    wrong = []
    for m in sorted(imports(path)):
        top = m.split(".")[0]
        if top in ("workflow", "stages", "benchmarks", "tests"):
            wrong.append(f"{m} (nothing in paco imports {top})")
            continue
        there = _part(m)
        if here is None or there is None or there == here:
            continue
        if FLOORS[there] >= FLOORS[here]:
            wrong.append(f"{m} (floor {FLOORS[there]} from {here} on floor {FLOORS[here]})")
    assert not wrong, f"{path.relative_to(ROOT)} imports up or sideways: {wrong}"


def test_core_imports_nothing_above_it():
    """The issue's own wording: no module under paco/core imports paco.data, paco.judge,
    paco.grpo, paco.models or workflow."""
    banned = ("paco.data", "paco.judge", "paco.grpo", "paco.models", "workflow")
    found = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m.startswith(banned))
             for p in _sources("paco/core")}
    assert not {k: v for k, v in found.items() if v}


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("path", _sources("paco", "stages", "workflow", "benchmarks"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_readable(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_MODULE_LINES})"
    assert not _long_functions(path), f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines"


def _module_graph(*tops: str) -> dict[str, set[str]]:
    """Module name -> the project modules it imports (any level; names that are not modules of
    ``tops``, such as ``from m import a_function``, dropped)."""
    paths = {_module_name(p): p for p in _sources(*tops)}
    return {m: {i for i in imports(p) if i in paths and i != m} for m, p in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): each is a set of modules that import each other, directly or through others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_module_that_imports_it():
    """No import circle anywhere in ``paco`` (the serving package's client and local server
    once imported each other through a lazy module attribute)."""
    graph = _module_graph("paco")
    assert len(graph) > 50 and any(graph.values())
    assert import_cycles(graph) == []
