"""The house's size budget, kept by the tests: no source module over 500 lines and no
function over 60, with no list of exceptions. A module or function that grows past it is
split along a seam the code already has (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    *sorted((ROOT / "libs").glob("*/src")),
    *sorted((ROOT / "services").glob("*/src")),
    ROOT / "cli" / "src",
    ROOT / "bench",
]
MODULE_LINES = 500
FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return [path for folder in SOURCES for path in sorted(folder.rglob("*.py"))]


def test_the_sources_are_where_the_budget_looks() -> None:
    assert all(folder.is_dir() for folder in SOURCES), SOURCES
    assert len(_modules()) > 100, "the budget would look at too few modules to mean anything"


def test_no_module_passes_500_lines() -> None:
    over = []
    for path in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not over, f"modules over {MODULE_LINES} lines (split them):\n" + "\n".join(over)


def test_no_function_passes_60_lines() -> None:
    over = []
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    over.append(f"{where} {node.name}: {lines} lines")
    assert not over, f"functions over {FUNCTION_LINES} lines (split them):\n" + "\n".join(over)
