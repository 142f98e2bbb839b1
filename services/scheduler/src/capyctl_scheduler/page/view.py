"""What the status page shows, as values: each host's memory by what holds it, each
deployment with its requests and its next idle step, the last lifecycle events, the engines.

Built from one snapshot (the planning loop's own view, read anew), the hosts' readings and
event streams, and the routers' waiting requests; the page's HTML is rendered from it
(`render`), so the view and its figures can be tested without a browser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from capycommon.domain.desired import Choice
from capycommon.domain.instances import LIVE_STATES, Event, InstanceState
from capycommon.domain.memory import MemoryReading
from capycommon.management import Charge, DeploymentStatus, EngineRow, HostRow
from capyctl_scheduler import gpusets, status
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.snapshot import Snapshot
from capyctl_scheduler.usage import last_used

S = InstanceState
Kind = Literal["ready", "parked", "starting", "reserve", "free"]
# How many lifecycle events the timeline shows.
TIMELINE = 40
# The transitions the timeline shows, and the word for each.
MOMENTS = {
    "starting": "start",
    "waking": "wake",
    "draining": "drain",
    "parking": "park",
    "parked": "parked",
    "stopping": "stop",
    "stopped": "stopped",
    "failed": "failed",
    "ready": "ready",
}
# The operator's buttons, by a deployment's state: what the CLI offers there.
ACTIONS: dict[str, tuple[str, ...]] = {
    "ready": ("park", "stop"),
    "parked": ("wake", "stop"),
    "starting": ("stop",),
    "waking": ("stop",),
    "draining": ("stop",),
    "idle": ("start", "stop"),
    "pending": ("stop",),
    "stopped": ("start",),
    "failed": ("start", "stop"),
}


@dataclass(frozen=True)
class Segment:
    """A part of a memory bar: what holds it (a deployment, the reserve, nothing), how much,
    and where the figure comes from."""

    kind: Kind
    bytes: int
    label: str
    source: str


@dataclass(frozen=True)
class Bar:
    """One memory domain of a host (a GPU, or its RAM where parked weights wait)."""

    host: str
    domain: str
    capacity: int
    capacity_source: str
    segments: tuple[Segment, ...]
    # What the host's reading measured in use (a GPU's; None for RAM or without a reading).
    measured_used: int | None


@dataclass(frozen=True)
class HostLine:
    name: str
    state: str
    drained: bool
    joined: bool
    bars: tuple[Bar, ...]
    engines: tuple[EngineRow, ...]
    reading_at: float | None


@dataclass(frozen=True)
class Placement:
    host: str
    gpu: str | None
    state: str
    since: float


@dataclass(frozen=True)
class DeploymentLine:
    name: str
    state: str
    api: str
    routes: tuple[str, ...]
    placements: tuple[Placement, ...]
    running: int
    waiting: int
    last_used: float | None
    next_step: tuple[str, float] | None
    note: str
    actions: tuple[str, ...]


@dataclass(frozen=True)
class Moment:
    """One lifecycle event on the timeline."""

    at: float
    host: str
    deployment: str
    what: str
    reason: str
    duration_s: float | None
    failed: bool


@dataclass(frozen=True)
class PageView:
    taken_at: float
    hosts: tuple[HostLine, ...]
    deployments: tuple[DeploymentLine, ...]
    timeline: tuple[Moment, ...]


async def gather(manager: Manager) -> PageView:
    """Everything the page shows, read now."""
    snap = await manager.snapshot()
    state = manager.state
    hosts = sorted(snap.hosts)
    readings, events, choices, waiting, engines = await asyncio.gather(
        asyncio.gather(*(state.memory.reading(h) for h in hosts)),
        asyncio.gather(*(state.events.recent(h, TIMELINE * 4) for h in hosts)),
        state.choices.recent(TIMELINE * 4),
        state.places.waiting(),
        manager.engines(),
    )
    details = {name: status.detail(snap, name) for name in sorted(snap.deployments)}
    charges = [(name, charge) for name, detail in details.items() for charge in detail.charges]
    by_host = dict(zip(hosts, readings, strict=True))
    rows = status.host_rows(snap, by_host)
    return PageView(
        taken_at=snap.now,
        hosts=tuple(_host(snap, row, by_host[row.name], charges, engines) for row in rows),
        deployments=tuple(_deployment(snap, d, waiting) for d in details.values()),
        timeline=timeline([e for found in events for e in found], choices),
    )


def _host(
    snap: Snapshot,
    row: HostRow,
    reading: MemoryReading | None,
    charges: list[tuple[str, Charge]],
    engines: list[EngineRow],
) -> HostLine:
    host = row.name
    view = snap.hosts[host]
    measured = {gpu.name: gpu.used for gpu in row.gpus}
    backend = reading.backend if reading is not None else "none"
    bars = []
    for domain in view.domains.values():
        held = [(n, c) for n, c in charges if c.host == host and c.domain == domain.name]
        held.sort(key=lambda found: (_order(found[1].phase), -found[1].bytes))
        segments = [
            Segment(_kind(c.phase), c.bytes, _label(snap, host, name, c), c.provenance)
            for name, c in held
        ]
        charged = sum(c.bytes for _, c in held)
        reserve = min(domain.free_reserve, max(0, domain.capacity - charged))
        segments.append(Segment("reserve", reserve, "free reserve", "role setting"))
        free = max(0, domain.capacity - charged - reserve)
        segments.append(Segment("free", free, "free", "capacity less charges and reserve"))
        source = f"{backend} reading" if domain.name != "system" else "host RAM reading"
        bars.append(
            Bar(
                host=host,
                domain=domain.name,
                capacity=domain.capacity,
                capacity_source=source,
                segments=tuple(segments),
                measured_used=measured.get(domain.name),
            )
        )
    return HostLine(
        name=host,
        state=row.state,
        drained=row.drained,
        joined=row.joined,
        bars=tuple(bars),
        engines=tuple(e for e in engines if e.host == host),
        reading_at=reading.taken_at if reading is not None else None,
    )


def _label(snap: Snapshot, host: str, name: str, charge: Charge) -> str:
    """`qwen ready`; for a model across several GPUs, which rank of its set this GPU holds
    (`llama ready, 2 of gpu0+gpu1`), so each GPU's bar shows its part of the model."""
    label = f"{name} {charge.phase or 'held'}"
    instance = snap.instances.get(name)
    view = snap.hosts.get(host)
    place = view.place_of(instance) if view and instance and instance.host == host else None
    members = gpusets.members(place) if place else ()
    if len(members) > 1 and charge.domain in members:
        label += f", {members.index(charge.domain) + 1} of {place}"
    return label


