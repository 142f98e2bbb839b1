"""What a plan asks for: the `Action` the actuator applies, and how the actions that touch a
running engine (drain, park, stop) are built, with whether it can park."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from capycommon.domain.desired import DeploymentRecord, EvictionCause, Victim
from capycommon.domain.engines import Residency
from capycommon.domain.instances import InstanceRecord, InstanceState
from capyctl_scheduler.charges import footprint_of
from capyctl_scheduler.snapshot import Snapshot

S = InstanceState

Kind = Literal[
    "start",
    "wake",
    "drain",
    "undrain",
    "park",
    "stop",
    "release",
    "count_failure",
    "satisfied",
    "drop_demand",
    "wait",
    "settle",
    "forget",
    "refuse",
    "switched",
    "drop_switch",
]
# What a plan decides of a host rather than of a deployment (`deployment` is then "").
HostKind = Literal["mark_unreachable", "mark_reachable"]


@dataclass(frozen=True)
class Action:
    kind: Kind | HostKind
    deployment: str
    reason: str
    host: str = ""
    gpu: str = ""
    generation: int = 0
    # drain: what follows once the engine is idle.
    then: Literal["park", "stop"] | None = None
    # park: the most device bytes the parked engine may keep (its parked charge).
    release_bound: int | None = None
    # count_failure: the error of the failed generation; refuse: the code of the refusal.
    error: str = ""
    # stop: a restart_only park, which keeps the instance's LMCache server.
    keep_cache: bool = False
    # drain, park, stop: why a serving or parked engine is taken out (an eviction, counted
    # once, when the park or stop that ends it is done; a drain hands it on to that park or
    # stop); None for what evicts nothing (an orphan's stop, a drain's end whose cause is lost).
    cause: EvictionCause | None = None
    # wait: the victims a switch to this deployment releases now.
    victims: tuple[Victim, ...] = ()
    # start: what the plan's ledger leaves free on the GPU's domain as the engine starts: its
    # capacity less what the ledger charges every other owner there.
    device_free: int | None = None
    # start: why placement chose its host and GPU set (`placement.explain`).
    placed: str = ""


def can_park(snapshot: Snapshot, instance: InstanceRecord) -> bool:
    """Its engine can park, no request cut before any answer may still be on it (only a stop
    proves those gone), and its parked copy has room on every domain's parked limit."""
    if instance.residency in (None, Residency.RESTART_ONLY):
        return False
    held = snapshot.places.get(instance.deployment)
    if held is not None and held.generation == instance.generation and held.settle_at_stop:
        return False
    return _parked_room(snapshot, instance)


def _parked_room(snapshot: Snapshot, instance: InstanceRecord) -> bool:
    view = snapshot.hosts[instance.host]
    gpu = view.place_of(instance)
    footprint = footprint_of(snapshot, instance.deployment, instance.host, gpu) if gpu else None
    if footprint is None:
        return True
    parked: dict[str, int] = {}
    for name, other in snapshot.parked.get(instance.host, {}).items():
        if name == instance.deployment:
            continue
        other_gpu = view.place_of(other)
        found = footprint_of(snapshot, name, other.host, other_gpu) if other_gpu else None
        for domain, size in (found.charge("parked") if found else {}).items():
            parked[domain] = parked.get(domain, 0) + size
    return all(
        parked.get(domain, 0) + size <= view.domains[domain].parked_limit
        for domain, size in footprint.charge("parked").items()
        if domain in view.domains
    )


def parks_by_stopping(instance: InstanceRecord) -> bool:
    """A restart_only model with an LMCache server: its park stops the engine and keeps the
    server, so the next start answers from its cache."""
    return instance.cache is not None and instance.residency == Residency.RESTART_ONLY


def drain(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    why: str,
    then: Literal["park", "stop"] | None = None,
    cause: EvictionCause | None = None,
) -> Action:
    parks = can_park(snapshot, instance) or parks_by_stopping(instance)
    then = then or ("park" if parks else "stop")
    return Action(
        "drain",
        record.name,
        why,
        host=instance.host,
        gpu=snapshot.hosts[instance.host].place_of(instance) or "",
        generation=instance.generation,
        then=then,
        cause=cause,
    )


def park(
    snapshot: Snapshot, instance: InstanceRecord, why: str, cause: EvictionCause | None = None
) -> Action:
    view = snapshot.hosts[instance.host]
    gpu = view.place_of(instance) or ""
    footprint = footprint_of(snapshot, instance.deployment, instance.host, gpu)
    # Per GPU: a set's ranks each keep the same share (hostd checks every GPU of the set).
    charged = footprint.charge("parked") if footprint else {}
    bounds = [charged[d] for d in view.domains_of(gpu) if d in charged] if gpu else []
    bound = max(bounds) if bounds else None
    return Action(
        "park",
        instance.deployment,
        why,
        host=instance.host,
        gpu=gpu,
        generation=instance.generation,
        release_bound=bound,
        cause=cause,
    )


def stop(
    instance: InstanceRecord,
    why: str,
    keep_cache: bool = False,
    cause: EvictionCause | None = None,
) -> Action:
    return Action(
        "stop",
        instance.deployment,
        why,
        host=instance.host,
        generation=instance.generation,
        keep_cache=keep_cache,
        cause=cause,
    )


def release(instance: InstanceRecord, why: str) -> Action:
    """Stop the LMCache server a restart_only park kept for a stopped instance."""
    return Action(
        "release", instance.deployment, why, host=instance.host, generation=instance.generation
    )


def keeps_cache(instance: InstanceRecord) -> bool:
    """A stopped instance whose LMCache server a restart_only park kept (it is charged)."""
    return instance.state == S.STOPPED and instance.cache is not None
