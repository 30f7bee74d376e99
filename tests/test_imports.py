"""The package's modules import each other without a circle (type-only imports included).

A circle is where one module's design leaks into another's: handles used to reach into the
table's private state (leases.py imported table.py for it, table.py leases.py), and now get
what they use from a TableParts (parts.py).  This reads every import statement of the
package, those under `if TYPE_CHECKING:` too, and looks for a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shmslots"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports (a name imported from a package is the
    module of that name if there is one, else the package)."""
    name = _module_name(path)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return (found & modules) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            if found := visit(nxt, [*path, node]):
                return found
        done.add(node)
        return None

    return next((c for start in sorted(graph) if (c := visit(start, []))), None)


def test_no_module_of_the_package_imports_itself_round_a_circle() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    compiled = "shmslots._core"  # C: it imports none of the package's modules
    modules = {_module_name(p) for p in files} | {compiled}
    # the package's __init__ re-exports the API: it imports everything, and nothing may
    # import it back (a module that did would be in a circle through it)
    graph = {_module_name(p): _imports(p, modules) for p in files} | {compiled: set()}
    assert "shmslots.leases" in graph and "shmslots.table" in graph["shmslots"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_check_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
