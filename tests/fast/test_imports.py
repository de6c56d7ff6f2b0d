"""Imports: hvd_spark's modules form no cycle, nor do its packages (each imports only the packages below
it), and the modules other processes start from import alone.

The graph is built statically from every module's syntax tree: imports at the top and inside
functions alike (an import inside a function that closes a cycle is a cycle all the same: it only
waits for its first call to break), relative imports resolved. ``from pkg import name`` is an edge to
``pkg`` and, when ``name`` is a module, to ``pkg.name``; a module's own parent packages are not
edges (Python initializes them before the module). Names imported from strings (``importlib``: the
lazy public names, a warm server's payloads, which run in another process) are not edges; the fresh
interpreters below import the modules those reach first.

Like Ray's ``test_circular_imports.py``, but without importing anything: the check takes a moment.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import hvd_spark

ROOT = pathlib.Path(hvd_spark.__file__).parent

# What other processes start from: a rank's process and a warm server (``python -m``), the Spark task
# (its closure), the mpirun rsh agent, a transform's UDF worker, a warm server's inference child, what
# ranks send their messages with, the user's own imports.
ENTRY_POINTS = (
    "hvd_spark",
    "hvd_spark.errors",
    "hvd_spark._internal.common.forks",
    "hvd_spark._internal.common.service",
    "hvd_spark._internal.driver.coordinator",
    "hvd_spark._internal.infer.batching",
    "hvd_spark._internal.infer.cache",
    "hvd_spark._internal.infer.child",
    "hvd_spark._internal.infer.remote",
    "hvd_spark._internal.rank.entry",
    "hvd_spark._internal.task.barrier",
    "hvd_spark._internal.task.mpi",
    "hvd_spark._internal.task.mpi_agent",
    "hvd_spark._internal.task.warm",
)

# The layers of hvd_spark/_internal (docs/architecture.md's table), bottom first: what each package may
# import, at the top or inside a function. ``hvd_spark.errors`` (which imports nothing of hvd_spark) is
# below them all; the root modules (``hvd_spark``, ``_run``, ``_session``, ``keras``, ...) are above them.
MAY_IMPORT: dict[str, set[str]] = {
    "common": set(),  # the bottom layer: every process imports it
    "task": {"common"},
    "data": {"common"},
    "driver": {"common", "task", "data"},
    "rank": {"common", "data"},
    "infer": {"common", "task", "rank"},
    "ml": {"common", "data", "driver", "rank", "infer"},
}
ERRORS = "hvd_spark.errors"


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file, for the package at ``root`` (a package's name is its ``__init__.py``'s)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, its relative dots resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise ImportError(f"{module}: a relative import beyond the top-level package (level {node.level})")
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports anywhere in its code."""
    files = module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, is_package, node)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in files and t != module)
    return graph


def package_of(module: str, internal: str = "hvd_spark._internal") -> str:
    """A module's node in the package graph: its package of ``internal``, else itself (a root module)."""
    prefix = internal + "."
    return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else module


def package_graph(graph: dict[str, set[str]], internal: str = "hvd_spark._internal") -> dict[str, set[str]]:
    """Package -> the other packages (and root modules) its modules import, from the module graph."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module, internal), set()).update(package_of(t, internal) for t in targets)
    return {p: targets - {p} for p, targets in packages.items()}


def _imports_between(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The module imports that make package ``a`` import package ``b``."""
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if package_of(m) == a for t in ts if package_of(t) == b)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")  # a component always has one


def test_hvd_spark_has_no_import_cycle():
    graph = import_graph(ROOT)
    # The graph sees what it must: imports inside functions, and from a package, its modules.
    assert "hvd_spark._internal.task.mpi" in graph["hvd_spark._internal.task.barrier"]  # inside run_task
    assert "hvd_spark._internal.task.warm" in graph["hvd_spark._internal.task.barrier"]  # from ...task import warm
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (each module imports the next, at the top or inside a function):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_the_packages_form_no_import_cycle():
    graph = import_graph(ROOT)
    packages = package_graph(graph)
    assert {"common", "data", "driver", "infer", "ml", "rank", "task", "hvd_spark", ERRORS} <= set(packages)
    cycles = find_cycles(packages)
    assert not cycles, "import cycles between packages (each imports the next, through these modules):\n" + "\n".join(
        " -> ".join(c) + "\n" + "\n".join(f"  {e}" for a, b in zip(c, c[1:]) for e in _imports_between(graph, a, b))
        for c in cycles
    )


