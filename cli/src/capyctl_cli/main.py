"""The `capyctl` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from capycommon import logs
from capycommon.errors import InvalidConfig
from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.settings import Role, redacted
from capycommon.settingsources import load_settings, locate_document
from capycommon.version import __version__
from capyctl_cli import demo as demo_cmd
from capyctl_cli import deployments, engines, hosts, launcher, models, output, roles
from capyctl_cli import status as status_cmd
from capyctl_cli.options import (
    ConfigOpt,
    DebugOpt,
    JsonOpt,
    SettingsCommand,
    StateDirOpt,
    command_group,
    expected_errors,
    role_of,
    setting_flags,
)

app = typer.Typer(
    name="capyctl",
    help="CapyCTL: your models on your GPUs, behind one OpenAI-compatible endpoint.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
start_app = command_group("Run a role in the foreground.")
config_app = command_group("Inspect settings.")
app.add_typer(start_app, name="start")
app.add_typer(config_app, name="config")
app.add_typer(engines.app, name="engine")
app.add_typer(deployments.deploy_app, name="deploy")
app.add_typer(deployments.park_app, name="park")
app.add_typer(deployments.stop_app, name="stop")
app.add_typer(deployments.delete_app, name="delete")
app.add_typer(deployments.list_app, name="list")
app.add_typer(models.model_app, name="model")
app.add_typer(deployments.drain_app, name="drain")
app.add_typer(deployments.undrain_app, name="undrain")
deployments.verb_command(
    start_app,
    "start",
    "Start (or wake) a deployment; it also lifts an operator stop.",
    ("ready",),
    timeout_s=1800.0,
)
status_app = typer.Typer(help="Show the running role, or one deployment.")
app.add_typer(status_app, name="status")
status_app.command("deployment")(expected_errors(deployments.status_deployment))
status_app.command("host")(expected_errors(hosts.status_host))
logs_app = typer.Typer(help="Show an engine's recent log lines.")
app.add_typer(logs_app, name="logs")
logs_app.command("deployment")(expected_errors(deployments.logs_deployment))
app.add_typer(hosts.invite_app, name="invite")
app.add_typer(hosts.join_app, name="join")
app.add_typer(hosts.revoke_app, name="revoke")


def _version(value: bool) -> None:
    if value:
        output.echo(f"capyctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """CapyCTL: your models on your GPUs, behind one OpenAI-compatible endpoint."""


# The end of each `capyctl start <role>`'s help.
SETTINGS_HELP = (
    "Every setting (a.b_c in the role document) is also the flag --a-b-c and the variable "
    "CAPYCTL_A_B_C; precedence: flag > variable > document > default."
)


def start_command(role: Role, summary: str) -> None:
    """Register `capyctl start <role>`, with one flag per setting of the role."""

    @start_app.command(role, cls=SettingsCommand, help=f"{summary}\n\n{SETTINGS_HELP}")
    @expected_errors
    @setting_flags(role)
    def command(
        ctx: typer.Context,
        flags: dict[str, str | None],
        state_dir: StateDirOpt = None,
        config: ConfigOpt = None,
    ) -> None:
        env = dict(os.environ)
        root_dir, _ = resolve_state_dir(state_dir, env)
        paths = StatePaths(root_dir)
        logs.configure("capyctl", stream=sys.stdout)
        code = launcher.start(
            role, lambda: roles.prepare(role, root_dir, config, env, flags), env, paths
        )
        raise typer.Exit(code)


start_command(
    "standalone", "Run everything on this machine: redis, router, scheduler, hostd and memwatch."
)
start_command("server", "Run the control plane: redis, router and scheduler.")
start_command("host", "Run a GPU host's agents: hostd and memwatch, joined to a server's Redis.")


RoleArg = Annotated[str, typer.Argument(help="standalone, server or host.")]


@app.command("demo")
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


@app.command("init")
@expected_errors
def init(
    role: RoleArg,
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare a state dir for a role: folders, the role document and credentials."""
    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    prepared = roles.prepare(role_of(role), root_dir, config, env, {})
    result = {
        "role": role,
        "state_dir": str(prepared.paths.root),
        "document": str(prepared.loaded.document) if prepared.loaded.document else None,
        "credentials": str(prepared.paths.credentials) if prepared.credentials else None,
    }
    output.show(
        result, f"Prepared the {role} role.\n{output.pairs(list(result.items()))}", as_json=as_json
    )


@app.command("run", hidden=True)
@expected_errors
def run_process(
    process: Annotated[str, typer.Argument(help="redis, router, scheduler, hostd or memwatch.")],
    role: Annotated[str, typer.Option("--role", help="standalone, server or host.")] = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Run one process of a role in the foreground (for systemd units and containers)."""
    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    chosen = role_of(role)
    prepared = roles.prepare(chosen, root_dir, config, env, {})
    if process not in prepared.processes:
        choices = ", ".join(prepared.processes)
        raise InvalidConfig(f"the {role} role has no process {process!r}; use one of {choices}")
    argv = launcher.programs(chosen, prepared)
    program = next(p for p in argv if p.name == process)
    sys.stdout.flush()
    os.execv(program.argv[0], program.argv)  # noqa: S606 - a fixed argv, no shell


@config_app.command("show", cls=SettingsCommand)
@expected_errors
@setting_flags(None)  # every setting of every role; each role takes its own
def config_show(
    ctx: typer.Context,
    flags: dict[str, str | None],
    role: Annotated[str, typer.Option("--role", help="standalone, server or host.")] = "standalone",
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


@status_app.callback(invoke_without_command=True)
@expected_errors
def status(
    ctx: typer.Context,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the role running on the state dir: its processes, listeners and memory."""
    if ctx.invoked_subcommand is not None:
        return
    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    report = status_cmd.collect(StatePaths(root_dir))
    output.show(report, lambda: status_cmd.render(report), as_json=as_json)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
