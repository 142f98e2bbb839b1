"""The scheduler plans from Redis alone: it never reads a host's disk.

A host's models reach it as the facts its hostd published (`capycommon.state.hostfacts`), and
binding a deployment (`capycommon.deployments.resolve`, `checkpoint`) takes them as values.
So none of that code may touch a filesystem: no `os`, `shutil` or concrete `Path`, no
`open`, no path method that looks at a disk.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAPYCOMMON = ROOT / "libs" / "capycommon" / "src" / "capycommon"
SCHEDULER = ROOT / "services" / "scheduler" / "src" / "capyctl_scheduler"
PLANNING = [
    *sorted(SCHEDULER.glob("*.py")),
    CAPYCOMMON / "deployments" / "resolve.py",
    CAPYCOMMON / "deployments" / "checkpoint.py",
    CAPYCOMMON / "state" / "hostfacts.py",
]

MODULES = frozenset({"os", "os.path", "shutil", "glob", "io", "tempfile"})
PURE_PATHS = frozenset({"PurePath", "PurePosixPath"})
# Path and os methods that look at a disk, by what they do.
READS = {"exists", "stat", "lstat", "open", "read_text", "read_bytes", "readlink", "samefile"}
LISTS = {"glob", "rglob", "iterdir", "walk", "scandir", "listdir"}
RESOLVES = {"is_file", "is_dir", "is_symlink", "expanduser", "resolve", "absolute"}
WRITES = {"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "chmod"}
MOVES = {"rename", "replace"}
DISK_METHODS = frozenset(READS | LISTS | RESOLVES | WRITES | MOVES)
# Receivers whose methods of those names are Redis commands (`client.exists(key)`).
REDIS = frozenset({"client", "redis", "pipe"})


def disk_uses(source: str) -> list[str]:
    """Each place in `source` that could look at a filesystem, as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "pathlib":
            found += [
                f"{node.lineno}: pathlib.{alias.name}"
                for alias in node.names
                if alias.name not in PURE_PATHS
            ]
        elif isinstance(node, ast.Call):
            called = node.func
            if isinstance(called, ast.Name) and called.id == "open":
                found.append(f"{node.lineno}: open()")
            elif (
                isinstance(called, ast.Attribute)
                and called.attr in DISK_METHODS
                and _receiver(called.value) not in REDIS
            ):
                found.append(f"{node.lineno}: .{called.attr}()")
    return sorted(found, key=lambda where: int(where.split(":")[0]))


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


@pytest.mark.parametrize("module", PLANNING, ids=lambda path: str(path.relative_to(ROOT)))
def test_planning_code_never_touches_a_filesystem(module: Path) -> None:
    assert disk_uses(module.read_text(encoding="utf-8")) == [], (
        f"{module.relative_to(ROOT)} looks at a disk; a host's facts come from its hostd "
        "(capycommon.state.hostfacts)"
    )


def test_the_check_sees_each_way_to_look_at_a_disk() -> None:
    source = """
import os
from pathlib import Path, PurePosixPath
from shutil import copy
Path("/m").exists()
open("/m/config.json")
folder.stat().st_size
root.glob("*.safetensors")
await self.state.client.exists(key)
PurePosixPath("/m").name
"""
    assert disk_uses(source) == [
        "2: import os",
        "3: pathlib.Path",
        "4: from shutil import ...",
        "5: .exists()",
        "6: open()",
        "7: .stat()",
        "8: .glob()",
    ]
