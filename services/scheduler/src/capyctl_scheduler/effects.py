"""Effects in flight, read from a snapshot: whether each is done (`outcome`), and what a
deployment does while one is (`while_in_flight`): a drain ends in its park or stop once
nothing runs on the engine, or serves again (`drain_step`).

One effect is in flight per deployment at a time (its record's `inflight`): the command sent
to hostd, until the instance record shows it taken up, hostd refuses it, or it expires.
"""

from __future__ import annotations

from typing import Literal

from capycommon.domain.desired import DeploymentRecord, EvictionCause
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.places import Places
from capycommon.units import format_duration
from capyctl_scheduler.actions import Action, can_park, park, parks_by_stopping, stop
from capyctl_scheduler.snapshot import Snapshot

S = InstanceState
Outcome = Literal["pending", "done", "refused", "expired"]


def outcome(snapshot: Snapshot, record: DeploymentRecord) -> Outcome:
    """How the deployment's effect in flight stands: a drain is done once its instance no
    longer drains in its generation, a launch once a generation as new runs, any other once
    the instance moved from where the effect found it."""
    effect = record.inflight
    assert effect is not None
    instance = snapshot.instances.get(record.name)
    if effect.kind == "drain":
        draining = (
            instance is not None
            and instance.state == S.DRAINING
            and instance.generation == effect.generation
        )
        return "pending" if draining else "done"
    if effect.kind == "launch":
        if instance is not None and instance.generation >= effect.generation:
            return "done"
    elif instance is None or (instance.state, instance.generation) != (
        effect.from_state,
        effect.from_generation,
    ):
        return "done"
    if (record.name, effect.generation) in snapshot.refused:
        return "refused"
    view = snapshot.hosts.get(effect.host)
    gone = view is not None and view.gone(snapshot.now, snapshot.tunables.host_lost_after_s)
    if gone or snapshot.now - effect.sent_at > snapshot.tunables.command_timeout_s:
        return "expired"  # not taken up in time, or its host is gone: nobody will
    return "pending"


def stopping(record: DeploymentRecord, instance: InstanceRecord) -> bool:
    """Whether a stop of the instance is in flight (until it is done or expires)."""
    effect = record.inflight
    return effect is not None and effect.kind == "stop" and effect.generation == instance.generation


def while_in_flight(
    snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord | None
) -> list[Action]:
    """Nothing, until the effect is done; but a drain to park serves again when requests wait
    for its model, and otherwise moves on to its park or stop."""
    effect = record.inflight
    assert effect is not None
    if effect.kind != "drain" or instance is None:
        return []
    if record.name in snapshot.demands and effect.then == "park" and not record.stopped:
        return [
            Action(
                "undrain",
                record.name,
                "requests are waiting for it: it serves again",
                host=instance.host,
                generation=instance.generation,
            )
        ]
    then = effect.then or "park"
    return drain_step(snapshot, record, instance, then, effect.reason, effect.cause)


def drain_step(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    then: Literal["park", "stop"],
    why: str,
    cause: EvictionCause | None,
) -> list[Action]:
    """A draining instance parks or stops once nothing runs on it (with the drain's `cause`),
    or serves again when the drain outlasts its timeout."""
    if _idle(snapshot, record, instance):
        if then == "park" and can_park(snapshot, instance):
            return [park(snapshot, instance, why, cause)]
        if then == "park" and parks_by_stopping(instance):
            return [stop(instance, f"{why}; a restart_only park", keep_cache=True, cause=cause)]
        why = why if then == "stop" else f"{why}; it cannot park"
        return [stop(instance, why, cause=cause)]
    waited = snapshot.now - instance.since
    if waited <= snapshot.tunables.drain_timeout_s:
        return []
    load = snapshot.loads.get(record.name)
    running = load.running + load.waiting if load is not None else 0
    return [
        Action(
            "undrain",
            record.name,
            f"drain timed out after {format_duration(waited)} with {running} requests "
            "still running; it serves again",
            host=instance.host,
            generation=instance.generation,
        )
    ]


def _idle(snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord) -> bool:
    """Whether nothing runs on a draining instance: the routers hold no place of its
    generation and its engine's last reading was idle.

    No place can be taken once it drains (the take checks the instance is ready), a router
    gives its spare places back once it hears of the drain (one may carry a request it let
    through before), and the snapshot reads the places after the instance, so every request
    let through before the drain is counted. Otherwise its engine must read idle in a reading
    taken after the drain began: a request cut short may still run there."""
    load = snapshot.loads.get(record.name)
    held = snapshot.places.get(record.name)
    if held is None or held.generation != instance.generation:
        held = Places()
    if held.serving + held.spare > 0:
        return False  # a router still has requests on it, or may have
    if load is None or load.generation != instance.generation:
        return True  # nothing serves through an engine whose load hostd does not report
    unrouted = held.running + held.spare == 0 and instance.state == S.DRAINING
    return not load.busy and (load.read_at > instance.since or unrouted)
