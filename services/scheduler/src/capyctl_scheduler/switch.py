"""A switch, read from a snapshot: making room for a start or a wake on one GPU (`switch`),
and ending the switch once its deployment is ready (`switch_end`).

The choice among candidates is `victims.choose_victims`, over the ledger; this module
finds the candidates (never busy, warm or explicit) and turns the releases into actions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from capycommon.domain.desired import DeploymentRecord, Victim
from capycommon.domain.instances import InstanceState
from capycommon.errors import InsufficientResources
from capycommon.units import format_size
from capyctl_scheduler import actions as act
from capyctl_scheduler.actions import Action, can_park, drain, keeps_cache, stop
from capyctl_scheduler.charges import after_releases, footprint_of
from capyctl_scheduler.ledger import Ledger
from capyctl_scheduler.snapshot import HostView, Snapshot
from capyctl_scheduler.usage import busy, last_used, protected
from capyctl_scheduler.victims import Candidate, choose_victims

S = InstanceState


def switch(
    snapshot: Snapshot,
    record: DeploymentRecord,
    view: HostView,
    gpu: str,
    charge: Mapping[str, int],
    ledger: Ledger,
    verb: str,
) -> list[Action]:
    """Make room for `record` on `gpu`: wait for releases already under way, else choose
    victims (least recently used, never busy, warm or explicit) and drain them. The wait that
    names the victims also carries them: the actuator records the switch on the deployment's
    record (when it began, its victims) before it releases any of them."""
    name = record.name
    projected = after_releases(snapshot, view, ledger)
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
            actions.append(stop(instance, why, cause="switch"))
        elif keeps_cache(instance):
            actions.append(act.release(instance, why))
        else:
            actions.append(
                drain(snapshot, victim, instance, why, then=release.action, cause="switch")
            )
    released = tuple(
        Victim(deployment=r.owner, generation=snapshot.instances[r.owner].generation)
        for r in releases
    )
    victims = ", ".join(release.owner for release in releases)
    why = f"switch: releasing {victims} to {verb} {name} on {gpu}"
    actions.append(Action("wait", name, why, host=view.name, gpu=gpu, victims=released))
    return actions


def switch_end(snapshot: Snapshot, record: DeploymentRecord) -> list[Action]:
    """The end of a switch to `record`: counted once its deployment is ready, dropped once it
    is no longer wanted (its demand expired or was refused, an operator stopped or deleted
    it) and none of its start or wake is under way."""
    if record.switch is None:
        return []
    name = record.name
    instance = snapshot.instances.get(name)
    if instance is not None and instance.state == S.READY:
        why = "ready: the switch to it ended"
        host, generation = instance.host, instance.generation
        return [Action("switched", name, why, host=host, generation=generation)]
    moving = record.inflight is not None or (
        instance is not None and instance.state in (S.STARTING, S.WAKING, S.RECONCILING)
    )
    explicit = record.activation == "explicit" and record.wanted == "ready"
    wanted = (name in snapshot.demands or explicit) and not (record.stopped or record.deleting)
    if moving or wanted:
        return []
    return [Action("drop_switch", name, "the switch to it ended: it is no longer wanted")]


def _beyond_reach(
    snapshot: Snapshot,
    record: DeploymentRecord,
    gpu: str,
    charge: Mapping[str, int],
    ledger: Ledger,
) -> str | None:
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


def _candidates(
    snapshot: Snapshot, view: HostView, requester: str, ledger: Ledger
) -> Iterable[Candidate]:
    parked_full = _parked_full(snapshot, view)
    for name, instance in snapshot.on_host.get(view.name, {}).items():
        record = snapshot.deployments.get(name)
        if record is None or name == requester:
            continue
        if record.inflight is not None:
            continue
        if keeps_cache(instance):  # a restart_only park's LMCache server: released at once
            yield Candidate(
                owner=name,
                last_used=instance.since,
                busy=False,
                protected=protected(record),
                can_park=False,
                parked_charge={},
            )
            continue
        if instance.state not in (S.READY, S.PARKED):
            continue
        gpu = view.place_of(instance)
        footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
        if footprint is None:
            continue
        yield Candidate(
            owner=name,
            last_used=last_used(snapshot, name, instance),
            busy=busy(snapshot, name, instance),
            protected=protected(record),
            can_park=instance.state == S.READY and can_park(snapshot, instance) and not parked_full,
            parked_charge=footprint.charge("parked"),
        )


def _parked_full(snapshot: Snapshot, view: HostView) -> bool:
    return len(snapshot.parked.get(view.name, {})) >= snapshot.tunables.max_parked
