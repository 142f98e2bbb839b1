"""`plan(snapshot) -> actions`: every decision of the scheduler, as a pure function.

Each action names its deployment and carries its reason; `actuator.py` applies them. One
effect is in flight per instance at a time; the ledger of each host is rebuilt from the
instance records (and the effects in flight) on every plan, so a restarted scheduler charges
exactly what runs, never twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from capycommon.desired import DeploymentRecord
from capycommon.engines.launch import Residency
from capycommon.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.units import format_duration, format_size
from capyctl_scheduler.ledger import (
    DeviceUnobserved,
    Footprint,
    InsufficientResources,
    Ledger,
    Phase,
)
from capyctl_scheduler.placement import headroom
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from capyctl_scheduler.switching import Candidate, choose_victims

S = InstanceState

Kind = Literal[
    "start", "wake", "drain", "undrain", "park", "stop", "count_failure", "satisfied",
    "drop_demand", "wait", "settle", "forget", "refuse",
]  # fmt: skip

# The charge of an instance by its state; a state the scheduler cannot be sure of keeps the
# larger charge until hostd proves otherwise.
PHASES: Mapping[InstanceState, Phase] = {
    S.STARTING: "starting",
    S.READY: "ready",
    S.DRAINING: "ready",
    S.PARKING: "ready",
    S.PARKED: "parked",
    S.WAKING: "waking",
    S.STOPPING: "ready",
    S.RECONCILING: "starting",
}


@dataclass(frozen=True)
class Action:
    kind: Kind
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


def plan(snapshot: Snapshot) -> list[Action]:
    """What to do now, in order: settle finished effects, then each deployment (the oldest
    demand first), then the bound on the parked set."""
    actions: list[Action] = []
    records = dict(snapshot.deployments)
    for name, record in snapshot.deployments.items():
        outcome = _inflight(snapshot, record) if record.inflight is not None else "pending"
        if outcome != "pending":
            assert record.inflight is not None
            actions.append(Action("settle", name, f"{record.inflight.kind} {outcome}"))
            records[name] = record.model_copy(update={"inflight": None})
    snapshot = replace(snapshot, deployments=records)
    ledgers = {host: charged(snapshot, host) for host in snapshot.hosts}
    for orphan in snapshot.orphans:
        if orphan.state not in (S.STOPPING,):
            actions.append(_stop(orphan, "orphan: no deployment owns this engine"))
    for name in _order(snapshot):
        actions += _deployment(snapshot, snapshot.deployments[name], ledgers)
    actions += _bound_parked(snapshot, actions)
    return actions


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
    if snapshot.now - effect.sent_at > snapshot.tunables.command_timeout_s:
        return "expired"
    return "pending"


# The ledger -------------------------------------------------------------------------------


def footprint_of(snapshot: Snapshot, name: str, host: str, gpu: str) -> Footprint | None:
    binding = snapshot.bindings.get(name, {}).get(host)
    return None if binding is None else binding.footprints.get(gpu)


def charges(snapshot: Snapshot, host: str) -> dict[str, Mapping[str, int]]:
    """Who is charged what on a host: every instance by its state, every launch or wake not
    yet taken up as if it were, and an engine nobody can size as its whole GPU."""
    view = snapshot.hosts[host]
    found: dict[str, Mapping[str, int]] = {}
    for name, instance in snapshot.instances.items():
        if instance.host != host or instance.state not in PHASES:
            continue
        found[name] = _charge(snapshot, view, name, instance, PHASES[instance.state])
    for name, record in snapshot.deployments.items():
        effect = record.inflight
        if effect is None or effect.host != host or effect.kind not in ("launch", "wake"):
            continue
        phase: Phase = "starting" if effect.kind == "launch" else "waking"
        footprint = footprint_of(snapshot, name, host, effect.gpu)
        found[name] = footprint.charge(phase) if footprint else _whole(view, effect.gpu)
    for orphan in snapshot.orphans:
        if orphan.host == host:
            found[f"orphan:{orphan.member}"] = _whole(view, view.gpu_of(orphan.gpu_uuid))
    return found


def charged(snapshot: Snapshot, host: str) -> Ledger:
    return Ledger(snapshot.hosts[host].domains, charges(snapshot, host))


def _charge(
    snapshot: Snapshot, view: HostView, name: str, instance: InstanceRecord, phase: Phase
) -> Mapping[str, int]:
    gpu = view.gpu_of(instance.gpu_uuid)
    footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
    return footprint.charge(phase) if footprint else _whole(view, gpu)


def _whole(view: HostView, gpu: str | None) -> Mapping[str, int]:
    """An engine that cannot be sized holds its whole GPU (or every GPU, if that is unknown)
    until its processes are proven gone."""
    names = [view.domain_of(gpu)] if gpu else list(view.domains)
    return {name: view.domains[name].capacity for name in names if name in view.domains}


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
            return [] if state == S.STOPPING else [_stop(instance, "deleted")]
        return [Action("forget", name, "deleted: no engine left")]
    if record.inflight is not None:
        return _while_in_flight(snapshot, record, instance)
    if record.stopped:
        actions = [Action("drop_demand", name, "deployment_stopped")] if demanded else []
        if instance is not None and live and state != S.STOPPING:
            actions.append(_stop(instance, "operator stop"))
        return actions
    if (
        instance is not None
        and state == S.FAILED
        and instance.generation == record.generation
        and record.attempts.counted_generation != instance.generation
    ):
        return [
            Action("count_failure", name, "start failed", generation=instance.generation,
                   error=instance.error or "failed")
        ]  # fmt: skip
    if record.attempts.failed:
        return [Action("drop_demand", name, "failed")] if demanded else []
    return _steady(snapshot, record, instance, ledgers)


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
        return _drain_step(snapshot, record, instance, "park", "drain")
    if instance is not None and live and instance.generation == record.stop_requested:
        return [] if state == S.STOPPING else [_stop(instance, "host drained")]
    if (
        instance is not None
        and state == S.READY
        and snapshot.restarts.get(name) == (instance.generation)
    ):
        return [_stop(instance, "cancelled requests hold every place: restarting it")]
    if (
        instance is not None
        and instance.revision < record.revision
        and state in (S.READY, S.PARKED)
        and not busy(snapshot, name, instance)
    ):
        why = f"revision {record.revision} replaces revision {instance.revision}"
        if state == S.PARKED:
            return [_stop(instance, why)]
        return [_drain(snapshot, record, instance, why, then="stop")]
    want = _wanted(snapshot, record, instance)
    if want == "ready":
        return _make_ready(snapshot, record, instance, ledgers)
    if want == "parked" and instance is not None and state == S.READY:
        return [_drain(snapshot, record, instance, "operator park")]
    if want is None and instance is not None:
        return _idle(snapshot, record, instance)
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
            Action("undrain", record.name, "requests are waiting for it: it serves again",
                   host=instance.host, generation=instance.generation)
        ]  # fmt: skip
    return _drain_step(snapshot, record, instance, effect.then or "park", effect.reason)


def _drain_step(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    then: Literal["park", "stop"],
    why: str,
) -> list[Action]:
    """A draining instance parks or stops once its engine reads idle (a reading taken after
    the drain began), or serves again when the drain outlasts its timeout."""
    load = snapshot.loads.get(record.name)
    waited = snapshot.now - instance.since
    if load is not None and load.generation == instance.generation:
        idle = load.running + load.waiting == 0 and load.read_at > instance.since
    else:
        idle = True  # nothing serves through an engine whose load hostd does not report
    held = snapshot.places.get(record.name)
    if held is not None and held.generation == instance.generation and held.serving > 0:
        idle = False  # a router still has requests on it
    if idle:
        if then == "park" and _can_park(snapshot, instance):
            return [_park(snapshot, instance, why)]
        return [_stop(instance, why if then == "stop" else f"{why}; it cannot park")]
    if waited > snapshot.tunables.drain_timeout_s:
        running = load.running + load.waiting if load is not None else 0
        return [
            Action("undrain", record.name,
                   f"drain timed out after {format_duration(waited)} with {running} requests "
                   "still running; it serves again", host=instance.host,
                   generation=instance.generation)
        ]  # fmt: skip
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
        return [_drain(snapshot, record, instance, f"idle for {format_duration(step.timeout)}")]
    return [_stop(instance, f"parked idle for {format_duration(step.timeout)}")]


@dataclass(frozen=True)
class IdleStep:
    kind: Literal["park", "stop"]
    at: float
    timeout: float


def idle_timeouts(
    snapshot: Snapshot, record: DeploymentRecord
) -> tuple[float | None, float | None]:
    """The ready and parked idle timeouts in force: the deployment's, else the role's."""
    lifecycle = record.document.lifecycle
    found = []
    for own, default in (
        (lifecycle.ready_idle_timeout, snapshot.tunables.ready_idle_s),
        (lifecycle.parked_idle_timeout, snapshot.tunables.parked_idle_s),
    ):
        found.append(default if own is None else None if own == "never" else own)
    return found[0], found[1]


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
    return (
        load is not None
        and load.generation == instance.generation
        and load.running + load.waiting > 0
    )


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
            Action("wait", name, f"retry in {format_duration(retry_at - snapshot.now)} after: "
                   f"{record.attempts.last_error}")
        ]  # fmt: skip
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
        return _switch(snapshot, record, view, gpu, charge, ledger, "wake")
    return [
        Action("wake", record.name, "demanded", host=instance.host, gpu=gpu,
               generation=instance.generation)
    ]  # fmt: skip


def _start(
    snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]
) -> list[Action]:
    name = record.name
    why_not: list[str] = []
    choices: list[tuple[int, str, str]] = []
    for host, binding in sorted(snapshot.bindings.get(name, {}).items()):
        view = snapshot.hosts.get(host)
        reason = _unplaceable(view, binding)
        if reason is not None or view is None:
            why_not.append(f"{host}: {reason}")
            continue
        for gpu in _gpus(view, record):
            domain = view.domain_of(gpu)
            if domain in view.domains and gpu in binding.footprints:
                choices.append((headroom(ledgers[host], domain), host, gpu))
    if not choices:
        bindings = snapshot.bindings.get(name, {}).values()
        errors = [binding.error for binding in bindings if binding.error is not None]
        if errors and len(errors) == len(bindings):
            # The document cannot run on any host (its engine, its model, its park tier):
            # waiting changes nothing until an operator does.
            first = errors[0]
            return [Action("refuse", name, f"{first.code}: {first.message}", error=first.code)]
        return [Action("wait", name, "no host can run it: " + ("; ".join(why_not) or "no hosts"))]
    # The most headroom first; on a tie the first host and the lowest GPU index.
    _, host, gpu = max(choices, key=lambda c: (c[0], _neg(c[1]), -int(c[2].removeprefix("gpu"))))
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
        return _switch(snapshot, record, view, gpu, charge, ledger, "start")
    return [Action("start", name, "demanded", host=host, gpu=gpu, generation=record.generation + 1)]


def _neg(host: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in host)


def _gpus(view: HostView, record: DeploymentRecord) -> list[str]:
    pinned = record.document.device
    if view.unified:
        return sorted(view.gpus)[:1]
    return [pinned] if pinned is not None else sorted(view.gpus)


def _unplaceable(view: HostView | None, binding: Binding) -> str | None:
    if view is None or not view.alive:
        return "its hostd is not running"
    if binding.error is not None:
        return f"{binding.error.code}: {binding.error.message}"
    if not view.domains:
        return "device_unobserved: no fresh memory reading"
    return None


def _starting_on(snapshot: Snapshot, host: str, domain: str) -> str | None:
    """The deployment starting on a GPU's domain, if any: starts are one at a time per GPU."""
    view = snapshot.hosts[host]
    for name, instance in snapshot.instances.items():
        if instance.host == host and instance.state == S.STARTING:
            gpu = view.gpu_of(instance.gpu_uuid)
            if gpu is not None and view.domain_of(gpu) == domain:
                return name
    for name, record in snapshot.deployments.items():
        effect = record.inflight
        launching = effect is not None and effect.kind == "launch" and effect.host == host
        if launching and effect is not None and view.domain_of(effect.gpu) == domain:
            return name
    return None


