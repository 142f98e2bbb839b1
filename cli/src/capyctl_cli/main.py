"""The `capyctl` command line: each command's module is imported when that command runs
(`lazy.py`), so `capyctl status` costs what status needs."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.version import __version__
from capyctl_cli import output
from capyctl_cli.lazy import Lazy, lazy_group, one
from capyctl_cli.options import DebugOpt, JsonOpt, StateDirOpt, expected_errors

DEPLOYMENTS = "capyctl_cli.deployments"
HOSTS = "capyctl_cli.hosts"
ROLES = "capyctl_cli.rolecommands"

start_app = typer.Typer(
    no_args_is_help=True,
    cls=lazy_group(
        {
            "deployment": one(f"{DEPLOYMENTS}:start_app"),
            "standalone": one(f"{ROLES}:start_standalone"),
            "server": one(f"{ROLES}:start_server"),
            "host": one(f"{ROLES}:start_host"),
        }
    ),
)
invite_app = typer.Typer(
    help="Invite a host, or another server, to join this server.",
    no_args_is_help=True,
    cls=lazy_group(
        {"host": one(f"{HOSTS}:invite_app"), "server": one("capyctl_cli.peers:invite_app")}
    ),
)
status_app = typer.Typer(
    help="Show the running role, or one deployment.",
    cls=lazy_group(
        {"deployment": one(f"{DEPLOYMENTS}:status_app"), "host": one(f"{HOSTS}:status_app")}
    ),
)
app = typer.Typer(
    name="capyctl",
    help="CapyCTL: your models on your GPUs, behind one OpenAI-compatible endpoint.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=lazy_group(
        {
            "demo": one(f"{ROLES}:demo_app"),
            "init": one(f"{ROLES}:init_app"),
            "run": one(f"{ROLES}:run_app"),
            "start": Lazy("capyctl_cli.main:start_app"),
            "config": Lazy(f"{ROLES}:config_app"),
            "engine": Lazy("capyctl_cli.engines:app"),
            "deploy": Lazy(f"{DEPLOYMENTS}:deploy_app"),
            "park": Lazy(f"{DEPLOYMENTS}:park_app"),
            "stop": Lazy(f"{DEPLOYMENTS}:stop_app"),
            "delete": Lazy(f"{DEPLOYMENTS}:delete_app"),
            "list": Lazy(f"{DEPLOYMENTS}:list_app"),
            "model": Lazy("capyctl_cli.models:model_app"),
            "drain": Lazy(f"{DEPLOYMENTS}:drain_app"),
            "undrain": Lazy(f"{DEPLOYMENTS}:undrain_app"),
            "status": Lazy("capyctl_cli.main:status_app"),
            "logs": Lazy(f"{DEPLOYMENTS}:logs_app"),
            "invite": Lazy("capyctl_cli.main:invite_app"),
            "join": Lazy(f"{HOSTS}:join_app"),
            "revoke": Lazy(f"{HOSTS}:revoke_app"),
            "install": Lazy("capyctl_cli.install:install_app"),
            "docs": one("capyctl_cli.install:docs_app"),
        }
    ),
)


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


@start_app.callback()
def start() -> None:
    """Run a role in the foreground, or start a deployment."""


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
    from capyctl_cli import status as status_cmd  # noqa: PLC0415 - only `capyctl status` needs it

    env = dict(os.environ)
    root_dir, _ = resolve_state_dir(state_dir, env)
    report = status_cmd.collect(StatePaths(root_dir))
    output.show(report, lambda: status_cmd.render(report), as_json=as_json)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
