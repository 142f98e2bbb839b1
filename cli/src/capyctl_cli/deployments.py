"""`capyctl deploy|start|park|stop|delete|status deployment`, `list ...`, `drain ...`:
the management API from the command line."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from capycommon.deployments import load_deployment
from capycommon.errors import CapyError
from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.units import format_duration, format_size
from capycommon.yamldoc import load_yaml_document
from capyctl_cli import output
from capyctl_cli.management import Management, wait_for
from capyctl_cli.options import DebugOpt, JsonOpt, StateDirOpt, expected_errors

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


def _receipt(answer: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        output.emit_json(answer)
    else:
        print(text)


def _state_is(*states: str) -> Callable[[dict[str, Any]], bool]:
    return lambda status: status["state"] in states


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
    debug: DebugOpt = False,
) -> None:
    """Declare a deployment (or a new revision of it) from a YAML document."""
    load_deployment(file)  # every problem of the document, named with its file, before sending
    with _api(state_dir) as api:
        answer = api.post("/deployments", {"document": load_yaml_document(file)})
        name = answer["deployment"]
        text = f"deployment {name} revision {answer['revision']} ({answer['change']})"
        if wait:
            since = time.time()
            api.post(f"/deployments/{name}/actions", {"action": "start"})
            wait_for(api, name, _state_is("ready"), timeout, "ready", since)
            text += "; ready"
        _receipt(answer, as_json, text)


def _act(state_dir: str | None, name: str, verb: str, wait: bool, timeout: float,
         as_json: bool, done: tuple[str, ...]) -> None:  # fmt: skip
    with _api(state_dir) as api:
        since = time.time()
        answer = api.post(f"/deployments/{name}/actions", {"action": verb})
        text = f"deployment {name}: {verb} accepted"
        if wait and verb == "delete":
            _wait_gone(api, name, timeout)
            text = f"deployment {name}: deleted"
        elif wait:
            status = wait_for(api, name, _state_is(*done), timeout, " or ".join(done), since)
            text = f"deployment {name}: {status['state']}"
        _receipt(answer, as_json, text)


def _wait_gone(api: Management, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            api.get(f"/deployments/{name}")
        except CapyError as exc:
            if exc.code == "not_found":
                return
            raise
        time.sleep(0.25)
    raise CapyError(f"deployment {name!r} is still being deleted after {timeout:.0f}s",
                    code="activation_timeout")  # fmt: skip


def verb_command(
    app: typer.Typer, verb: str, summary: str, done: tuple[str, ...], timeout_s: float
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
        debug: DebugOpt = False,
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
    debug: DebugOpt = False,
) -> None:
    """Show a deployment: its state, instances, memory charges and last operation."""
    with _api(state_dir) as api:
        status = api.get(f"/deployments/{name}")
    if as_json:
        output.emit_json(status)
        return
    print(render_status(status))


def render_status(status: dict[str, Any]) -> str:
    last = status.get("last_operation") or {}
    startup = status.get("startup") or {}
    lines = [
        output.pairs([
            ("deployment", status["name"]),
            ("state", status["state"]),
            ("revision", status["revision"]),
            ("routes", ", ".join(status["routes"])),
            ("activation", status["activation"]),
            ("startup", f"{_size(startup.get('device_bytes'))} device "
                        f"({startup.get('device_provenance', '-')}), "
                        f"{_size(startup.get('host_bytes'))} host "
                        f"({startup.get('host_provenance', '-')})"),
            ("last operation", f"{last.get('kind', '-')}: {last.get('reason', '-')}"),
            ("idle", _idle(status.get("idle") or {})),
            *_residencies(status["bindings"]),
        ]),
    ]  # fmt: skip
    if status["instances"]:
        rows = [
            [i["index"], i["host"], i["gpu"], i["state"], i["generation"], i["last_error"]]
            for i in status["instances"]
        ]
        lines += ["", output.table(["INSTANCE", "HOST", "GPU", "STATE", "GENERATION", "ERROR"],
                                   rows)]  # fmt: skip
    if status["charges"]:
        rows = [
            [c["host"], c["domain"], c["phase"], _size(c["bytes"]), c["provenance"]]
            for c in status["charges"]
        ]
        lines += ["", output.table(["HOST", "DOMAIN", "PHASE", "CHARGE", "FROM"], rows)]
    errors = [b for b in status["bindings"] if "error" in b]
    for binding in errors:
        lines.append(f"\n{binding['host']}: error [{binding['error']['code']}]: "
                     f"{binding['error']['message']}")  # fmt: skip
    return "\n".join(lines)


def _residencies(bindings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each host's park tier and why, and whether deep parking is off there."""
    rows = []
    for binding in bindings:
        if "residency" in binding:
            text = f"{binding['residency']} on {binding['host']} ({binding['residency_reason']})"
            rows.append(("residency", text))
        if binding.get("deep_park") is False:
            rows.append(("deep parking", f"off on host {binding['host']} (host.deep_park: off)"))
    return rows


