"""What our modules import when they run, and the cycles among the parts of a package."""

from __future__ import annotations

import ast
from pathlib import Path


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module makes when it runs: not those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _part_of(module: str) -> str | None:
    """The part of capycommon a module belongs to: its subpackage, or itself when it sits at
    the top (`capycommon.state.keys` -> `state`, `capycommon.units` -> `units`)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "capycommon" and len(parts) > 1 else None


def part_imports(root: Path) -> dict[str, set[str]]:
    """Each part of the package at `root` -> the other parts it imports when it runs (what
    only a type checker reads, under `if TYPE_CHECKING:`, aside)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        relative = path.relative_to(root.parent).with_suffix("").parts
        part = _part_of(".".join(relative))
        if part is None or part == "__init__":
            continue
        for node in runtime_imports(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "capycommon":
                names = [f"capycommon.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                other = _part_of(name)
                if other is not None and other != part:
                    graph.setdefault(part, set()).add(other)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path for each part that reaches itself again through the others' imports."""
    found = []
    for start in sorted(graph):
        paths = [[start]]
        seen = {start}
        while paths:
            path = paths.pop()
            for other in sorted(graph.get(path[-1], ())):
                if other == start:
                    found.append([*path, start])
                    paths = []
                    break
                if other not in seen:
                    seen.add(other)
                    paths.append([*path, other])
    return found
