"""Imports run one way: services and the CLI import capycommon only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "capycommon": ROOT / "libs" / "capycommon" / "src" / "capycommon",
    "capyctl_router": ROOT / "services" / "router" / "src" / "capyctl_router",
    "capyctl_scheduler": ROOT / "services" / "scheduler" / "src" / "capyctl_scheduler",
    "capyctl_hostd": ROOT / "services" / "hostd" / "src" / "capyctl_hostd",
    "capyctl_memwatch": ROOT / "services" / "memwatch" / "src" / "capyctl_memwatch",
    "capyctl_cli": ROOT / "cli" / "src" / "capyctl_cli",
}


def imported_packages(package_dir: Path) -> dict[str, str]:
    """Top-level packages imported anywhere in a package -> the first file that does."""
    found: dict[str, str] = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], path.name)
    return found


@pytest.mark.parametrize("package", sorted(OURS))
def test_imports_run_one_way(package: str) -> None:
    allowed = {package} if package == "capycommon" else {package, "capycommon"}
    imported = imported_packages(OURS[package])
    wrong = {
        name: where for name, where in imported.items() if name in OURS and name not in allowed
    }
    assert wrong == {}, f"{package} may import only {sorted(allowed)}"


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("from capyctl_router.app import create_app\n")
    assert imported_packages(tmp_path) == {"capyctl_router": "mod.py"}


def test_every_package_is_installable_on_its_own() -> None:
    for folder in OURS.values():
        pyproject = folder.parents[1] / "pyproject.toml"
        assert pyproject.is_file(), f"{pyproject} is missing"
