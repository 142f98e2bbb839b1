"""`plan(snapshot) -> actions`: every decision of the scheduler, as a pure function.

Each action names its deployment and carries its reason; `actuator.py` applies them. One
effect is in flight per instance at a time; the ledger of each host is rebuilt from the
instance records (and the effects in flight) on every plan, so a restarted scheduler charges
exactly what runs, never twice.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache
from typing import Literal

from capycommon.errors import DeviceUnobserved, HostDrained, HostUnreachable, InsufficientResources
from capycommon.state.desired import DeploymentRecord, EvictionCause
from capycommon.state.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.state.places import Places
from capycommon.units import format_duration
from capyctl_scheduler.actions import (
    Action,
    can_park,
    drain,
    keeps_cache,
    park,
    parks_by_stopping,
    release,
    stop,
)
from capyctl_scheduler.charges import charged, footprint_of
from capyctl_scheduler.ledger import Ledger
from capyctl_scheduler.placement import headroom
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from capyctl_scheduler.usage import busy, next_idle_step
from capyctl_scheduler.victims import bound_parked, switch, switch_end

S = InstanceState

# While joined hosts are planned for, the loop looks at least this often whether one's
# heartbeat lapsed (nothing announces that).
HOST_CHECK_S = 2.0


def plan(snapshot: Snapshot) -> list[Action]:
    """What to do now, in order: settle finished effects, end the switches whose deployment
    is ready (or no longer wanted), then each deployment (the oldest demand first), then the
    bound on the parked set."""
    actions: list[Action] = []
    records = dict(snapshot.deployments)
    for name, record in snapshot.deployments.items():
        effect = record.inflight
        outcome = _inflight(snapshot, record) if effect is not None else "pending"
        if outcome != "pending":
            assert effect is not None
            # A park or stop that took an engine out is done: one eviction, with its cause.
            evicted = outcome == "done" and effect.kind in ("park", "stop")
            cause = effect.cause if evicted else None
            actions.append(Action("settle", name, f"{effect.kind} {outcome}", cause=cause))
            records[name] = record.model_copy(update={"inflight": None})
    snapshot = replace(snapshot, deployments=records)
    for record in snapshot.deployments.values():
        actions += switch_end(snapshot, record)
    actions += _host_marks(snapshot)
    ledgers = {host: charged(snapshot, host) for host in snapshot.hosts}
    for orphan in snapshot.orphans:
        view = snapshot.hosts.get(orphan.host)
        if orphan.state not in (S.STOPPING,) and view is not None and view.reachable:
            actions.append(stop(orphan, "orphan: no deployment owns this engine"))
    for name in _order(snapshot):
        actions += _deployment(snapshot, snapshot.deployments[name], ledgers)
    actions += bound_parked(snapshot, actions)
    return actions


def _host_marks(snapshot: Snapshot) -> list[Action]:
    """Mark a joined host unreachable when its hostd's heartbeat lapsed or it was revoked, and
    reachable again when it beats (routers send nothing to an unreachable host)."""
    actions = []
    for name, view in snapshot.hosts.items():
        if not view.joined:
            continue
        cut_off = view.revoked or not view.alive
        if cut_off and view.unreachable_since is None:
            why = "revoked" if view.revoked else "its hostd's heartbeat lapsed"
            actions.append(Action("mark_unreachable", "", f"host {name}: {why}", host=name))
        elif not cut_off and view.unreachable_since is not None:
            actions.append(Action("mark_reachable", "", f"host {name} is back", host=name))
    return actions


# Instance states that stay as they are until a command or an engine moves them, which hostd
# announces on its channel; any other state is under way.
SETTLED = frozenset({S.READY, S.PARKED, S.STOPPED, S.FAILED})


def quiet_until(snapshot: Snapshot, actions: list[Action]) -> float | None:
    """When the clock alone can next change a plan that asked for nothing: the earliest idle
    step (math.inf when none is due ever). None while anything is under way, which the loop
    must look at again within a second.

    Quiet means no action, no demand, no effect in flight, no orphan, every instance in a
    settled state, and no new revision held back by requests: then a plan changes only by a
    notification (a deployment, an instance, a demand) or when an idle step comes due. What
    else a plan reads without a notification (engine loads, request places, memory readings,
    hostd's heartbeat) matters only to a start, a wake, a drain, a busy model's idle step or a
    new revision, and each of those keeps the loop at its one-second pace.
    """
    if actions or snapshot.demands or snapshot.orphans or snapshot.restarts:
        return None
    due = math.inf
    if any(view.joined and not view.revoked for view in snapshot.hosts.values()):
        due = snapshot.now + HOST_CHECK_S
    for name, record in snapshot.deployments.items():
        if record.inflight is not None:
            return None
        instance = snapshot.instances.get(name)
        if instance is None:
            continue
        if instance.state not in SETTLED:
            return None
        if instance.state in (S.READY, S.PARKED) and instance.revision < record.revision:
            return None  # replaced once its requests end
        step = next_idle_step(snapshot, record, instance)
        if step is not None:
            if step.at <= snapshot.now:
                return None  # due but held back by requests: look again each second
            due = min(due, step.at)
    return due


def _order(snapshot: Snapshot) -> list[str]:
    demanded = sorted(snapshot.demands, key=lambda name: (snapshot.demands[name], name))
    rest = sorted(name for name in snapshot.deployments if name not in snapshot.demands)
    return [name for name in demanded if name in snapshot.deployments] + rest


# Effects in flight ------------------------------------------------------------------------


def _inflight(snapshot: Snapshot, record: DeploymentRecord) -> str:
    """pending, done, refused or expired."""
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


def _stopping(record: DeploymentRecord, instance: InstanceRecord) -> bool:
    """Whether a stop of the instance is in flight (until it is done or expires)."""
    effect = record.inflight
    return effect is not None and effect.kind == "stop" and effect.generation == instance.generation


# One deployment ---------------------------------------------------------------------------


def _deployment(  # noqa: PLR0911 (a decision table: one return per case)
    snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]
) -> list[Action]:
    name = record.name
    instance = snapshot.instances.get(name)
    state = instance.state if instance is not None else None
    live = state in LIVE_STATES
    demanded = name in snapshot.demands

    if record.deleting:
        if instance is not None and live:
            # Its stop is sent once: hostd would refuse a second one, when it got there.
            stopping = state == S.STOPPING or _stopping(record, instance)
            return [] if stopping else [stop(instance, "deleted", cause="operator")]
        return [Action("forget", name, "deleted: no engine left")]
    if record.inflight is not None:
        return _while_in_flight(snapshot, record, instance)
    if record.stopped:
        actions = [Action("drop_demand", name, "deployment_stopped")] if demanded else []
        if instance is not None and live and state != S.STOPPING:
            actions.append(stop(instance, "operator stop", cause="operator"))
        elif instance is not None and keeps_cache(instance):
            actions.append(release(instance, "operator stop"))
        return actions
    if (
        instance is not None
        and state == S.FAILED
        and instance.generation == record.generation
        and record.attempts.counted_generation != instance.generation
    ):
        return [
            Action(
                "count_failure",
                name,
                "start failed",
                generation=instance.generation,
                error=instance.error or "failed",
            )
        ]
    if record.attempts.failed:
        return [Action("drop_demand", name, "failed")] if demanded else []
    view = snapshot.hosts.get(instance.host) if instance is not None else None
    if instance is not None and live and view is not None and not view.reachable:
        return _unreachable(snapshot, record, view) if demanded else []
    return _steady(snapshot, record, instance, ledgers)


def _unreachable(snapshot: Snapshot, record: DeploymentRecord, view: HostView) -> list[Action]:
    """A demand for a deployment whose instance is on a host that cannot be reached now: it
    waits for the host's grace to pass when another host may take it (its instance then counts
    as gone, and it starts there), and is refused at once when none may."""
    why = view.why_not_reachable(snapshot.now)
    if any(
        other.name != view.name and other.reachable and not other.drained
        for other in _could_run(snapshot, record)
    ):
        grace = snapshot.tunables.host_lost_after_s
        return [
            Action(
                "wait",
                record.name,
                f"{why}; it starts on another host once the host is gone for "
                f"{format_duration(grace)}, unless it comes back",
            )
        ]
    message = (
        f"{why}; {record.name!r} may run nowhere else, so it serves again once the host is back"
    )
    return [Action("refuse", record.name, message, error=HostUnreachable.code)]


def _could_run(snapshot: Snapshot, record: DeploymentRecord) -> list[HostView]:
    """The hosts the deployment may run on (placement.hosts) and could: each has its model
    and an engine of its family (its binding is no error)."""
    bindings = snapshot.bindings.get(record.name, {})
    return [
        view
        for name, view in snapshot.hosts.items()
        if record.document.allows(name)
        and (binding := bindings.get(name)) is not None
        and binding.error is None
    ]


def _steady(  # noqa: PLR0911 (a decision table: one return per case)
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord | None,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    """A deployment with nothing in flight, not stopped, deleted or failed."""
    name = record.name
    state = instance.state if instance is not None else None
    live = state in LIVE_STATES
    if state == S.DRAINING:
        assert instance is not None  # a drain whose record was lost: finish it
        return _drain_step(snapshot, record, instance, "park", "drain", None)
    if instance is not None and live and instance.generation == record.stop_requested:
        return [] if state == S.STOPPING else [stop(instance, "host drained", cause="drain")]
    if (
        instance is not None
        and state == S.READY
        and snapshot.restarts.get(name) == (instance.generation)
    ):
        why = "cancelled requests hold every place: restarting it"
        return [stop(instance, why, cause="restart")]
    if (
        instance is not None
        and instance.revision < record.revision
        and state in (S.READY, S.PARKED)
        and not busy(snapshot, name, instance)
    ):
        why = f"revision {record.revision} replaces revision {instance.revision}"
        if state == S.PARKED:
            return [stop(instance, why, cause="revision")]
        return [drain(snapshot, record, instance, why, then="stop", cause="revision")]
    if instance is not None and keeps_cache(instance) and instance.revision < record.revision:
        why = f"revision {record.revision} replaces revision {instance.revision}"
        return [release(instance, why)]
    want = _wanted(snapshot, record, instance)
    if want == "ready":
        return _make_ready(snapshot, record, instance, ledgers)
    if want == "parked" and instance is not None and state == S.READY:
        return [drain(snapshot, record, instance, "operator park", cause="operator")]
    if instance is not None and (want is None or keeps_cache(instance)):
        return _idle(snapshot, record, instance)  # a kept LMCache server ends as a park does
    return []


def _wanted(
    snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord | None
) -> Literal["ready", "parked"] | None:
    if record.activation == "explicit":
        return record.wanted
    if record.name in snapshot.demands:
        return "ready"
    if instance is not None and record.park_requested == instance.generation:
        return "parked"
    return None


def _while_in_flight(
    snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord | None
) -> list[Action]:
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
    return _drain_step(snapshot, record, instance, then, effect.reason, effect.cause)


def _drain_step(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    then: Literal["park", "stop"],
    why: str,
    cause: EvictionCause | None,
) -> list[Action]:
    """A draining instance parks or stops once nothing runs on it (with the drain's `cause`),
    or serves again when the drain outlasts its timeout.

    Nothing runs on it when the routers hold no place of its generation and its engine's
    last reading was idle: no place can be taken once it drains (the take checks the
    instance is ready), a router gives its spare places back once it hears of the drain
    (one may carry a request it let through before), and the snapshot reads the places after
    the instance, so every request let through before the drain is counted. Otherwise its
    engine must read idle in a reading taken after the drain began: a request cut short may
    still run there."""
    load = snapshot.loads.get(record.name)
    waited = snapshot.now - instance.since
    held = snapshot.places.get(record.name)
    if held is None or held.generation != instance.generation:
        held = Places()
    unrouted = held.running + held.spare == 0 and instance.state == S.DRAINING
    if load is not None and load.generation == instance.generation:
        quiet = not load.busy
        idle = quiet and (load.read_at > instance.since or unrouted)
    else:
        idle = True  # nothing serves through an engine whose load hostd does not report
    if held.serving + held.spare > 0:
        idle = False  # a router still has requests on it, or may have
    if idle:
        if then == "park" and can_park(snapshot, instance):
            return [park(snapshot, instance, why, cause)]
        if then == "park" and parks_by_stopping(instance):
            return [stop(instance, f"{why}; a restart_only park", keep_cache=True, cause=cause)]
        why = why if then == "stop" else f"{why}; it cannot park"
        return [stop(instance, why, cause=cause)]
    if waited > snapshot.tunables.drain_timeout_s:
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
    return []


def _idle(snapshot: Snapshot, record: DeploymentRecord, instance: InstanceRecord) -> list[Action]:
    """Park after the ready idle timeout, stop after the parked one (the role's defaults
    unless the deployment sets them; `never` is off); never a warm or explicit deployment."""
    step = next_idle_step(snapshot, record, instance)
    if step is None or snapshot.now < step.at:
        return []
    if step.kind == "park":
        if busy(snapshot, record.name, instance):
            return []
        why = f"idle for {format_duration(step.timeout)}"
        return [drain(snapshot, record, instance, why, cause="idle")]
    if step.kind == "release":
        return [release(instance, f"parked idle for {format_duration(step.timeout)}")]
    return [stop(instance, f"parked idle for {format_duration(step.timeout)}", cause="idle")]


# Making a deployment ready: wake, start, or switch ---------------------------------------


def _make_ready(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord | None,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    name = record.name
    state = instance.state if instance is not None else None
    if state == S.READY:
        return [Action("satisfied", name, "ready")] if name in snapshot.demands else []
    if state == S.PARKED:
        assert instance is not None
        return _wake(snapshot, record, instance, ledgers)
    if state is not None and state not in (S.STOPPED, S.FAILED):
        return []  # starting, waking, parking, stopping or reconciling: it moves on its own
    retry_at = record.attempts.next_at
    if retry_at is not None and snapshot.now < retry_at:
        return [
            Action(
                "wait",
                name,
                f"retry in {math.ceil(retry_at - snapshot.now)}s after: "
                f"{record.attempts.last_error}",
            )
        ]
    return _start(snapshot, record, ledgers)


def _wake(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    view = snapshot.hosts.get(instance.host)
    gpu = view.gpu_of(instance.gpu_uuid) if view else None
    footprint = footprint_of(snapshot, record.name, instance.host, gpu) if gpu else None
    if view is None or gpu is None or footprint is None:
        return [
            Action("wait", record.name, f"host {instance.host} is not observed: it cannot wake")
        ]
    charge = footprint.charge("waking")
    ledger = ledgers[instance.host]
    try:
        ledgers[instance.host] = ledger.admit(record.name, charge)
    except DeviceUnobserved as exc:
        return [Action("wait", record.name, f"device_unobserved: {exc.message}")]
    except InsufficientResources:
        return switch(snapshot, record, view, gpu, charge, ledger, "wake")
    return [
        Action(
            "wake",
            record.name,
            "demanded",
            host=instance.host,
            gpu=gpu,
            generation=instance.generation,
        )
    ]


def _start(
    snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]
) -> list[Action]:
    name = record.name
    why_not: list[str] = []
    # (headroom, then the tie-breaks: the first host, the lowest GPU index; host, GPU)
    choices: list[tuple[int, tuple[int, ...], int, str, str]] = []
    allowed = [
        (host, binding)
        for host, binding in sorted(snapshot.bindings.get(name, {}).items())
        if record.document.allows(host)
    ]
    for host in record.document.placement.hosts:
        if host not in snapshot.hosts:
            why_not.append(f"{host}: no such host has joined")
    for host, binding in allowed:
        view = snapshot.hosts.get(host)
        reason = _unplaceable(snapshot, view, binding)
        if reason is not None or view is None:
            why_not.append(f"{host}: {reason}")
            continue
        ledger, host_rank, footprints = ledgers[host], _neg(host), binding.footprints
        for gpu, domain in _gpus(view, record):
            if domain in view.domains and gpu in footprints:
                gpu_rank = -int(gpu.removeprefix("gpu"))
                choices.append((headroom(ledger, domain), host_rank, gpu_rank, host, gpu))
    if not choices:
        return [_none_fits(snapshot, record, allowed, why_not)]
    # The most headroom first; on a tie the first host and the lowest GPU index.
    *_, host, gpu = max(choices, key=lambda c: c[:3])
    view = snapshot.hosts[host]
    starting = _starting_on(snapshot, host, view.domain_of(gpu))
    if starting:
        return [Action("wait", name, f"starts are one at a time on {gpu}: {starting} is starting")]
    charge = snapshot.bindings[name][host].footprints[gpu].charge("starting")
    ledger = ledgers[host]
    try:
        ledgers[host] = ledger.admit(name, charge)
    except DeviceUnobserved as exc:
        return [Action("wait", name, f"device_unobserved: {exc.message}")]
    except InsufficientResources:
        return switch(snapshot, record, view, gpu, charge, ledger, "start")
    # One start at a time per GPU holds within one plan too: a later deployment waits.
    snapshot.starting[(host, view.domain_of(gpu))] = name
    return [Action("start", name, "demanded", host=host, gpu=gpu, generation=record.generation + 1)]


def _none_fits(
    snapshot: Snapshot,
    record: DeploymentRecord,
    allowed: list[tuple[str, Binding]],
    why_not: list[str],
) -> Action:
    """Why no host may start it now: a refusal when waiting changes nothing until an operator
    acts (or a host comes back), else a wait naming each host's reason."""
    refusal = _blocked(snapshot, record)
    if refusal is not None:
        return refusal
    bindings = [binding for _, binding in allowed]
    errors = [binding.error for binding in bindings if binding.error is not None]
    if errors and len(errors) == len(bindings):
        # The document cannot run on any host (its engine, its model, its park tier):
        # waiting changes nothing until an operator does.
        first = errors[0]
        return Action("refuse", record.name, f"{first.code}: {first.message}", error=first.code)
    reasons = "; ".join(why_not) or "no hosts"
    return Action("wait", record.name, "no host can run it: " + reasons)


@cache
def _neg(host: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in host)


def _gpus(view: HostView, record: DeploymentRecord) -> list[tuple[str, str]]:
    """The GPUs a deployment may start on, each with its ledger domain."""
    pinned = record.document.device
    if view.unified:
        return view.gpu_domains[:1]
    return [(pinned, view.domain_of(pinned))] if pinned is not None else view.gpu_domains


def _blocked(snapshot: Snapshot, record: DeploymentRecord) -> Action | None:
    """A refusal when every host that could run the deployment (it may, and has its model and
    engine) is unreachable or drained: it cannot start until one comes back or is undrained,
    so its requests fail at once."""
    named = record.document.placement.hosts
    if any(host not in snapshot.hosts for host in named):
        return None  # a host it names has yet to join: it may
    views = _could_run(snapshot, record)
    if not views:
        return None  # no host has what it needs: refused (or waited for) on that
    if not all(not view.reachable or view.drained for view in views):
        return None
    unreachable = [view for view in views if not view.reachable]
    if unreachable:
        why = "; ".join(view.why_not_reachable(snapshot.now) for view in unreachable)
        message = f"{why}; {record.name!r} may run on no other host now"
        return Action("refuse", record.name, message, error=HostUnreachable.code)
    names = ", ".join(view.name for view in views)
    message = (
        f"every host {record.name!r} may run on is drained ({names}); undrain one with "
        "capyctl undrain host NAME, or widen its placement.hosts"
    )
    return Action("refuse", record.name, message, error=HostDrained.code)


def _unplaceable(snapshot: Snapshot, view: HostView | None, binding: Binding) -> str | None:
    if view is None or not view.reachable or view.drained or not view.alive:
        return _host_unusable(snapshot, view)
    if binding.error is not None:
        return f"{binding.error.code}: {binding.error.message}"
    if binding.waiting is not None:
        return binding.waiting
    if not view.domains:
        return "device_unobserved: no fresh memory reading"
    return None


def _host_unusable(snapshot: Snapshot, view: HostView | None) -> str:
    if view is not None and not view.reachable:
        return view.why_not_reachable(snapshot.now)
    if view is not None and view.drained:
        return f"host {view.name} is drained"
    return "its hostd is not running"


def _starting_on(snapshot: Snapshot, host: str, domain: str) -> str | None:
    """The deployment starting on a GPU's domain, if any: starts are one at a time per GPU."""
    return snapshot.starting.get((host, domain))
