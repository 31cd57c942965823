"""No import loops in the shared core and the worker services (issue 36): a module that imports,
directly or through others, a module that imports it back makes the import order matter (the torch
engine's package ``__init__`` -> ``engine`` -> ``scheduler`` -> the package; ``loom.service`` <->
``loom.service_token``). A package's modules import each other by their own names, and its
``__init__`` only re-exports.

An edge A -> M is ``import M`` or ``from M import x`` in A (M as written, relative imports resolved;
``from pkg import submodule`` names ``pkg``), at any depth but outside ``if TYPE_CHECKING:``, which
runs nothing. Loops are the strongly connected components of that graph with more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("loom", "rollout_svc", "reward_svc", "reflect_svc")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join([*parts, target] if target else parts)
                if target in modules:
                    out.add(target)
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_loop_finder_finds_a_package_imported_back_by_its_module() -> None:
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"p.a"}}
    assert loops(graph) == [["p", "p.a", "p.b"]]


def test_no_import_loops_in_the_core_and_the_worker_services() -> None:
    modules = module_files()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["rollout_svc.engines.torch"] >= {"rollout_svc.engines.torch.engine"}  # the graph is read
    assert loops(graph) == []
