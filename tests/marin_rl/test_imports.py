"""The packages' imports, read from the source: no cycle between packages, and no package reaching
into another's private modules (tests and benchmarks may; marin_rl's own `_lazy`/`_upstream` are the
project's shared internals)."""

import ast
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
SUBPACKAGES = {name for name in PACKAGE_DIRS if name.count(".") == 1}
"""marin_rl.envs, marin_rl.server, ...: each one node of the graph (its submodules inside it)."""


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def node(module: str) -> str:
    """The package a module belongs to; marin_rl's own modules (config, types, cli...) are each a node."""
    return ".".join(module.split(".")[:2])


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """Imports under `if TYPE_CHECKING:` are annotations only: they run nothing."""
    return {
        id(inner)
        for outer in ast.walk(tree)
        if isinstance(outer, ast.If) and "TYPE_CHECKING" in ast.unparse(outer.test)
        for inner in ast.walk(outer)
    }


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every marin_rl import, at the top or inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    skipped, found = type_checking_nodes(tree), []
    for statement in ast.walk(tree):
        if id(statement) in skipped:
            continue
        if isinstance(statement, ast.Import):
            found += [(alias.name, statement.lineno) for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom):
            base = statement.module or ""
            if statement.level:
                package = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - statement.level + 1] + ([base] if base else []))
            found.append((base, statement.lineno))
            found += [(f"{base}.{a.name}", statement.lineno) for a in statement.names if f"{base}.{a.name}" in modules]
    return [(name, line) for name, line in found if name.split(".")[0] == "marin_rl"]


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """Package -> package it imports -> where; and the imports of another package's private module."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    private = []
    for module, path in sorted(modules.items()):
        source = node(module)
        for imported, line in imports_of(module, path, modules):
            target = node(imported)
            if target == source:
                continue
            where = f"{path.name if not path.is_relative_to(ROOT) else path.relative_to(ROOT)}:{line}"
            graph[source][target].append(where)
            inside = imported.split(".")[2:] if target in SUBPACKAGES else []
            if any(part.startswith("_") for part in inside):
                private.append(f"{where} imports {imported}")
    return graph, private


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages():
    graph, _ = import_graph(package_modules())
    found = cycles(graph)
    detail = [f"{a} -> {b} ({', '.join(graph[a][b][:2])})" for c in found for a in c for b in c if b in graph.get(a, {})]
    assert not found, "import cycles between packages:\n" + "\n".join(detail)


def test_no_package_imports_another_packages_private_module():
    _, private = import_graph(package_modules())
    assert not private, "use the package's public names (its __init__):\n" + "\n".join(private)


def test_the_checks_find_a_cycle_made_in_a_function_and_a_private_import(tmp_path):
    (tmp_path / "a.py").write_text("from marin_rl.server._app import build_app\n")
    (tmp_path / "b.py").write_text("def later():\n    from marin_rl.envs import Env\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from marin_rl.replay import Batch\n")
    modules = {"marin_rl.envs._a": tmp_path / "a.py", "marin_rl.server._b": tmp_path / "b.py", "marin_rl.learner._c": tmp_path / "c.py"}
    graph, private = import_graph(modules)
    assert cycles(graph) == [["marin_rl.envs", "marin_rl.server"]]
    assert private == ["a.py:1 imports marin_rl.server._app"]
    assert "marin_rl.replay" not in graph["marin_rl.learner"]  # annotations only


def test_the_run_config_imports_no_jax_levanter_or_ray():
    """Parsing a config (`marin-rl train --help`, a check that fails in a second) loads none of them."""
    heavy = ("jax", "levanter", "haliax", "equinox", "ray", "torch", "transformers")
    code = f"import sys, marin_rl.config; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr


def test_a_run_that_samples_in_process_does_not_import_the_openai_sdk():
    """The loop's modules leave `openai` to the samplers that talk HTTP: importing it adds about a second to
    every start-up on a 2-core CPU, and the quickstart's workers sample the embedded engine directly."""
    code = "import sys, marin_rl.orchestrator, marin_rl.workers, marin_rl.server, marin_rl.envs; print('openai' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
