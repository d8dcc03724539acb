"""fxmem's run-time imports form no cycle (issue 36).

Every module of the package is read with ``ast`` (nothing is imported), and each ``import`` or
``from ... import`` it runs, at module level or inside a function, becomes an edge to the fxmem module
it loads. Imports under ``if TYPE_CHECKING:`` run only for the type checker and are left out; the
``else:`` branch of such an ``if`` runs and is kept. ``from package import name`` is an edge to
``package.name`` where that is a module, else to ``package``.

pyproject.toml's import-linter contract keeps the stages layered; this test also covers the modules
inside one layer (``fxmem.report`` and ``fxmem.output``, ``fxmem.rules.ops`` and the rule modules),
which import-linter's layers contract does not look inside.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent / "fxmem"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _runtime_imports(node)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    """The fxmem modules one import statement loads."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def import_graph() -> nx.DiGraph:
    """fxmem's modules, with an edge from each to every fxmem module it imports at run time."""
    modules = _modules()
    names = set(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", names):
                if target in names and target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def _describe(graph: nx.DiGraph, cycle: list[tuple[str, str]]) -> str:
    return " -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in cycle) + f" -> {cycle[0][0]}"


def test_graph_sees_imports() -> None:
    """The walk finds real edges, both module-level and inside functions, and skips TYPE_CHECKING ones."""
    graph = import_graph()
    assert graph.has_edge("fxmem.api", "fxmem.report")
    assert graph.has_edge("fxmem.rules.ops", "fxmem.rules.registries")
    assert graph.has_edge("fxmem.step.training", "fxmem.rules.ops")  # inside a function
    assert not graph.has_edge("fxmem.output.render", "fxmem.report")  # annotations only


def test_relative_and_type_checking_imports(tmp_path: Path) -> None:
    src = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import x\n"
        "if TYPE_CHECKING:\n    from fxmem.d import y\nelse:\n    import fxmem.e\n"
        "def f():\n    from fxmem import g\n"
    )
    tree = ast.parse(src)
    names = {"fxmem", "fxmem.pkg", "fxmem.pkg.a", "fxmem.pkg.b", "fxmem.pkg.c", "fxmem.d", "fxmem.e", "fxmem.g"}
    found = {t for n in _runtime_imports(tree) for t in _targets(n, "fxmem.pkg.a", False, names)}
    assert found == {"typing", "fxmem.pkg.b", "fxmem.pkg.c", "fxmem.e", "fxmem.g"}


def test_no_import_cycle() -> None:
    graph = import_graph()
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    others = sorted(len(c) for c in nx.simple_cycles(graph))
    pytest.fail(f"run-time import cycle: {_describe(graph, cycle)} (cycle lengths in the graph: {others})")


def test_fxmem_measure_stays_a_function_once_its_module_is_imported() -> None:
    # Note [fxmem.measure, module and function]: importing the module sets the package's attribute to it.
    import torch.nn as nn

    import fxmem
    import fxmem.measure  # noqa: F401 - the import under test

    # Linear(4, 4) keeps its input, which is the input batch (not counted): 0 B saved at B=2.
    assert fxmem.measure(nn.Linear(4, 4), ["B,4"], batch=2).total == 0