def _switch(
    snapshot: Snapshot,
    record: DeploymentRecord,
    view: HostView,
    gpu: str,
    charge: Mapping[str, int],
    ledger: Ledger,
    verb: str,
) -> list[Action]:
    """Make room for `record` on `gpu`: wait for releases already under way, else choose
    victims (least recently used, never busy, warm or explicit) and drain them."""
    name = record.name
    projected = _projected(snapshot, view, ledger)
    if not projected.refusals(name, charge):
        return [Action("wait", name, f"switch: waiting for memory being released to {verb}")]
    candidates = list(_candidates(snapshot, view, name, projected))
    try:
        releases = choose_victims(projected, name, charge, candidates)
    except InsufficientResources as exc:
        beyond = _beyond_reach(snapshot, record, gpu, charge, ledger)
        if beyond is not None:
            code = InsufficientResources.code
            return [Action("refuse", name, f"{code}: {beyond}", error=code)]
        return [Action("wait", name, f"insufficient_resources: {exc.message}")]
    actions = []
    for release in releases:
        instance = snapshot.instances[release.owner]
        victim = snapshot.deployments[release.owner]
        why = f"switch to {name}: {release.reason.removeprefix('switch: ')}"
        if instance.state == S.PARKED:
            actions.append(_stop(instance, why))
        else:
            actions.append(_drain(snapshot, victim, instance, why, then=release.action))
    victims = ", ".join(release.owner for release in releases)
    actions.append(Action("wait", name, f"switch: releasing {victims} to {verb} {name} on {gpu}"))
    return actions


