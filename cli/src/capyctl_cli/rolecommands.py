"""The role's commands: `capyctl start standalone|server|host`, `demo`, `init`, `run` and
`config show`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from capycommon import logs, peerfile
from capycommon.errors import InvalidConfig
from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.peerfile import PeerFile
from capycommon.settings import Role, redacted
from capycommon.settingsources import load_settings, locate_document
from capyctl_cli import demo as demo_cmd
from capyctl_cli import launcher, output, peers, programs, roles
from capyctl_cli.options import (
    ConfigOpt,
    JsonOpt,
    RoleArg,
    RoleOpt,
    StateDirOpt,
    command_group,
    expected_errors,
    role_of,
)
from capyctl_cli.settingflags import SettingsCommand, setting_flags

config_app = command_group("Inspect settings.")
demo_app = typer.Typer()
init_app = typer.Typer()
run_app = typer.Typer()

# The end of each `capyctl start <role>`'s help.
SETTINGS_HELP = (
    "Every setting (a.b_c in the role document) is also the flag --a-b-c and the variable "
    "CAPYCTL_A_B_C; precedence: flag > variable > document > default."
)


def start_command(role: Role, summary: str) -> typer.Typer:
    """`capyctl start <role>`, with one flag per setting of the role."""
    app = typer.Typer()

    @app.command(role, cls=SettingsCommand, help=f"{summary}\n\n{SETTINGS_HELP}")
    @expected_errors
    @setting_flags(role)
    def command(
        ctx: typer.Context,
        flags: dict[str, str | None],
        state_dir: StateDirOpt = None,
        config: ConfigOpt = None,
    ) -> None:
        _start(role, flags, state_dir, config)

    return app


def start_server_command(summary: str) -> typer.Typer:
    """`capyctl start server`: a role's flags, and the peer file a replicated server
    other than the first starts from."""
    app = typer.Typer()

    @app.command("server", cls=SettingsCommand, help=f"{summary}\n\n{SETTINGS_HELP}")
    @expected_errors
    @setting_flags("server")
    def command(
        ctx: typer.Context,
        flags: dict[str, str | None],
        state_dir: StateDirOpt = None,
        config: ConfigOpt = None,
        peer_file: peers.PeerFileOpt = None,
    ) -> None:
        peer = None if peer_file is None else peerfile.read(peer_file)
        _start("server", flags, state_dir, config, peer)

    return app


def _start(
    role: Role,
    flags: dict[str, str | None],
    state_dir: str | None,
    config: str | None,
    peer: PeerFile | None = None,
) -> None:
    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    paths = StatePaths(root_dir)
    logs.configure("capyctl", stream=sys.stdout)
    code = launcher.start(
        role, lambda: roles.prepare(role, root_dir, config, env, flags, peer), env, paths
    )
    raise typer.Exit(code)


start_standalone = start_command(
    "standalone", "Run everything on this machine: redis, router, scheduler, hostd and memwatch."
)
start_server = start_server_command(
    "Run the control plane: redis, router and scheduler (and, replicated, a Sentinel)."
)
start_host = start_command(
    "host", "Run a GPU host's agents: hostd and memwatch, joined to a server's Redis."
)


def _prepare(
    role: Role, state_dir: str | None, config: str | None, peer: PeerFile | None = None
) -> roles.Prepared:
    """The role made ready in the state dir the options name, as `start` makes it but with no
    setting flags."""
    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    return roles.prepare(role, root_dir, config, env, {}, peer)


@demo_app.command("demo")
@expected_errors
def demo(
    state_dir: Annotated[
        str | None,
        typer.Option("--state-dir", help="The demo's state dir.", show_default=False),
    ] = None,
    listen: Annotated[str, typer.Option("--listen", help="Inference listener.")] = "127.0.0.1:8443",
    management_listen: Annotated[
        str, typer.Option("--management-listen", help="Management listener (loopback).")
    ] = "127.0.0.1:7443",
) -> None:
    """Run the standalone role with example models on a simulated GPU (the engine simulator),
    and print how to use it."""
    state = Path(state_dir) if state_dir else demo_cmd.default_state_dir()
    raise typer.Exit(demo_cmd.run(state, listen, management_listen))


@init_app.command("init")
@expected_errors
def init(
    role: RoleArg,
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    peer_file: peers.PeerFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare a state dir for a role: folders, the role document and credentials (for a
    server joining replicated ones, those of its peer file)."""
    chosen = role_of(role)
    if peer_file is not None and chosen != "server":
        raise InvalidConfig(f"--peer-file is for a server; the {chosen} role takes none")
    peer = None if peer_file is None else peerfile.read(peer_file)
    prepared = _prepare(chosen, state_dir, config, peer)
    result = {
        "role": role,
        "state_dir": str(prepared.paths.root),
        "document": str(prepared.loaded.document) if prepared.loaded.document else None,
        "credentials": str(prepared.paths.credentials) if prepared.credentials else None,
    }
    output.show(
        result, f"Prepared the {role} role.\n{output.pairs(list(result.items()))}", as_json=as_json
    )


@run_app.command("run", hidden=True)
@expected_errors
def run_process(
    process: Annotated[
        str, typer.Argument(help="redis, sentinel, router, scheduler, hostd or memwatch.")
    ],
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Run one process of a role in the foreground (for systemd units and containers)."""
    chosen = role_of(role)
    prepared = _prepare(chosen, state_dir, config)
    if process not in prepared.processes:
        choices = ", ".join(prepared.processes)
        raise InvalidConfig(f"the {role} role has no process {process!r}; use one of {choices}")
    argv = programs.programs(chosen, prepared)
    program = next(p for p in argv if p.name == process)
    sys.stdout.flush()
    os.execv(program.argv[0], program.argv)  # noqa: S606 - a fixed argv, no shell


@config_app.command("show", cls=SettingsCommand)
@expected_errors
@setting_flags(None)  # every setting of every role; each role takes its own
def config_show(
    ctx: typer.Context,
    flags: dict[str, str | None],
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print every setting, its value and where it came from; never asks a running role.

    Takes the same setting flags as `capyctl start <role>` (listed below).
    """
    env = dict(os.environ)
    chosen = role_of(role)
    root_dir, state_source = resolve_state_dir(state_dir, env)
    document = locate_document(config, env, StatePaths(root_dir).role_document(chosen))
    loaded = load_settings(chosen, document=document, env=env, flags=flags)
    rows: list[tuple[str, Any, str, str | None]] = [
        ("state_dir", str(root_dir), state_source, None)
    ]
    rows += [
        (row.path, redacted(row.path, row.value), row.source, row.origin) for row in loaded.rows
    ]
    if as_json:
        output.emit_json(
            {
                "role": chosen,
                "document": str(document) if document else None,
                "settings": [
                    {"path": p, "value": v, "source": s, "origin": o} for p, v, s, o in rows
                ],
            }
        )
        return
    output.echo(f"role {chosen}; document {document or '(none)'}")
    output.echo(output.table(["SETTING", "VALUE", "SOURCE"], [row[:3] for row in rows]))
