"""The records are pure: `capycommon.domain` reaches no Redis, network nor filesystem, and the
code outside the state layer takes its records from there, never from `capycommon.state`.

A domain module may import the standard library's pure modules, pydantic, and the modules of
ours that are pure themselves (checked the same way, through every import they make);
imports under `if TYPE_CHECKING:` never run and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from importgraph import runtime_imports

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "libs" / "capycommon" / "src"
DOMAIN = SRC / "capycommon" / "domain"
STATE = SRC / "capycommon" / "state"
# The standard library's modules that neither do I/O nor reach the process's environment.
PURE_STDLIB = {
    "__future__", "collections", "dataclasses", "datetime", "enum", "functools", "math",
    "re", "typing",
}  # fmt: skip
THIRD_PARTY = {"pydantic", "pydantic_core", "annotated_types"}
OUTSIDE = [
    SRC / "capycommon",
    *sorted((ROOT / "services").glob("*/src/*")),
    ROOT / "cli" / "src" / "capyctl_cli",
]


def _file_of(module: str) -> Path | None:
    """The source of one of our modules (a package's __init__), or None for anything else."""
    base = SRC / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def impurities(module: str, seen: set[str] | None = None) -> list[str]:
    """`module: what` for each import of `module`, and of every module of ours it imports at
    run time (their packages' __init__ included), that is not pure."""
    seen = set() if seen is None else seen
    if module in seen:
        return []
    seen.add(module)
    path = _file_of(module)
    assert path is not None, module
    found: list[str] = []
    parts = module.split(".")
    for package in (".".join(parts[:i]) for i in range(1, len(parts))):
        found += impurities(package, seen)
    for node in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [str(node.module)]
        )
        for name in names:
            root = name.split(".")[0]
            if root == "capycommon":
                found += impurities(name, seen) if _file_of(name) else []
            elif root == "pathlib" and isinstance(node, ast.ImportFrom):
                found += [
                    f"{module}: pathlib.{alias.name}"
                    for alias in node.names
                    if not alias.name.startswith("Pure")
                ]
            elif root not in PURE_STDLIB | THIRD_PARTY:
                found.append(f"{module}: {name}")
    return found


def _domain_modules() -> list[str]:
    return sorted(f"capycommon.domain.{path.stem}" for path in DOMAIN.glob("[!_]*.py"))


@pytest.mark.parametrize("module", _domain_modules())
def test_the_domain_is_pure(module: str) -> None:
    assert impurities(module) == []


def test_the_check_sees_io_through_a_module_of_ours(tmp_path: Path) -> None:
    # capycommon.version reads nothing; capycommon.paths writes files (os, tempfile).
    assert impurities("capycommon.version") == []
    assert any(line.startswith("capycommon.paths: ") for line in impurities("capycommon.paths"))


def test_the_check_ignores_what_only_type_checking_imports() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import redis\n")
    assert [ast.unparse(node) for node in runtime_imports(tree)] == [
        "from typing import TYPE_CHECKING"
    ]


def _records_of_state() -> dict[str, set[str]]:
    """The classes each state module defines that are records (pydantic models, enums)."""
    records: dict[str, set[str]] = {}
    for path in STATE.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {
            node.name
            for node in tree.body
            if isinstance(node, ast.ClassDef)
            and any(ast.unparse(base) in {"BaseModel", "StrEnum", "_Frozen"} for base in node.bases)
        }
        records[f"capycommon.state.{path.stem}"] = names
    return records


def test_records_are_taken_from_the_domain_not_the_state_layer() -> None:
    records = _records_of_state()
    wrong = []
    for folder in OUTSIDE:
        for path in folder.rglob("*.py"):
            if STATE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in records:
                    wrong += [
                        f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
                        for alias in node.names
                        if alias.name in records[node.module]
                    ]
    assert wrong == [], "import these records from capycommon.domain"