def _beyond_reach(
    snapshot: Snapshot, record: DeploymentRecord, gpu: str, charge: Mapping[str, int],
    ledger: Ledger,
) -> str | None:  # fmt: skip
    """Why `charge` cannot fit even once every instance that may be evicted is stopped (busy
    ones included: they end), with the figures; None when waiting can make room."""
    kept = ledger
    for owner in ledger.charges:
        other = snapshot.deployments.get(owner)
        if owner != record.name and other is not None and not protected(other):
            kept = kept.release(owner)
    refusals = kept.refusals(record.name, charge)
    if not refusals:
        return None
    parts = []
    for refusal in refusals:
        domain = ledger.domains[refusal.domain]
        ceiling = min(domain.managed_limit, domain.capacity - domain.free_reserve)
        freeable = ledger.total(refusal.domain, without=record.name) - kept.total(
            refusal.domain, without=record.name
        )
        holders = sorted(
            owner
            for owner, held in kept.charges.items()
            if owner != record.name and held.get(refusal.domain)
        )
        part = (
            f"needs {format_size(refusal.needs)} on {refusal.domain}, which holds at most "
            f"{format_size(ceiling)} for models ({format_size(domain.capacity)} with "
            f"{format_size(domain.free_reserve)} reserve); stopping every model that may be "
            f"evicted frees {format_size(freeable)}, leaving {format_size(refusal.free)}"
        )
        if holders:
            part += f" ({', '.join(holders)}: warm, explicit or unknown, never evicted)"
        parts.append(part)
    return f"{record.name} cannot run on {gpu}: " + "; ".join(parts)


