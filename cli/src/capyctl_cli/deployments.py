"""`capyctl deploy|start|park|stop|delete|status deployment`, `list ...`, `drain ...`:
the management API from the command line."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from capycommon.deployments import load_deployment
from capycommon.errors import CapyError
from capycommon.management import (
    Action,
    Binding,
    DeploymentStatus,
    DeploymentSummary,
    EngineRow,
    HostRow,
    Idle,
    Startup,
)
from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.units import format_duration, format_size
from capycommon.yamldoc import load_yaml_document
from capyctl_cli import output
from capyctl_cli.management import Management, wait_for
from capyctl_cli.options import JsonOpt, StateDirOpt, expected_errors

WaitOpt = Annotated[bool, typer.Option("--wait", help="Wait until it is done.")]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds --wait waits at most.", min=1)
]
NameArg = Annotated[str, typer.Argument(help="The deployment's name.", show_default=False)]

deploy_app = typer.Typer(help="Declare what to serve.", no_args_is_help=True)
park_app = typer.Typer(help="Park a deployment: its engine gives its GPU memory back.",
                       no_args_is_help=True)  # fmt: skip
stop_app = typer.Typer(help="Stop a deployment; requests get deployment_stopped until a start.",
                       no_args_is_help=True)  # fmt: skip
delete_app = typer.Typer(help="Stop and forget a deployment (model files stay).",
                         no_args_is_help=True)  # fmt: skip
list_app = typer.Typer(help="List deployments, engines or hosts.", no_args_is_help=True)
drain_app = typer.Typer(help="Stop every engine on a host; deployments stay on demand.",
                        no_args_is_help=True)  # fmt: skip


def _api(state_dir: str | None) -> Management:
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    return Management(StatePaths(root))


def _state_is(*states: str) -> Callable[[DeploymentStatus], bool]:
    return lambda status: status.state in states


@deploy_app.command("model")
@expected_errors
def deploy_model(
    file: Annotated[Path, typer.Option("--file", "-f", help="The deployment document (YAML).")],
    wait: Annotated[
        bool, typer.Option("--wait", help="Start it and wait until it is ready.")
    ] = False,
    timeout: TimeoutOpt = 1800.0,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Declare a deployment (or a new revision of it) from a YAML document."""
    load_deployment(file)  # every problem of the document, named with its file, before sending
    with _api(state_dir) as api:
        answer = api.deploy(load_yaml_document(file))
        name = answer.deployment
        text = f"deployment {name} revision {answer.revision} ({answer.change})"
        if wait:
            since = time.time()
            api.act(name, "start")
            wait_for(api, name, _state_is("ready"), timeout, "ready", since)
            text += "; ready"
        output.show(answer, text, as_json=as_json)


def _act(state_dir: str | None, name: str, verb: Action, wait: bool, timeout: float,
         as_json: bool, done: tuple[str, ...]) -> None:  # fmt: skip
    with _api(state_dir) as api:
        since = time.time()
        answer = api.act(name, verb)
        text = f"deployment {name}: {verb} accepted"
        if wait and verb == "delete":
            _wait_gone(api, name, timeout)
            text = f"deployment {name}: deleted"
        elif wait:
            status = wait_for(api, name, _state_is(*done), timeout, " or ".join(done), since)
            text = f"deployment {name}: {status.state}"
        output.show(answer, text, as_json=as_json)


