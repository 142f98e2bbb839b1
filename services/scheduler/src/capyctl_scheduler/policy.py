"""`plan(snapshot) -> actions`: the scheduler's rule table, as a pure function.

A plan settles the effects that finished, ends the switches whose deployment is ready, marks
joined hosts, stops orphans, then walks each deployment (the oldest demand first) down its
table, `_deployment` then `_steady`, where the first case that holds decides; last it keeps
each host's parked set within its bound. The helpers the rows call live apart: `effects`
(an effect in flight), `admission` (a wake or a start the ledger admits), `placement` (where
a start goes, or why none may take it), `switch` (making room) and `usage` (idle steps).

Each action names its deployment and carries its reason; `actuator.py` applies them. One
effect is in flight per instance at a time; the ledger of each host is rebuilt from the
instance records (and the effects in flight) on every plan, so a restarted scheduler charges
exactly what runs, never twice.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.units import format_duration
from capyctl_scheduler import admission, effects, placement
from capyctl_scheduler.actions import Action, drain, keeps_cache, release, stop
from capyctl_scheduler.charges import charged
from capyctl_scheduler.ledger import Ledger
from capyctl_scheduler.snapshot import Snapshot
from capyctl_scheduler.switch import switch_end
from capyctl_scheduler.usage import busy, next_idle_step, protected

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
        outcome = effects.outcome(snapshot, record) if effect is not None else "pending"
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
    actions += _bound_parked(snapshot, actions)
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


# The table of one deployment -------------------------------------------------------------


def _deployment(  # noqa: PLR0911 (a rule table: one return per case)
    snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]
) -> list[Action]:
    """What an operator or a failure decided comes first: a deletion, an effect in flight, a
    stop, a failed start; then a host that cannot be reached; then the steady rows."""
    name = record.name
    instance = snapshot.instances.get(name)
    state = instance.state if instance is not None else None
    live = state in LIVE_STATES
    demanded = name in snapshot.demands

    if record.deleting:
        if instance is not None and live:
            # Its stop is sent once: hostd would refuse a second one, when it got there.
            stopping = state == S.STOPPING or effects.stopping(record, instance)
            return [] if stopping else [stop(instance, "deleted", cause="operator")]
        return [Action("forget", name, "deleted: no engine left")]
    if record.inflight is not None:
        return effects.while_in_flight(snapshot, record, instance)
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
        error = instance.error or "failed"
        generation = instance.generation
        return [Action("count_failure", name, "start failed", generation=generation, error=error)]
    if record.attempts.failed:
        return [Action("drop_demand", name, "failed")] if demanded else []
    view = snapshot.hosts.get(instance.host) if instance is not None else None
    if instance is not None and live and view is not None and not view.reachable:
        return placement.unreachable(snapshot, record, view) if demanded else []
    return _steady(snapshot, record, instance, ledgers)


def _steady(  # noqa: PLR0911 (a rule table: one return per case)
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord | None,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    """A deployment with nothing in flight, not stopped, deleted or failed: a lost drain
    finishes, a drained host's instance stops, a restart or a new revision replaces it, then
    what is wanted of it (ready, parked), else its idle step."""
    name = record.name
    state = instance.state if instance is not None else None
    live = state in LIVE_STATES
    if state == S.DRAINING:
        assert instance is not None  # a drain whose record was lost: finish it
        return effects.drain_step(snapshot, record, instance, "park", "drain", None)
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


def _make_ready(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord | None,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    """Ready already, a wake, nothing while it moves, a wait out a retry's cooldown, or a
    start."""
    name = record.name
    state = instance.state if instance is not None else None
    if state == S.READY:
        return [Action("satisfied", name, "ready")] if name in snapshot.demands else []
    if state == S.PARKED:
        assert instance is not None
        return admission.wake(snapshot, record, instance, ledgers)
    if state is not None and state not in (S.STOPPED, S.FAILED):
        return []  # starting, waking, parking, stopping or reconciling: it moves on its own
    retry_at = record.attempts.next_at
    if retry_at is not None and snapshot.now < retry_at:
        why = f"retry in {math.ceil(retry_at - snapshot.now)}s after: {record.attempts.last_error}"
        return [Action("wait", name, why)]
    return admission.start(snapshot, record, ledgers)


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


def _bound_parked(snapshot: Snapshot, planned: list[Action]) -> list[Action]:
    """Beyond max_parked on a host, the least recently parked stop (never warm or explicit,
    nor one the plan already acts on)."""
    bookkeeping = ("wait", "settle", "switched", "drop_switch")
    touched = {action.deployment for action in planned if action.kind not in bookkeeping}
    actions = []
    bound = snapshot.tunables.max_parked
    for host in snapshot.hosts:
        found = snapshot.parked.get(host, {})
        parked = sorted(
            (i for name, i in found.items() if name in snapshot.deployments), key=lambda i: i.since
        )
        excess = len(parked) - bound
        for instance in parked:
            if excess <= 0:
                break
            record = snapshot.deployments[instance.deployment]
            if instance.deployment in touched or record.inflight is not None or protected(record):
                continue
            why = f"bounded parked set: at most {bound} parked on {host}; least recently used"
            actions.append(stop(instance, why, cause="max_parked"))
            excess -= 1
    return actions