def test_each_package_imports_only_the_layers_below_it():
    graph = import_graph(ROOT)
    packages = package_graph(graph)
    internal = sorted(p.name for p in (ROOT / "_internal").iterdir() if (p / "__init__.py").exists())
    assert internal == sorted(MAY_IMPORT), "give each package of _internal its layer in MAY_IMPORT"
    assert find_cycles(MAY_IMPORT) == []  # the layers themselves
    assert packages[ERRORS] == set(), "hvd_spark.errors, below every package, imports nothing of hvd_spark"
    wrong = {
        f"{p} -> {q}": _imports_between(graph, p, q)
        for p in internal
        for q in sorted(packages[p] - MAY_IMPORT[p] - {ERRORS})
    }
    assert not wrong, f"imports against the layers (docs/architecture.md): {wrong}"
    assert packages["common"] <= {ERRORS}  # the bottom layer: no other package of _internal


def test_the_package_graph_finds_a_cycle_no_module_closes(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("_internal", "_internal/a", "_internal/b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "_internal" / "a" / "x.py").write_text("from ..b import y\nfrom ...errors import E\n")
    (pkg / "_internal" / "b" / "y.py").write_text("")
    (pkg / "_internal" / "b" / "z.py").write_text("def f():\n    from pkg._internal.a import w\n")
    (pkg / "_internal" / "a" / "w.py").write_text("")
    graph = import_graph(pkg)
    assert find_cycles(graph) == []  # x -> y and z -> w: no module imports one that imports it back
    packages = package_graph(graph, internal="pkg._internal")
    assert packages == {"pkg": set(), "pkg._internal": set(), "pkg.errors": set(), "a": {"b", "pkg.errors"}, "b": {"a"}}
    assert find_cycles(packages) == [["a", "b", "a"]]
    (pkg / "_internal" / "b" / "z.py").write_text("")
    assert find_cycles(package_graph(import_graph(pkg), internal="pkg._internal")) == []


def test_the_graph_finds_a_cycle_through_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a  # the package loads its module\n")
    (pkg / "sub" / "a.py").write_text("import json\n\n\ndef f():\n    from ..b import g\n    return g\n")
    (pkg / "b.py").write_text("from .sub.c import h\n")
    (pkg / "sub" / "c.py").write_text("from .. import sub\nfrom . import a\n")
    graph = import_graph(pkg)
    assert graph == {
        "pkg": set(),
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": {"pkg.sub.a"},
        "pkg.sub.a": {"pkg.b"},
        "pkg.sub.c": {"pkg", "pkg.sub", "pkg.sub.a"},
    }
    assert find_cycles(graph) == [["pkg.b", "pkg.sub.c", "pkg.sub.a", "pkg.b"]]
    (pkg / "sub" / "a.py").write_text("import json\n")  # the import inside f was the back edge
    assert find_cycles(import_graph(pkg)) == []


def test_the_payloads_of_the_warm_servers_name_functions_that_exist():
    """A warm server imports a payload's target only in the child it forks: a wrong name would show
    only there (the fast tier imports these light modules here, nothing heavy)."""
    import importlib

    from hvd_spark._internal.infer.remote import PAYLOAD
    from hvd_spark._internal.task.barrier import RANK

    for payload in (RANK, PAYLOAD):
        module, _, function = payload.target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), payload


def test_the_entry_points_of_other_processes_import_alone():
    """Each module first in an interpreter of its own (all of them at once: a slow machine's
    interpreters start in parallel): a cycle or a missing import shows whatever the import order."""
    procs = {
        m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stderr=subprocess.PIPE, text=True)
        for m in ENTRY_POINTS
    }
    failed = {}
    for m, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failed[m] = err[-1500:]
    assert not failed, "\n".join(f"import {m} alone failed:\n{err}" for m, err in failed.items())


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_is_a_module(module):
    assert module in module_files(ROOT), f"{module} is not a module of hvd_spark any more: update ENTRY_POINTS"
