"""Admission: a wake where the instance parked, or a start where placement puts it, each when
the host's ledger admits its charge (every domain stays under its managed limit and leaves its
free reserve); when the ledger refuses, a switch makes room (`switch.switch`).

Each admission charges the plan's own ledger of its host, so a later deployment in the same
plan sees the memory taken; starts are one at a time per GPU, within one plan too.
"""

from __future__ import annotations

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import InstanceRecord
from capycommon.errors import DeviceUnobserved, InsufficientResources
from capyctl_scheduler import placement
from capyctl_scheduler.actions import Action
from capyctl_scheduler.charges import footprint_of
from capyctl_scheduler.ledger import Ledger
from capyctl_scheduler.snapshot import Snapshot
from capyctl_scheduler.switch import switch


def wake(
    snapshot: Snapshot,
    record: DeploymentRecord,
    instance: InstanceRecord,
    ledgers: dict[str, Ledger],
) -> list[Action]:
    """Wake a parked instance on the GPU it parked on, charged as it wakes."""
    view = snapshot.hosts.get(instance.host)
    gpu = view.place_of(instance) if view else None
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


def start(snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]) -> list[Action]:
    """Start the next generation where placement puts it, charged its startup peak; the start
    carries what the ledger leaves free on that GPU as it starts (what SGLang is told its
    share of)."""
    name = record.name
    placed = placement.best(snapshot, record, ledgers)
    if placed is None:
        return [placement.none_fits(snapshot, record)]
    host, gpu = placed.host, placed.gpu
    view = snapshot.hosts[host]
    domains = view.domains_of(gpu)
    for domain in domains:
        starting = snapshot.starting.get((host, domain))
        if starting:
            return [
                Action(
                    "wait", name, f"starts are one at a time on {domain}: {starting} is starting"
                )
            ]
    charge = snapshot.bindings[name][host].footprints[gpu].charge("starting")
    ledger = ledgers[host]
    try:
        ledgers[host] = ledger.admit(name, charge)
    except DeviceUnobserved as exc:
        return [Action("wait", name, f"device_unobserved: {exc.message}")]
    except InsufficientResources:
        return switch(snapshot, record, view, gpu, charge, ledger, "start")
    # One start at a time per GPU holds within one plan too: a later deployment waits.
    for domain in domains:
        snapshot.starting[(host, domain)] = name
    # What the fullest GPU of the set leaves the engine (each rank is told the same share).
    free = min(ledger.domains[d].capacity - ledger.total(d, without=name) for d in domains)
    return [
        Action(
            "start",
            name,
            "demanded",
            host=host,
            gpu=gpu,
            generation=record.generation + 1,
            device_free=free,
            placed=placement.explain(snapshot, record, placed),
        )
    ]