def protected(record: DeploymentRecord) -> bool:
    """Never a victim of a switch, an idle step or the parked bound: warm or explicit."""
    return record.document.lifecycle.warm or record.activation == "explicit"


def _projected(snapshot: Snapshot, view: HostView, ledger: Ledger) -> Ledger:
    """The ledger once the releases under way have landed: draining or parking instances at
    their parked charge, or none if they stop."""
    projected = ledger
    for name, record in snapshot.deployments.items():
        instance = snapshot.instances.get(name)
        if instance is None or instance.host != view.name or name not in ledger.charges:
            continue
        effect = record.inflight
        stopping = instance.state == S.STOPPING or (
            effect is not None
            and (effect.kind == "stop" or (effect.kind == "drain" and effect.then == "stop"))
        )
        parking = instance.state in (S.PARKING, S.DRAINING) or (
            effect is not None and effect.kind == "park"
        )
        if stopping:
            projected = projected.release(name)
        elif parking:
            gpu = view.gpu_of(instance.gpu_uuid)
            footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
            if footprint is not None:
                projected = Ledger(
                    projected.domains, {**projected.charges, name: footprint.charge("parked")}
                )
    return projected


def _candidates(
    snapshot: Snapshot, view: HostView, requester: str, ledger: Ledger
) -> Iterable[Candidate]:
    parked_full = _parked_full(snapshot, view)
    for name, instance in snapshot.instances.items():
        record = snapshot.deployments.get(name)
        if record is None or name == requester or instance.host != view.name:
            continue
        if record.inflight is not None or instance.state not in (S.READY, S.PARKED):
            continue
        gpu = view.gpu_of(instance.gpu_uuid)
        footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
        if footprint is None:
            continue
        yield Candidate(
            owner=name,
            last_used=last_used(snapshot, name, instance),
            busy=busy(snapshot, name, instance),
            protected=protected(record),
            can_park=instance.state == S.READY
            and _can_park(snapshot, instance)
            and not parked_full,
            parked_charge=footprint.charge("parked"),
        )


