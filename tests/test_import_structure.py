"""The package's import structure: no module of cbcore imports itself back through others (no import cycle), and the
import paths users may rely on keep working.

The walk reads the source with `ast`, so it sees every import, also those made inside a function: an import moved
into a function only to dodge a cycle is still the same cycle (it runs at some later call instead of at import
time). A package's `__init__.py` is a module like any other here, re-exports included, so a cycle through one is a
cycle. Importing a submodule also runs its package's `__init__.py`; that implicit step is not an edge, or every
module would sit in one cycle with the package's `__init__.py`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES
from dataclasses import dataclass
from pathlib import Path

import cbcore

PACKAGE = "cbcore"


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` of its file."""

    source: str
    target: str
    line: int


def package_modules(folder: Path, name: str | None = None) -> dict[str, Path]:
    """Every module of the package in `folder` (named `name`, the folder's name if not given): dotted name -> file. A
    package is its `__init__.py`; a compiled extension (cbcore._C) is a module whose file is not read: it imports no
    Python module of the package."""
    name = name or folder.name
    modules = {}
    for path in sorted(folder.rglob("*")):
        suffix = next((s for s in (".py", *EXTENSION_SUFFIXES) if path.name.endswith(s)), None)
        if suffix is None or not path.is_file():
            continue
        parts = [name, *path.relative_to(folder).parent.parts, path.name[:-len(suffix)]]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the package that importing `name` executes last: `name` itself, or the longest prefix of it
    that is a module (`cbcore.ops.StepKernelPlans` is `cbcore.ops`); None outside the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The package's modules that `module` imports anywhere in its file (module level, in functions, in classes),
    relative imports resolved: `from . import x` names the submodule x when there is one, else the package."""
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []
    if path.suffix != ".py":
        return edges
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from origin import name`: the submodule origin.name when there is one, the module origin otherwise.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        for name in targets:
            target = _known(name, modules)
            if target is not None:
                edges.append(Edge(module, target, node.lineno))
    return edges


def import_graph(modules: dict[str, Path]) -> dict[str, list[Edge]]:
    """module -> the edges from it, for every module of the package."""
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph, each a sorted list of modules (iterative: no recursion
    limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted({e.target for e in graph[start]})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({e.target for e in graph[child]}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def describe_cycle(component: list[str], graph: dict[str, list[Edge]], modules: dict[str, Path]) -> str:
    """One way round the cycle in `component`, import by import with the line that makes each, from its first
    module back to it (a breadth-first walk inside the component finds the shortest)."""
    members = set(component)
    start = component[0]
    came_by: dict[str, Edge] = {}
    frontier = [start]
    closing: Edge | None = None
    while frontier and closing is None:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target == start:
                    closing = edge
                    break
                if edge.target in members and edge.target not in came_by:
                    came_by[edge.target] = edge
                    following.append(edge.target)
            if closing is not None:
                break
        frontier = following
    assert closing is not None, f"{component} is not a cycle"
    path = [closing]
    while path[0].source != start:
        path.insert(0, came_by[path[0].source])
    root = modules[start.split(".")[0]].parent.parent  # the folder the package's own folder stands in

    def shown(module: str) -> Path:
        return modules[module].relative_to(root) if modules[module].is_relative_to(root) else modules[module]

    return "\n".join(f"  {shown(e.source)}:{e.line}  {e.source} -> {e.target}" for e in path)


def cycles(graph: dict[str, list[Edge]], modules: dict[str, Path]) -> list[str]:
    """Every import cycle of the graph, described: a component of more than one module, or a module importing
    itself."""
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1 or any(e.target == component[0] for e in graph[component[0]]):
            found.append(f"cycle of {len(component)} module(s): {', '.join(component)}\n"
                         + describe_cycle(component, graph, modules))
    return found


def cbcore_modules() -> dict[str, Path]:
    """cbcore's modules, with `cbcore.triton_kernels`: installed from the repository's top-level triton_kernels/, so
    it is not in cbcore's folder (setup.py maps it)."""
    modules = package_modules(Path(cbcore.__file__).parent)
    triton = importlib.util.find_spec(f"{PACKAGE}.triton_kernels")
    if triton is not None and triton.submodule_search_locations:
        modules.update(package_modules(Path(triton.submodule_search_locations[0]), f"{PACKAGE}.triton_kernels"))
    return modules


def test_no_module_of_cbcore_imports_itself_back_through_others() -> None:
    modules = cbcore_modules()
    found = cycles(import_graph(modules), modules)
    assert not found, "import cycles in cbcore:\n" + "\n".join(found)


def test_the_walk_sees_relative_and_function_level_imports() -> None:
    # Guards the test above against a walk that silently finds nothing: `cbcore.cli` imports its commands with a
    # relative import, and `serve` imports the server's launcher inside the function that runs it.
    modules = cbcore_modules()
    graph = import_graph(modules)
    assert "cbcore.cli.serve" in {e.target for e in graph["cbcore.cli"]}
    assert "cbcore.serving.server.launch" in {e.target for e in graph["cbcore.cli.serve"]}


def test_the_walk_reports_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import helper\n")
    (package / "sub" / "__init__.py").write_text("from .impl import helper\n")  # only re-exports
    (package / "sub" / "impl.py").write_text("def helper():\n    from .. import other\n")
    (package / "other.py").write_text("import pkg.sub\n")
    (package / "alone.py").write_text("import pkg.alone\n")
    modules = package_modules(package)
    found = sorted(cycles(import_graph(modules), modules))
    assert len(found) == 2
    assert found[0].startswith("cycle of 1 module(s): pkg.alone\n  pkg/alone.py:1  pkg.alone -> pkg.alone")
    assert found[1] == ("cycle of 3 module(s): pkg.other, pkg.sub, pkg.sub.impl\n"
                        "  pkg/other.py:1  pkg.other -> pkg.sub\n"
                        "  pkg/sub/__init__.py:1  pkg.sub -> pkg.sub.impl\n"
                        "  pkg/sub/impl.py:2  pkg.sub.impl -> pkg.other")


def test_cbcore_manager_is_still_the_managers_import_path() -> None:
    manager_module = importlib.import_module("cbcore.manager")
    assert manager_module.ContinuousBatchingManager is cbcore.ContinuousBatchingManager


def test_the_top_level_names_users_import_still_import() -> None:
    from cbcore import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, RequestStatus, enable

    assert all([ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, RequestStatus, enable])


def test_every_name_in_cbcore_all_is_there() -> None:
    missing = [name for name in cbcore.__all__ if not hasattr(cbcore, name)]
    assert not missing, f"cbcore.__all__ names {missing}, which cbcore does not define"
