"""The package's layers: no import circle, and the lower layers never import the higher ones.

The import graph is read from the source (every import statement, module-level or inside a
function, except those under ``if TYPE_CHECKING:``), so a lazy import that closes a circle is
caught as well as a module-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fedcore

PACKAGE = Path(fedcore.__file__).parent


def _module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Every imported name (``a.b`` or ``a.b.name``), skipping ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the fedcore modules it imports (a module importing its own package is not an
    edge: Python has initialised the package by then)."""
    modules = _module_files()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in _runtime_imports(ast.parse(path.read_text())):
            target = owner(imported)
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        for other in graph[node]:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_lower_layers_never_import_the_command_line() -> None:
    graph = import_graph()
    layers = (
        "fedcore.local",
        "fedcore.roles",
        "fedcore.simulation",
        "fedcore.protocols",
        "fedcore.sites",
    )
    for layer in layers:
        for module in [m for m in graph if m == layer or m.startswith(layer + ".")]:
            above = {m for m in reaches(graph, module) if m.startswith("fedcore.cli")}
            assert not above, f"{module} reaches {sorted(above)}"


def test_sites_never_import_a_role_or_the_simulation() -> None:
    """sites/ sits below roles/ (a site's client imports its binding and guard): it starts
    role processes through local/, never imports them."""
    graph = import_graph()
    for module in [m for m in graph if m.startswith("fedcore.sites")]:
        above = {
            m
            for m in reaches(graph, module)
            if m.startswith(("fedcore.roles", "fedcore.simulation", "fedcore.audit"))
        }
        assert not above, f"{module} reaches {sorted(above)}"


def test_spec_and_observe_import_no_runtime_layer() -> None:
    """The operator loads spec/ and observe/ without torch or the roles."""
    graph = import_graph()
    runtime = ("fedcore.roles", "fedcore.local", "fedcore.learning", "fedcore.protocols")
    for layer in ("fedcore.spec", "fedcore.observe.kube_status"):
        for module in [m for m in graph if m == layer or m.startswith(layer + ".")]:
            below = {m for m in reaches(graph, module) if m.startswith(runtime)}
            assert not below, f"{module} reaches {sorted(below)}"


def test_the_forkserver_preload_warms_every_role() -> None:
    """A forked role must find torch, its protocol, its data and its stores imported already:
    each one a role imports itself costs that much CPU in every client (2 cores, 10 clients).
    What only a server or KDC of some runs needs stays out (seconds of every start-up):
    scikit-learn (parses digits once per machine), dp-accounting and SciPy (epsilon), boto3
    (S3 checkpoints)."""
    warm = [
        "torch",
        "torch._dynamo",
        "fedcore.roles.server",
        "fedcore.roles.client",
        "fedcore.roles.kdc",
        "fedcore.protocols.mpdp.protocol",
        "fedcore.learning.data",
        "fedcore.learning.training",
        "fedcore.checkpoint",
    ]
    cold = ["sklearn", "scipy", "pandas", "dp_accounting", "boto3"]
    code = (
        "import importlib, sys\n"
        "from fedcore.local.launch import FEDCORE_ROLES, PRELOAD\n"
        "for name in [*PRELOAD, FEDCORE_ROLES.main_module]:\n"
        "    importlib.import_module(name)\n"
        f"print([m for m in {warm!r} if m not in sys.modules])\n"
        f"print([m for m in {cold!r} if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["[]", "[]"]
