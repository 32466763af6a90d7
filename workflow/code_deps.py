"""A stage's code dependencies: the project source files its module imports, transitively
(:func:`code_closure`), so editing any module a stage runs reruns it in both engines
(``workflow/registry.py``) and changes its run identity (:mod:`paco.core.run_identity`).

Imports are read from the source (:mod:`ast`), never executed: module-level and function-level
(lazy) imports of ``paco`` and ``stages`` modules, the ``__init__.py`` of every package on the way,
and the submodule behind a name a package exports lazily (its ``_EXPORTS`` literal).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: top-level packages whose modules are the project's code
PROJECT_PACKAGES = ("paco", "stages")


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


@functools.cache
def _project_imports(path: Path) -> frozenset[Path]:
    """Files of the project modules ``path`` imports (module or function level), with the
    ``__init__.py`` of every package on the way (Python runs them too). Cached per file: one
    process parses each source file once, however many stages' closures walk it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] not in PROJECT_PACKAGES:
                continue
            for k in range(1, len(parts) + 1):
                f = _module_file(".".join(parts[:k]))
                if f is not None:
                    found.add(f)
                elif k == len(parts) and (init := _module_file(".".join(parts[:-1]))) is not None:
                    # a lazily exported name (``_EXPORTS = {name: submodule}`` in the package)
                    sub = _lazy_exports(init).get(parts[-1])
                    if sub and (f := _module_file(".".join(parts[:-1] + [sub]))) is not None:
                        found.add(f)
    return frozenset(found)


@functools.cache
def _lazy_exports(init: Path) -> dict[str, str]:
    """The ``_EXPORTS`` literal (name -> submodule) of a package ``__init__.py``, if any."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


@functools.cache
def code_closure(entry: str) -> tuple[str, ...]:
    """The project source files (relative to the repository root, sorted) that running ``entry``
    (``stages/<name>.py``) imports, transitively: every ``import`` / ``from ... import`` of a
    ``paco`` or ``stages`` module at any level of the file (lazy imports included).

    Raises:
        FileNotFoundError: ``entry`` does not exist.
    """
    start = ROOT / entry
    if not start.is_file():
        raise FileNotFoundError(entry)
    seen: set[Path] = set()
    todo = [start]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo += _project_imports(f) - seen
    return tuple(sorted(str(f.relative_to(ROOT)) for f in seen))
