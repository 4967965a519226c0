"""The executor package's import graph: no circle, and the engine core's
collaborators never import the core (they do not call back into it)."""

from __future__ import annotations

import ast
from pathlib import Path

import worker.executor

PACKAGE = Path(worker.executor.__file__).parent
PREFIX = "worker.executor."


def imports() -> dict[str, set[str]]:
    """Module -> the modules of worker/executor it imports (TYPE_CHECKING imports too)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.module == "worker.executor":
                    deps |= {a.name for a in node.names if (PACKAGE / f"{a.name}.py").exists()}
                elif node.module.startswith(PREFIX):
                    deps.add(node.module.removeprefix(PREFIX))
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix(PREFIX) for a in node.names if a.name.startswith(PREFIX)}
        graph[path.stem] = deps
    return graph


def test_no_module_of_the_executor_imports_itself_through_others() -> None:
    graph = imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            assert dep not in path, f"import circle: {' -> '.join([*path, dep])}"
            if dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])


def test_only_the_drivers_import_the_engine_core() -> None:
    importers = sorted(m for m, deps in imports().items() if "engine_core" in deps)
    assert importers == ["executor"]