def _idle(idle: dict[str, Any]) -> str:
    """When the model next gives its memory back: `parks at 14:05:09 (in 4m 51s; idle 5m)`."""
    if idle.get("protected"):
        return "never parks or stops when idle (warm or explicit)"
    step = idle.get("next")
    timeouts = (
        f"ready {_timeout(idle.get('ready_idle_timeout'))}, "
        f"parked {_timeout(idle.get('parked_idle_timeout'))}"
    )
    if step is None:
        return f"nothing due (idle timeouts: {timeouts})"
    verb = "parks" if step["action"] == "park" else "stops"
    at = time.strftime("%H:%M:%S", time.localtime(step["at"]))
    left = max(0, round(step["at"] - time.time()))
    return f"{verb} at {at} (in {left // 60}m {left % 60:02d}s if nobody asks; {timeouts})"


def _timeout(seconds: float | None) -> str:
    return "never" if seconds is None else format_duration(seconds)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


@list_app.command("deployments")
@expected_errors
def list_deployments(
    state_dir: StateDirOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False
) -> None:
    """NAME, STATE, READY, REVISION, HOSTS of every deployment."""
    with _api(state_dir) as api:
        rows = api.get("/deployments")["deployments"]
    if as_json:
        output.emit_json(rows)
        return
    print(output.table(
        ["NAME", "STATE", "READY", "REVISION", "HOSTS"],
        [[r["name"], r["state"], r["ready"], r["revision"], ",".join(r["hosts"]) or "-"]
         for r in rows],
    ))  # fmt: skip


@list_app.command("engines")
@expected_errors
def list_engines(
    state_dir: StateDirOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False
) -> None:
    """The engines each host has published."""
    with _api(state_dir) as api:
        rows = api.get("/engines")["engines"]
    if as_json:
        output.emit_json(rows)
        return
    print(output.table(
        ["HOST", "NAME", "FAMILY", "VERSION", "VERIFIED"],
        [[r["host"], r["name"], r["family"], r["version"], r["verified"]] for r in rows],
    ))  # fmt: skip


@list_app.command("hosts")
@expected_errors
def list_hosts(
    state_dir: StateDirOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False
) -> None:
    """Each host: its state and its memory domains (charged / managed limit)."""
    with _api(state_dir) as api:
        rows = api.get("/hosts")["hosts"]
    if as_json:
        output.emit_json(rows)
        return
    print(output.table(
        ["NAME", "STATE", "MEMORY (CHARGED / LIMIT)"],
        [[r["name"], r["state"], ", ".join(
            f"{d['name']} {_size(d['charged'])} / {_size(d['managed_limit'])}"
            for d in r["domains"]) or "-"] for r in rows],
    ))  # fmt: skip


def _drain(state_dir: str | None, host: str | None, as_json: bool) -> None:
    with _api(state_dir) as api:
        if host is None:
            hosts = api.get("/hosts")["hosts"]
            if len(hosts) != 1:
                raise CapyError("drain standalone needs a standalone role; use drain host NAME",
                                code="invalid_request")  # fmt: skip
            host = str(hosts[0]["name"])
        answer = api.post(f"/hosts/{host}/drain", {})
    stopping = ", ".join(answer["stopping"]) or "nothing was running"
    _receipt(answer, as_json, f"host {host}: stopping {stopping}")


@drain_app.command("standalone")
@expected_errors
def drain_standalone(
    state_dir: StateDirOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False
) -> None:
    """Stop every engine of the standalone role."""
    _drain(state_dir, None, as_json)


@drain_app.command("host")
@expected_errors
def drain_host(
    host: Annotated[str, typer.Argument(help="The host's name.", show_default=False)],
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Stop every engine on one host."""
    _drain(state_dir, host, as_json)