def _kind(phase: str | None) -> Kind:
    if phase == "parked":
        return "parked"
    if phase in ("starting", "waking"):
        return "starting"
    return "ready"


def _order(phase: str | None) -> int:
    return {"ready": 0, "starting": 1, "waking": 1, "parked": 2}.get(phase or "", 0)


def _deployment(
    snap: Snapshot, detail: DeploymentStatus, waiting: dict[str, int]
) -> DeploymentLine:
    name, state = detail.name, detail.state
    record = snap.deployments[name]
    instance = snap.instances.get(name)
    placements = tuple(
        Placement(host=i.host, gpu=i.gpu, state=i.state, since=i.since)
        for i in detail.instances
        if i.state in LIVE_STATES
    )
    used = None
    if instance is not None and instance.state in LIVE_STATES:
        used = last_used(snap, name, instance)
    step = detail.idle.next
    note = ""
    if detail.refusal is not None:
        note = f"{detail.refusal.code}: {detail.refusal.message}"
    elif detail.attempts.failed and detail.attempts.last_error:
        note = detail.attempts.last_error
    elif instance is not None and instance.state == S.FAILED and instance.error:
        note = instance.error
    return DeploymentLine(
        name=name,
        state=state,
        api=record.document.api,
        routes=tuple(record.document.routes),
        placements=placements,
        running=detail.requests.running,
        waiting=waiting.get(name, 0),
        last_used=used,
        next_step=None if step is None else (step.action, step.at),
        note=note,
        actions=ACTIONS.get(state, ()),
    )


def timeline(events: Sequence[Event], choices: Sequence[Choice] = ()) -> tuple[Moment, ...]:
    """The last lifecycle events of every host, and the scheduler's switches and refusals,
    newest first."""
    moments = [_moment(event) for event in events]
    moments += [_chosen(choice) for choice in choices]
    found = [m for m in moments if m is not None]
    found.sort(key=lambda m: m.at, reverse=True)
    return tuple(found[:TIMELINE])


def _moment(event: Event) -> Moment | None:
    what: str
    if event.kind in ("refused", "fenced"):
        what, failed = event.kind, True
    elif event.kind == "transition" and event.to_state in MOMENTS:
        what, failed = MOMENTS[event.to_state], event.to_state == "failed"
    else:
        return None
    timed = event.to_state in ("ready", "parked", "stopped")
    return Moment(
        at=event.at,
        host=event.host,
        deployment=event.deployment,
        what=what,
        reason=event.reason,
        duration_s=event.duration_s if timed else None,
        failed=failed,
    )


def _chosen(choice: Choice) -> Moment | None:
    """A switch that ended (with how long it took), or a demand refused (a failure)."""
    if choice.kind == "switched":
        what, failed = "switch", False
    elif choice.kind == "refuse":
        what, failed = "refused", True
    else:
        return None
    return Moment(
        at=choice.at,
        host=choice.host or "",
        deployment=choice.deployment,
        what=what,
        reason=choice.reason,
        duration_s=choice.duration_s,
        failed=failed,
    )
