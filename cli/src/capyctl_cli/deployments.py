"""`capyctl deploy|start|park|stop|delete|status deployment`, `list ...`, `drain ...`:
the management API from the command line."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from pydantic import BaseModel

from capycommon.errors import ActivationTimeout, CapyError, InvalidRequest, NotFound
from capycommon.management import (
    Action,
    DeploymentStatus,
    DeploymentSummary,
    EngineRow,
    HostRow,
    ModelRow,
)
from capycommon.paths import StatePaths, resolve_state_dir
from capyctl_cli import output
from capyctl_cli.deploymenttext import action_summary, render_status, size_text
from capyctl_cli.management import Management, wait_for
from capyctl_cli.options import HostArg, JsonOpt, StateDirOpt, command_group, expected_errors

WaitOpt = Annotated[bool, typer.Option("--wait", help="Wait until it is done.")]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds --wait waits at most.", min=1)
]
NameArg = Annotated[str, typer.Argument(help="The deployment's name.", show_default=False)]
Row = TypeVar("Row", bound=BaseModel)
Answer = TypeVar("Answer", bound=output.Printable)

deploy_app = command_group("Declare what to serve.")
park_app = command_group("Park a deployment: its engine gives its GPU memory back.")
stop_app = command_group("Stop a deployment; requests get deployment_stopped until a start.")
delete_app = command_group("Stop and forget a deployment (model files stay).")
list_app = command_group("List deployments, engines or hosts.")
drain_app = command_group("Stop every engine on a host; deployments stay on demand.")
undrain_app = command_group("Let a drained host take models again.")
# `capyctl start|status deployment`: one command each, in groups of the CLI's root.
start_app = typer.Typer()
status_app = typer.Typer()
logs_app = command_group("Show an engine's recent log lines.")


def _api(state_dir: str | None) -> Management:
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    return Management(StatePaths(root))


def _show(
    state_dir: str | None,
    as_json: bool,
    ask: Callable[[Management], Answer],
    render: Callable[[Answer], str],
) -> None:
    """Ask the management API one question and show its answer, as `render` writes it or as
    JSON."""
    with _api(state_dir) as api:
        answer = ask(api)
    output.show(answer, lambda: render(answer), as_json=as_json)


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
    refresh: Annotated[
        bool,
        typer.Option(
            "--refresh",
            help="Resolve a Hugging Face branch or tag to its commit anew, not as before.",
        ),
    ] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Declare a deployment (or a new revision of it) from a YAML document."""
    # The document's schema, its Hub pinning and the progress bar: only a deploy needs them.
    from capycommon.deployments import load_deployment  # noqa: PLC0415
    from capycommon.yamldoc import load_yaml_document  # noqa: PLC0415
    from capyctl_cli.pin import pin  # noqa: PLC0415
    from capyctl_cli.progress import DownloadBar  # noqa: PLC0415

    # Every problem of the document, named with its file, before sending.
    deployment = load_deployment(file)
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    with Management(StatePaths(root)) as api:
        document, pinned = pin(load_yaml_document(file), deployment, api, root, refresh)
        answer = api.deploy(document)
        name = answer.deployment
        text = f"deployment {name} revision {answer.revision} ({answer.change})"
        if pinned is not None:
            text += f"; {pinned}"
        if wait:
            since = time.time()
            api.act(name, "start")
            with DownloadBar() as bar:

                def seen(status: DeploymentStatus) -> None:
                    bar.show(status.download)

                wait_for(api, name, _state_is("ready"), timeout, "ready", since, seen=seen)
            text += "; ready"
        output.show(answer, text, as_json=as_json)


