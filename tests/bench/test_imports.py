"""bench/ as a library and its commands: read from the sources (every import, those inside
functions too), no bench module imports another's private names, the library modules import
no command, and no import circle runs through bench/."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
# Modules run as commands (`python -m bench.<name>`, or a `make bench` section); the rest is library.
COMMANDS = {p.stem for p in BENCH.glob("*_bench.py")} | {"run", "tp_probe", "plots"}


def bench_imports(path: Path) -> list[tuple[str, str]]:
    """(bench module, name) for every name `path` imports from bench/; name '' for a whole module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name.removeprefix("bench.") or "__init__", "") for a in node.names
                      if a.name == "bench" or a.name.startswith("bench.")]  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bench":
                for a in node.names:  # `from bench import x`: a submodule, or a name of bench/__init__.py
                    is_module = (BENCH / f"{a.name}.py").exists()
                    found.append((a.name, "") if is_module else ("__init__", a.name))
            elif node.module.startswith("bench."):
                found += [(node.module.removeprefix("bench."), a.name) for a in node.names]
    return found


def graph() -> dict[str, list[tuple[str, str]]]:
    return {p.stem: bench_imports(p) for p in sorted(BENCH.glob("*.py"))}


def test_no_bench_module_imports_another_ones_private_names() -> None:
    private = [f"{m} imports {target}.{name}" for m, edges in graph().items() for target, name in edges
               if target != m and name.startswith("_")]  # fmt: skip
    assert private == []


def test_library_modules_import_no_command() -> None:
    found = [f"{m} imports {target}" for m, edges in graph().items() if m not in COMMANDS
             for target, _ in edges if target in COMMANDS]  # fmt: skip
    assert found == []


def test_no_import_circle_in_bench() -> None:
    edges = {m: {t for t, _ in e if t != m} for m, e in graph().items()}
    done: set[str] = set()
    circles: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            circles.append(" -> ".join([*path[path.index(m):], m]))
            return
        if m in done:
            return
        for t in sorted(edges.get(m, ())):
            visit(t, [*path, m])
        done.add(m)

    for m in edges:
        visit(m, [])
    assert circles == [], f"import circles: {circles}"


def test_the_check_sees_imports_inside_functions() -> None:
    # gpu_bench reaches tp_bench and quant_bench only from inside functions
    assert {"tp_bench", "quant_bench"} <= {t for t, _ in graph()["gpu_bench"]}