def _parked_full(snapshot: Snapshot, view: HostView) -> bool:
    parked = [i for i in snapshot.instances.values() if i.host == view.name and i.state == S.PARKED]
    return len(parked) >= snapshot.tunables.max_parked


def _bound_parked(snapshot: Snapshot, planned: list[Action]) -> list[Action]:
    """Beyond max_parked on a host, the least recently parked stop (never warm or explicit)."""
    touched = {action.deployment for action in planned if action.kind not in ("wait", "settle")}
    actions = []
    for host in snapshot.hosts:
        parked = sorted(
            (i for name, i in snapshot.instances.items()
             if i.host == host and i.state == S.PARKED and name in snapshot.deployments),
            key=lambda i: i.since,
        )  # fmt: skip
        excess = len(parked) - snapshot.tunables.max_parked
        for instance in parked:
            if excess <= 0:
                break
            record = snapshot.deployments[instance.deployment]
            if instance.deployment in touched or record.inflight is not None or protected(record):
                continue
            actions.append(
                _stop(instance, f"bounded parked set: at most {snapshot.tunables.max_parked} "
                      f"parked on {host}; least recently used")
            )  # fmt: skip
            excess -= 1
    return actions


# Building actions -------------------------------------------------------------------------


def _can_park(snapshot: Snapshot, instance: InstanceRecord) -> bool:
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
    gpu = view.gpu_of(instance.gpu_uuid)
    footprint = footprint_of(snapshot, instance.deployment, instance.host, gpu) if gpu else None
    if footprint is None:
        return True
    parked: dict[str, int] = {}
    for name, other in snapshot.instances.items():
        if other.host != instance.host or other.state != S.PARKED or name == instance.deployment:
            continue
        other_gpu = view.gpu_of(other.gpu_uuid)
        found = footprint_of(snapshot, name, other.host, other_gpu) if other_gpu else None
        for domain, size in (found.charge("parked") if found else {}).items():
            parked[domain] = parked.get(domain, 0) + size
    return all(
        parked.get(domain, 0) + size <= view.domains[domain].parked_limit
        for domain, size in footprint.charge("parked").items()
        if domain in view.domains
    )


def _drain(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    why: str,
    then: Literal["park", "stop"] | None = None,
) -> Action:
    then = then or ("park" if _can_park(snapshot, instance) else "stop")
    return Action("drain", record.name, why, host=instance.host,
                  gpu=snapshot.hosts[instance.host].gpu_of(instance.gpu_uuid) or "",
                  generation=instance.generation, then=then)  # fmt: skip


def _park(snapshot: Snapshot, instance: InstanceRecord, why: str) -> Action:
    view = snapshot.hosts[instance.host]
    gpu = view.gpu_of(instance.gpu_uuid) or ""
    footprint = footprint_of(snapshot, instance.deployment, instance.host, gpu)
    bound = footprint.charge("parked").get(view.domain_of(gpu)) if footprint else None
    return Action("park", instance.deployment, why, host=instance.host, gpu=gpu,
                  generation=instance.generation, release_bound=bound)  # fmt: skip


def _stop(instance: InstanceRecord, why: str) -> Action:
    return Action("stop", instance.deployment, why, host=instance.host,
                  generation=instance.generation)  # fmt: skip
