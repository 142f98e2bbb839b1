"""What a plan reads of a deployment's use: whether requests are on it, when it was last
used, whether it is ever a victim, and when it next gives its memory back if left idle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import InstanceRecord, InstanceState
from capyctl_scheduler.snapshot import Snapshot

S = InstanceState


@dataclass(frozen=True)
class IdleStep:
    # release: the LMCache server a restart_only park kept stops.
    kind: Literal["park", "stop", "release"]
    at: float
    timeout: float


def idle_timeouts(
    snapshot: Snapshot, record: DeploymentRecord
) -> tuple[float | None, float | None]:
    """The ready and parked idle timeouts in force: the deployment's, else the role's."""
    lifecycle = record.document.lifecycle
    tunables = snapshot.tunables
    return (
        _in_force(lifecycle.ready_idle_timeout, tunables.ready_idle_s),
        _in_force(lifecycle.parked_idle_timeout, tunables.parked_idle_s),
    )


def _in_force(own: float | str | None, default: float | None) -> float | None:
    """A deployment's timeout over the role's; `never` is off."""
    if own is None:
        return default
    return None if own == "never" else float(own)


def next_idle_step(
    snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord
) -> IdleStep | None:
    """When an idle model will next give its memory back, if nothing asks for it first."""
    if protected(record):
        return None
    ready_after, parked_after = idle_timeouts(snapshot, record)
    if instance.state == S.READY and ready_after is not None:
        at = last_used(snapshot, record.name, instance) + ready_after
        return IdleStep("park", at, ready_after)
    if instance.state == S.PARKED and parked_after is not None:
        return IdleStep("stop", instance.since + parked_after, parked_after)
    if instance.state == S.STOPPED and instance.cache is not None and parked_after is not None:
        return IdleStep("release", instance.since + parked_after, parked_after)
    return None


def last_used(snapshot: Snapshot, name: str, instance: InstanceRecord) -> float:
    load = snapshot.loads.get(name)
    active = load.last_active_at if load and load.generation == instance.generation else 0.0
    return max(active, instance.since)


def busy(snapshot: Snapshot, name: str, instance: InstanceRecord) -> bool:
    """Requests in flight or waiting: at the engine, holding a router's place (except those
    cut before any answer), or in a router's queue."""
    if name in snapshot.demands:
        return True
    held = snapshot.places.get(name)
    if held is not None and held.generation == instance.generation and held.serving > 0:
        return True
    load = snapshot.loads.get(name)
    return load is not None and load.generation == instance.generation and load.busy


def protected(record: DeploymentRecord) -> bool:
    """Never a victim of a switch, an idle step or the parked bound: warm or explicit."""
    return record.document.lifecycle.warm or record.activation == "explicit"
