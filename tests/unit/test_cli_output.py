"""The CLI prints through one module: no bare print() elsewhere in capyctl_cli."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[2] / "cli" / "src" / "capyctl_cli"


def printing(path: Path) -> list[int]:
    """The lines of a module that call print()."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]


def test_only_the_output_module_prints() -> None:
    found = {
        path.name: lines
        for path in sorted(CLI.rglob("*.py"))
        if path.name != "output.py" and (lines := printing(path))
    }
    assert found == {}, "print through capyctl_cli.output"


def test_the_check_sees_a_print(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("def f() -> None:\n    print('x')\n")
    assert printing(module) == [2]
