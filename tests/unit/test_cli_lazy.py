"""`capyctl` imports a command's modules only when that command runs: a status or a park
does not load the role launcher, the settings tree, the deployment schema or the Redis
client; and every command of every group is still there, found by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capyctl_cli.lazy import LazyGroup
from support import capyctl, clean_env

# Loaded by `capyctl <argv>`, imported in a fresh interpreter.
LOADED = """
import json, sys
from capyctl_cli.main import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""
HEAVY = (
    "capyctl_cli.launcher",
    "capycommon.settings",
    "capycommon.hostsettings",
    "capycommon.deployments",
    "capycommon.service",
    "capycommon.httpserve",
    "redis",
    "cryptography",
)


def _loaded(*argv: str) -> set[str]:
    found = subprocess.run(
        [sys.executable, "-c", LOADED, *argv],
        capture_output=True,
        text=True,
        check=True,
        env=clean_env(),
        timeout=60,
    )
    return set(json.loads(found.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "argv",
    [
        ("--version",),
        ("status", "deployment", "nosuch", "--state-dir", "/nonexistent"),
        ("park", "deployment", "nosuch", "--state-dir", "/nonexistent"),
        ("list", "deployments", "--state-dir", "/nonexistent"),
    ],
)
def test_a_command_loads_only_what_it_needs(argv: tuple[str, ...]) -> None:
    loaded = _loaded(*argv)
    assert "capyctl_cli.main" in loaded
    assert not [m for m in loaded if m.startswith(HEAVY)], sorted(loaded & set(HEAVY))


def test_a_command_that_needs_the_settings_loads_them() -> None:
    loaded = _loaded("config", "show", "--state-dir", "/nonexistent")
    assert "capycommon.settings" in loaded


def _groups() -> list[tuple[str, ...]]:
    import typer.main

    from capyctl_cli.main import app

    root = typer.main.get_command(app)
    assert isinstance(root, LazyGroup)
    return [(name,) for name in root.table]


@pytest.mark.parametrize("argv", _groups())
def test_every_command_answers_its_help(argv: tuple[str, ...]) -> None:
    shown = capyctl(*argv, "--help")
    assert shown.returncode == 0, shown.stderr
    assert "Usage: capyctl" in shown.stdout