def _wait_gone(api: Management, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            api.status(name)
        except CapyError as exc:
            if exc.code == NotFound.code:
                return
            raise
        time.sleep(0.25)
    raise ActivationTimeout(f"deployment {name!r} is still being deleted after {timeout:.0f}s")


def verb_command(
    app: typer.Typer, verb: Action, summary: str, done: tuple[str, ...], timeout_s: float = 600.0
) -> None:
    """Register `capyctl <verb> deployment NAME [--wait]` on `app`: --wait waits for one of
    the `done` states (a delete: until the deployment is gone)."""

    @app.command("deployment", help=summary)
    @expected_errors
    def command(
        name: NameArg,
        wait: WaitOpt = False,
        timeout: TimeoutOpt = timeout_s,
        state_dir: StateDirOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        with _api(state_dir) as api:
            since = time.time()
            answer = api.act(name, verb)
            text = action_summary(answer)
            if wait and verb == "delete":
                _wait_gone(api, name, timeout)
                text = action_summary(answer, took_s=time.time() - since)
            elif wait:
                status = wait_for(api, name, _state_is(*done), timeout, " or ".join(done), since)
                text = action_summary(answer, state=status.state, took_s=time.time() - since)
            output.show(answer, text, as_json=as_json)


verb_command(park_app, "park", "Park a ready deployment at its residency tier.", ("parked",))
verb_command(
    stop_app,
    "stop",
    "Stop a deployment's engine and keep it stopped until `start deployment`.",
    ("stopped",),
)
verb_command(delete_app, "delete", "Stop a deployment's engine and forget the deployment.", ())
verb_command(
    start_app,
    "start",
    "Start (or wake) a deployment; it also lifts an operator stop.",
    ("ready",),
    timeout_s=1800.0,
)


@status_app.command("deployment")
@expected_errors
def status_deployment(
    name: NameArg,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a deployment: its state, instances, memory charges and last operation."""
    _show(state_dir, as_json, lambda api: api.status(name), render_status)


@logs_app.command("deployment")
@expected_errors
def logs_deployment(
    name: NameArg,
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=1, max=10_000, help="How many of the last lines.")
    ] = 100,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the last lines of a deployment's engine log, from the host that runs it (for
    retention: zero, from its log writer's memory)."""
    with _api(state_dir) as api:
        found = api.engine_log(name, lines)

    def render() -> str:
        where = {"file": "its log file", "memory": "memory only (retention: zero)"}
        head = f"# {name} on host {found.host or '-'}: " + (
            where.get(found.kept) or found.note or "no log"
        )
        return "\n".join([head, *found.lines])

    output.show(found, render, as_json=as_json)


def list_command(
    what: str,
    summary: str,
    rows_of: Callable[[Management], list[Row]],
    render: Callable[[list[Row]], str],
) -> None:
    """Register `capyctl list <what>`: the rows the management API gives, as `render` shows
    them (or JSON)."""

    @list_app.command(what, help=summary)
    @expected_errors
    def command(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
        _show(state_dir, as_json, rows_of, render)


def render_deployments(rows: list[DeploymentSummary]) -> str:
    return output.table(
        ["NAME", "STATE", "READY", "REVISION", "HOSTS", "GPUS"],
        [
            [r.name, r.state, r.ready, r.revision, ",".join(r.hosts) or "-", _gpus(r.gpus)]
            for r in rows
        ],
    )


def _gpus(gpus: list[str]) -> str:
    """`gpu0`, or `gpu0+gpu1` for a model across two; `-` while none runs."""
    return "+".join(gpus) or "-"


def render_engines(rows: list[EngineRow]) -> str:
    return output.table(
        ["HOST", "NAME", "FAMILY", "VERSION", "VERIFIED"],
        [[r.host, r.name, r.family, r.version, r.verified] for r in rows],
    )


def render_hosts(rows: list[HostRow]) -> str:
    return output.table(
        ["NAME", "STATE", "ELIGIBLE", "VERSION", "GPUS", "MEMORY (CHARGED / LIMIT)", "ENGINES"],
        [
            [
                r.name,
                r.state,
                "no (drained)" if r.drained else "yes",
                r.version or "-",
                ", ".join(f"{g.name} {size_text(g.used)}/{size_text(g.total)}" for g in r.gpus)
                or "-",
                _memory(r),
                ", ".join(r.engines) or "-",
            ]
            for r in rows
        ],
    )


def _memory(host: HostRow) -> str:
    """Each memory domain of a host: its name, what is charged on it, and its managed limit."""
    domains = (
        f"{d.name} {size_text(d.charged)} / {size_text(d.managed_limit)}" for d in host.domains
    )
    return ", ".join(domains) or "-"


list_command(
    "deployments",
    "NAME, STATE, READY, REVISION, HOSTS, GPUS of every deployment.",
    Management.deployments,
    render_deployments,
)
list_command("engines", "The engines each host has published.", Management.engines, render_engines)
list_command(
    "hosts",
    "Each host: its state, version, GPUs, memory domains (charged / managed limit), engines.",
    Management.hosts,
    render_hosts,
)


def _drain(state_dir: str | None, host: str | None, as_json: bool) -> None:
    with _api(state_dir) as api:
        if host is None:
            hosts = api.hosts()
            if len(hosts) != 1:
                raise InvalidRequest(
                    "drain standalone needs a standalone role; use drain host NAME"
                )
            host = hosts[0].name
        answer = api.drain(host)
    stopping = ", ".join(answer.stopping) or "nothing was running"
    closed = "; it takes no new model until capyctl undrain host " + host if answer.drained else ""
    output.show(answer, f"host {host}: stopping {stopping}{closed}", as_json=as_json)


@drain_app.command("standalone")
@expected_errors
def drain_standalone(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Stop every engine of the standalone role."""
    _drain(state_dir, None, as_json)


@drain_app.command("host")
@expected_errors
def drain_host(host: HostArg, state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Stop every engine on one host; a joined host takes no new model until undrained."""
    _drain(state_dir, host, as_json)


@undrain_app.command("host")
@expected_errors
def undrain_host(host: HostArg, state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Let a drained host take models again."""
    with _api(state_dir) as api:
        answer = api.undrain(host)
    told = "takes models again" if answer.changed else "was not drained"
    output.show(answer, f"host {host} {told}", as_json=as_json)


@list_app.command("models", help="The models on each host, their size, and who uses them.")
@expected_errors
def list_models(
    host: Annotated[
        str | None, typer.Option("--host", help="Only this host's models.", show_default=False)
    ] = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The folders under each host's models root and the downloads in its store."""
    _show(state_dir, as_json, lambda api: api.models(host), render_models)


def render_models(rows: list[ModelRow]) -> str:
    return output.table(
        ["HOST", "MODEL", "SOURCE", "SIZE", "USED BY"],
        [
            [
                r.host,
                r.name,
                f"hf {r.repo}@{r.commit}" if r.repo else "folder" if r.kind == "folder" else "file",
                size_text(r.weights_bytes),
                ", ".join(r.used_by) or "-",
            ]
            for r in rows
        ],
    )
