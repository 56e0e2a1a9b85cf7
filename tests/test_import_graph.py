"""The package's import structure: no import cycle, not even through type-only imports,
and a pure transfer layer.

The graph is read from the source (``ast``), with imports inside functions counted (a
lazy import is still a dependency). Imports under ``if TYPE_CHECKING:`` never run, but a
cycle through them is still one class cut across modules (issue 37: four such circles
joined the registry's parts and split audit and transfer value types from their users),
so the cycle test counts them too; the documented package picture is of run-time imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvspec_traits"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, *, type_only: bool = False) -> set[str]:
    """Modules ``path`` imports at run time (module level or inside functions), and with
    ``type_only`` those it imports under ``if TYPE_CHECKING:`` too."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node) and not type_only:
            for other in node.orelse:
                visit(other)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            # `from pkg import submodule` imports the submodule
            found.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _graph(*, type_only: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for target in _imports(path, type_only=type_only):
            # importing a.b.c runs a/__init__ and a.b/__init__ first
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in files and prefix != name:
                    edges.add(prefix)
        # a submodule's package __init__ runs before it, which is not an edge of its own
        graph[name] = {t for t in edges if not name.startswith(t + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules in order (first repeated at the end)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time", "with-type-only"])
def test_the_package_has_no_import_cycle(type_only: bool) -> None:
    cycle = _cycle(_graph(type_only=type_only))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_type_only_imports_are_seen() -> None:
    # The type-only graph is a superset with edges of its own (extend.py imports the
    # built-in adapters' names for mypy only), so the test above reads them.
    runtime, typed = _graph(), _graph(type_only=True)
    assert all(runtime[m] <= typed[m] for m in runtime)
    assert "kvspec_traits._vllm_adapters" in typed["kvspec_traits.extend"]
    assert "kvspec_traits._vllm_adapters" not in runtime["kvspec_traits.extend"]


@pytest.mark.parametrize("package", ["transfer", "mooncake"])
def test_the_transfer_layer_and_its_second_backend_import_no_nixl_and_no_vllm(
    package: str,
) -> None:
    # transfer/ is the backend-neutral layer; mooncake/ the second production backend
    # that proves it: it moves bytes with what transfer/ offers and never touches the
    # NIXL shim.
    modules = [p for p in PACKAGE.rglob("*.py") if package in p.relative_to(PACKAGE).parts]
    assert modules, f"src/kvspec_traits/{package}/ is missing"
    forbidden = ("kvspec_traits.nixl", "kvspec_traits.vllm_connector", "vllm", "nixl", "numpy")
    bad = sorted(
        f"{p.relative_to(SRC)} imports {m}"
        for p in modules
        for m in _imports(p)
        if any(m == f or m.startswith(f + ".") for f in forbidden)
    )
    assert bad == []


# The packages of docs/architecture.md's picture; every other module is "core".
PACKAGES = ("_vllm_adapters", "transfer", "nixl", "mooncake", "vllm_connector", "audit", "migrate")


def _package_edges() -> dict[str, set[str]]:
    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "core"

    edges: dict[str, set[str]] = {p: set() for p in ("core", *PACKAGES)}
    for source, targets in _graph().items():
        for target in targets:
            if package(source) != package(target):
                edges[package(source)].add(package(target))
    return edges


def _documented_edges() -> dict[str, set[str]]:
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    documented: dict[str, set[str]] = {}
    for line in block.strip().splitlines():
        source, _, targets = (part.strip() for part in line.partition("->"))
        documented[source] = (
            set() if targets == "(nothing)" else {t.strip() for t in targets.split(",")}
        )
    return documented


def test_the_documented_import_picture_is_the_real_one() -> None:
    # docs/architecture.md draws who imports whom; a new arrow in the code (or a stale
    # one in the doc) fails here, naming the package.
    assert _documented_edges() == _package_edges()