def _wait_gone(api: Management, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            api.status(name)
        except CapyError as exc:
            if exc.code == "not_found":
                return
            raise
        time.sleep(0.25)
    raise CapyError(f"deployment {name!r} is still being deleted after {timeout:.0f}s",
                    code="activation_timeout")  # fmt: skip


def verb_command(
    app: typer.Typer, verb: Action, summary: str, done: tuple[str, ...], timeout_s: float
) -> None:
    """Register `capyctl <verb> deployment NAME [--wait]` on `app`."""

    @app.command("deployment", help=summary)
    @expected_errors
    def command(
        name: NameArg,
        wait: WaitOpt = False,
        timeout: TimeoutOpt = timeout_s,
        state_dir: StateDirOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        _act(state_dir, name, verb, wait, timeout, as_json, done)


verb_command(park_app, "park", "Park a ready deployment at its residency tier.", ("parked",),
             600.0)  # fmt: skip
verb_command(stop_app, "stop", "Stop a deployment's engine and keep it stopped until `start "
             "deployment`.", ("stopped",), 600.0)  # fmt: skip
verb_command(delete_app, "delete", "Stop a deployment's engine and forget the deployment.",
             (), 600.0)  # fmt: skip


def status_deployment(
    name: NameArg,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a deployment: its state, instances, memory charges and last operation."""
    with _api(state_dir) as api:
        status = api.status(name)
    output.show(status, lambda: render_status(status), as_json=as_json)


def render_status(status: DeploymentStatus) -> str:
    last = status.last_operation
    lines = [
        output.pairs([
            ("deployment", status.name),
            ("state", status.state),
            ("revision", status.revision),
            ("routes", ", ".join(status.routes)),
            ("activation", status.activation),
            ("startup", _startup(status.startup)),
            ("last operation", f"{last.kind}: {last.reason}" if last else "-: -"),
            ("idle", _idle(status.idle)),
            *_residencies(status.bindings),
        ]),
    ]  # fmt: skip
    if status.instances:
        rows = [
            [i.index, i.host, i.gpu, i.state, i.generation, i.last_error] for i in status.instances
        ]
        lines += ["", output.table(["INSTANCE", "HOST", "GPU", "STATE", "GENERATION", "ERROR"],
                                   rows)]  # fmt: skip
    if status.charges:
        rows = [[c.host, c.domain, c.phase, _size(c.bytes), c.provenance] for c in status.charges]
        lines += ["", output.table(["HOST", "DOMAIN", "PHASE", "CHARGE", "FROM"], rows)]
    for binding in status.bindings:
        if binding.error is not None:
            lines.append(f"\n{binding.host}: error [{binding.error.code}]: {binding.error.message}")
    return "\n".join(lines)


def _startup(startup: Startup | None) -> str:
    """The startup peak, device and host, with where each figure came from."""
    if startup is None:
        return "- device (-), - host (-)"
    return (
        f"{_size(startup.device_bytes)} device ({startup.device_provenance}), "
        f"{_size(startup.host_bytes)} host ({startup.host_provenance})"
    )


def _residencies(bindings: list[Binding]) -> list[tuple[str, str]]:
    """Each host's park tier and why, and whether deep parking is off there."""
    rows = []
    for binding in bindings:
        if binding.residency is not None:
            text = f"{binding.residency} on {binding.host} ({binding.residency_reason})"
            rows.append(("residency", text))
        if binding.deep_park is False:
            rows.append(("deep parking", f"off on host {binding.host} (host.deep_park: off)"))
    return rows


def _idle(idle: Idle) -> str:
    """When the model next gives its memory back: `parks at 14:05:09 (in 4m 51s; idle 5m)`."""
    if idle.protected:
        return "never parks or stops when idle (warm or explicit)"
    step = idle.next
    timeouts = (
        f"ready {_timeout(idle.ready_idle_timeout)}, parked {_timeout(idle.parked_idle_timeout)}"
    )
    if step is None:
        return f"nothing due (idle timeouts: {timeouts})"
    verb = "parks" if step.action == "park" else "stops"
    at = time.strftime("%H:%M:%S", time.localtime(step.at))
    left = max(0, round(step.at - time.time()))
    return f"{verb} at {at} (in {left // 60}m {left % 60:02d}s if nobody asks; {timeouts})"


def _timeout(seconds: float | None) -> str:
    return "never" if seconds is None else format_duration(seconds)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


@list_app.command("deployments")
@expected_errors
def list_deployments(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """NAME, STATE, READY, REVISION, HOSTS of every deployment."""
    with _api(state_dir) as api:
        rows = api.deployments()
    output.show(rows, lambda: render_deployments(rows), as_json=as_json)


def render_deployments(rows: list[DeploymentSummary]) -> str:
    return output.table(
        ["NAME", "STATE", "READY", "REVISION", "HOSTS"],
        [[r.name, r.state, r.ready, r.revision, ",".join(r.hosts) or "-"] for r in rows],
    )


@list_app.command("engines")
@expected_errors
def list_engines(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """The engines each host has published."""
    with _api(state_dir) as api:
        rows = api.engines()
    output.show(rows, lambda: render_engines(rows), as_json=as_json)


def render_engines(rows: list[EngineRow]) -> str:
    return output.table(
        ["HOST", "NAME", "FAMILY", "VERSION", "VERIFIED"],
        [[r.host, r.name, r.family, r.version, r.verified] for r in rows],
    )


@list_app.command("hosts")
@expected_errors
def list_hosts(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Each host: its state and its memory domains (charged / managed limit)."""
    with _api(state_dir) as api:
        rows = api.hosts()
    output.show(rows, lambda: render_hosts(rows), as_json=as_json)


def render_hosts(rows: list[HostRow]) -> str:
    return output.table(
        ["NAME", "STATE", "MEMORY (CHARGED / LIMIT)"],
        [
            [
                r.name,
                r.state,
                ", ".join(
                    f"{d.name} {_size(d.charged)} / {_size(d.managed_limit)}" for d in r.domains
                )
                or "-",
            ]
            for r in rows
        ],
    )


def _drain(state_dir: str | None, host: str | None, as_json: bool) -> None:
    with _api(state_dir) as api:
        if host is None:
            hosts = api.hosts()
            if len(hosts) != 1:
                raise CapyError("drain standalone needs a standalone role; use drain host NAME",
                                code="invalid_request")  # fmt: skip
            host = hosts[0].name
        answer = api.drain(host)
    stopping = ", ".join(answer.stopping) or "nothing was running"
    output.show(answer, f"host {host}: stopping {stopping}", as_json=as_json)


@drain_app.command("standalone")
@expected_errors
def drain_standalone(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Stop every engine of the standalone role."""
    _drain(state_dir, None, as_json)


@drain_app.command("host")
@expected_errors
def drain_host(
    host: Annotated[str, typer.Argument(help="The host's name.", show_default=False)],
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop every engine on one host."""
    _drain(state_dir, host, as_json)
