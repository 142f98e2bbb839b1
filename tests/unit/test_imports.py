"""Imports run one way: capycommon imports none of ours; the engine simulator imports
capycommon; services import capycommon only; the CLI imports capycommon and the simulator
(`capyctl demo` runs it)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from importgraph import cycles, part_imports

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "capycommon": ROOT / "libs" / "capycommon" / "src" / "capycommon",
    "enginesim": ROOT / "libs" / "enginesim" / "src" / "enginesim",
    "capyctl_router": ROOT / "services" / "router" / "src" / "capyctl_router",
    "capyctl_scheduler": ROOT / "services" / "scheduler" / "src" / "capyctl_scheduler",
    "capyctl_hostd": ROOT / "services" / "hostd" / "src" / "capyctl_hostd",
    "capyctl_memwatch": ROOT / "services" / "memwatch" / "src" / "capyctl_memwatch",
    "capyctl_cli": ROOT / "cli" / "src" / "capyctl_cli",
}
SERVICES = {"capyctl_router", "capyctl_scheduler", "capyctl_hostd", "capyctl_memwatch"}
# Each package -> the packages of ours it may import besides itself.
ALLOWED: dict[str, set[str]] = {
    "capycommon": set(),
    "enginesim": {"capycommon"},
    **{service: {"capycommon"} for service in SERVICES},
    "capyctl_cli": {"capycommon", "enginesim"},
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
    allowed = {package} | ALLOWED[package]
    imported = imported_packages(OURS[package])
    wrong = {
        name: where for name, where in imported.items() if name in OURS and name not in allowed
    }
    assert wrong == {}, f"{package} may import only {sorted(allowed)}"


def test_every_package_has_its_rule() -> None:
    assert set(ALLOWED) == set(OURS)


@pytest.mark.parametrize("package", sorted(SERVICES | {"capycommon"}))
def test_no_service_nor_capycommon_uses_the_simulator(package: str) -> None:
    assert "enginesim" not in ALLOWED[package]
    assert "enginesim" not in imported_packages(OURS[package])
    pyproject = tomllib.loads((OURS[package].parents[1] / "pyproject.toml").read_text())
    requires = [r.split(">")[0].split("=")[0].strip() for r in pyproject["project"]["dependencies"]]
    assert "enginesim" not in requires


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("from capyctl_router.app import create_app\n")
    assert imported_packages(tmp_path) == {"capyctl_router": "mod.py"}


def test_the_check_sees_the_simulator_imported_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("def f() -> None:\n    import enginesim.install\n")
    assert imported_packages(tmp_path) == {"enginesim": "mod.py"}


def test_every_package_is_installable_on_its_own() -> None:
    for folder in OURS.values():
        pyproject = folder.parents[1] / "pyproject.toml"
        assert pyproject.is_file(), f"{pyproject} is missing"


def test_no_two_parts_of_capycommon_import_each_other() -> None:
    assert cycles(part_imports(OURS["capycommon"])) == []


def test_the_cycle_check_finds_a_cycle_through_a_third_part(tmp_path: Path) -> None:
    root = tmp_path / "capycommon"
    for name, text in {
        "state/records.py": "from capycommon.deployments import Deployment\n",
        "deployments/__init__.py": "from capycommon.units import parse_size\n",
        "units.py": "import capycommon.state.records\n",
        "domain/models.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from capycommon.state import records\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = part_imports(root)
    assert "domain" not in graph, "an import only a type checker reads is no edge"
    assert cycles(graph) == [
        ["deployments", "units", "state", "deployments"],
        ["state", "deployments", "units", "state"],
        ["units", "state", "deployments", "units"],
    ]
