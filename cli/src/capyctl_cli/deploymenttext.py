"""How a deployment reads as text: `status deployment`, and what `start`, `park`, `stop` and
`delete deployment` say they did (a sentence, then its details as key-value pairs)."""

from __future__ import annotations

import time

from capycommon.management import (
    Action,
    ActionAnswer,
    Binding,
    DeploymentStatus,
    Idle,
    Requests,
    Startup,
)
from capycommon.units import format_duration, format_size
from capyctl_cli import output

# A verb's sentence while under way (not waited for) and once done (--wait).
DOING: dict[Action, tuple[str, str]] = {
    "start": ("Starting", "ready"),
    "park": ("Parking", "parked"),
    "stop": ("Stopping", "stopped"),
    "delete": ("Deleting", "deleted"),
}


def action_summary(
    answer: ActionAnswer, *, state: str | None = None, took_s: float | None = None
) -> str:
    """What a start, park, stop or delete did: `Parking deployment chat.` when it was sent, or
    `Deployment chat is parked.` once --wait saw it done in `state`, then the details."""
    doing, done = DOING[answer.action]
    name = answer.deployment
    details: list[tuple[str, object]] = [
        ("deployment", name),
        ("action", answer.action),
        ("revision", answer.revision),
        ("operation", answer.operation_id),
    ]
    if took_s is None:
        sentence = f"{doing} deployment {name}."
        if answer.action != "delete":
            details.append(("follow", f"capyctl status deployment {name}"))
    else:
        sentence = f"Deployment {name} is {state or done}."
        details += [("state", state or done), ("took", f"{took_s:.1f} s")]
    return f"{sentence}\n{output.pairs(details)}"


def render_status(status: DeploymentStatus) -> str:
    last = status.last_operation
    summary = [
        ("deployment", status.name),
        ("state", status.state),
        ("revision", status.revision),
        ("routes", ", ".join(status.routes)),
        *_model(status),
        ("api", status.document.get("api", "chat")),
        ("activation", status.activation),
        ("startup", _startup(status.startup)),
        *([("placed", status.placed)] if status.placed else []),
        ("last operation", f"{last.kind}: {last.reason}" if last else "-: -"),
        ("idle", _idle(status.idle)),
        *_requests(status.requests),
        *_residencies(status.bindings),
    ]
    lines = [output.pairs(summary)]
    if status.instances:
        headers = ["INSTANCE", "HOST", "GPUS", "STATE", "GENERATION", "ERROR"]
        rows = [
            [i.index, i.host, i.gpu, i.state, i.generation, i.last_error] for i in status.instances
        ]
        lines += ["", output.table(headers, rows)]
    if status.charges:
        rows = [
            [c.host, c.domain, c.phase, size_text(c.bytes), c.provenance] for c in status.charges
        ]
        lines += ["", output.table(["HOST", "DOMAIN", "PHASE", "CHARGE", "FROM"], rows)]
    for binding in status.bindings:
        if binding.error is not None:
            lines.append(f"\n{binding.host}: error [{binding.error.code}]: {binding.error.message}")
    return "\n".join(lines)


def _model(status: DeploymentStatus) -> list[tuple[str, str]]:
    """Where the model comes from, as it was declared: a folder, or a Hub repository at its
    pinned commit, with the download's progress while one is under way. The canonical
    document names both fields, the one not given as null, so the source is the one set."""
    model = status.document.get("model")
    if not isinstance(model, dict):
        return []
    if not model.get("hf"):
        return [("model", str(model.get("path")))]
    repo, _, commit = str(model["hf"]).partition("@")
    revision = f" ({model['revision']})" if model.get("revision") else ""
    rows = [("model", f"hf {repo}"), ("commit", f"{commit or 'not pinned'}{revision}")]
    download = status.download
    if download is not None:
        total = max(download.total_bytes, 1)
        rows.append(
            (
                "download",
                f"{size_text(download.done_bytes)} of {size_text(download.total_bytes)} "
                f"({100 * download.done_bytes / total:.0f}%) at {size_text(int(download.rate))}/s "
                f"on {download.host}",
            )
        )
    return rows


def _startup(startup: Startup | None) -> str:
    """The startup peak, device and host, with where each figure came from."""
    if startup is None:
        return "- device (-), - host (-)"
    return (
        f"{size_text(startup.device_bytes)} device ({startup.device_provenance}), "
        f"{size_text(startup.host_bytes)} host ({startup.host_provenance})"
    )


def _residencies(bindings: list[Binding]) -> list[tuple[str, str]]:
    """Each host's park tier and why, and whether deep parking is off there."""
    rows = []
    for binding in bindings:
        if binding.residency is not None:
            text = f"{binding.residency} on {binding.host} ({binding.residency_reason})"
            rows.append(("residency", text))
        if binding.lmcache is not None:
            rows.append(("lmcache", f"{binding.lmcache} on {binding.host}"))
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
    verbs = {"park": "parks", "stop": "stops", "release": "stops its kept LMCache server"}
    verb = verbs[step.action]
    at = time.strftime("%H:%M:%S", time.localtime(step.at))
    left = max(0, round(step.at - time.time()))
    return f"{verb} at {at} (in {left // 60}m {left % 60:02d}s if nobody asks; {timeouts})"


def _timeout(seconds: float | None) -> str:
    return "never" if seconds is None else format_duration(seconds)


def size_text(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _requests(requests: Requests) -> list[tuple[str, object]]:
    """The routers' places on the current generation: those serving, and the cut ones that
    settle when the engine reads idle or at its next stop; then the engine's own count."""
    return [
        ("requests.running", requests.running),
        ("requests.settle_when_idle", requests.settle_when_idle),
        ("requests.settle_at_stop", requests.settle_at_stop),
        (
            "requests.engine",
            f"{requests.engine_running} running, {requests.engine_waiting} waiting",
        ),
    ]
