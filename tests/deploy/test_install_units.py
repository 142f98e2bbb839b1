"""`capyctl install units ROLE` and `capyctl docs PAGE`: a role's systemd units written for the
capyctl that runs the command, each verified by systemd; a unit someone changed is kept unless
--force; the docs as the repository has them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capyctl_cli.install import units_of
from capyctl_cli.options import role_of
from deploy.test_systemd import (
    SYSTEMD,
    as_instances,
    clean_environment,
    needs_analyze,
    run_verify,
)
from support import CAPYCTL, capyctl, clean_env

REPO = SYSTEMD.parent


def installed(folder: Path, role: str, *extra: str) -> dict[str, Any]:
    done = capyctl("install", "units", role, "--dir", str(folder), *extra, "--json")
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@needs_analyze
@pytest.mark.parametrize("role", ["standalone", "server", "host"])
def test_a_roles_system_units_name_this_capyctl_and_verify(tmp_path: Path, role: str) -> None:
    answer = installed(tmp_path, role, "--system")
    assert answer["executable"] == CAPYCTL
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(units_of(role_of(role)))
    for unit in tmp_path.iterdir():
        if unit.suffix == ".service":
            execs = [line for line in unit.read_text().splitlines() if line.startswith("Exec")]
            assert any(line.startswith(f"ExecStart={CAPYCTL} ") for line in execs), unit.name
            assert all("/usr/local/bin/capyctl" not in line for line in execs), unit.name
    run_verify(as_instances(sorted(tmp_path.iterdir())), clean_environment(), user=False)


@needs_analyze
def test_a_users_units_go_where_systemd_reads_them_and_verify(tmp_path: Path) -> None:
    config, runtime = tmp_path / "config", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = clean_env(XDG_CONFIG_HOME=str(config), HOME=str(tmp_path))
    done = capyctl("install", "units", "host", "--user", env=env)
    assert done.returncode == 0, done.stderr
    folder = config / "systemd" / "user"
    assert done.stdout.startswith(f"The user units of the host role are in {folder}.\n")
    assert (
        "systemctl --user daemon-reload; systemctl --user enable --now capyctl-host" in done.stdout
    )
    verify_env = clean_environment() | {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(runtime)}
    run_verify(as_instances(sorted(folder.iterdir())), verify_env, user=True)


def test_a_changed_unit_is_kept_unless_forced(tmp_path: Path) -> None:
    executable = "/opt/capyctl/bin/capyctl"
    first = installed(tmp_path, "server", "--system", "--executable", executable)
    assert set(first["units"].values()) == {"written"}
    again = installed(tmp_path, "server", "--system", "--executable", executable)
    assert set(again["units"].values()) == {"unchanged"}
    edited = tmp_path / "capyctl-server.service"
    edited.write_text(edited.read_text() + "# mine\n")
    refused = capyctl("install", "units", "server", "--system", "--dir", str(tmp_path))
    assert refused.returncode != 0
    assert "differ from this release's units; pass --force" in refused.stderr
    assert edited.read_text().endswith("# mine\n"), "nothing written"
    assert f"ExecStart={executable} start %i" in (tmp_path / "capyctl@.service").read_text()
    forced = installed(tmp_path, "server", "--system", "--executable", executable, "--force")
    assert forced["units"][str(edited)] == "replaced"
    assert not edited.read_text().endswith("# mine\n")


def test_the_docs_are_the_repositorys_pages() -> None:
    listed = capyctl("docs")
    assert listed.returncode == 0, listed.stderr
    assert {"operations", "roles/host", "errors"} <= set(listed.stdout.split())
    page = capyctl("docs", "roles/host")
    assert page.stdout == (REPO / "docs" / "roles" / "host.md").read_text()
    missing = capyctl("docs", "nope")
    assert missing.returncode == 2
    assert "no page 'nope' in the docs; the pages: " in missing.stderr
