"""The ledger view of a snapshot: what each instance is charged on its host's domains.

An instance is charged by its state (`PHASES`), a launch or wake not yet taken up as if it
had been, and an engine nobody can size as its whole GPU, so the ledger is rebuilt from the
instance records on every plan and a restarted scheduler charges exactly what runs.
`gpu_memory` sums it per GPU and phase, for the router's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import ChargePhase, GpuCharges, GpuMemory
from capyctl_scheduler.ledger import SYSTEM, Footprint, Ledger
from capyctl_scheduler.snapshot import HostView, Snapshot

S = InstanceState
Charged = Literal["starting", "ready", "parked", "waking"]

# The charge of an instance by its state; a state the scheduler cannot be sure of keeps the
# larger charge until hostd proves otherwise.
PHASES: Mapping[InstanceState, Charged] = {
    S.STARTING: "starting",
    S.READY: "ready",
    S.DRAINING: "ready",
    S.PARKING: "ready",
    S.PARKED: "parked",
    S.WAKING: "waking",
    S.STOPPING: "ready",
    S.RECONCILING: "starting",
}


def footprint_of(snapshot: Snapshot, name: str, host: str, gpu: str) -> Footprint | None:
    binding = snapshot.bindings.get(name, {}).get(host)
    return None if binding is None else binding.footprints.get(gpu)


def charges(snapshot: Snapshot, host: str) -> dict[str, Mapping[str, int]]:
    """Who is charged what on a host: every instance by its state, every launch or wake not
    yet taken up as if it were, and an engine nobody can size as its whole GPU."""
    return {owner: charge for owner, (_, charge) in phased(snapshot, host).items()}


def phased(snapshot: Snapshot, host: str) -> dict[str, tuple[ChargePhase, Mapping[str, int]]]:
    """`charges`, each with the phase it is charged as (`cache`: a stopped instance's kept
    LMCache server; `orphan`: an engine no deployment owns; `unknown`: an engine of a host
    the server lost or revoked, which runs on as far as anyone knows)."""
    view = snapshot.hosts[host]
    found: dict[str, tuple[ChargePhase, Mapping[str, int]]] = {}
    for name, instance in snapshot.on_host.get(host, {}).items():
        if instance.state == S.STOPPED and instance.cache is not None:
            found[name] = ("cache", cache_charge(view, instance))
        if instance.state not in PHASES:
            continue
        phase = PHASES[instance.state]
        found[name] = (phase, _charge(snapshot, view, name, instance, phase))
    for name, record in snapshot.deployments.items():
        effect = record.inflight
        if effect is None or effect.host != host or effect.kind not in ("launch", "wake"):
            continue
        phase = "starting" if effect.kind == "launch" else "waking"
        footprint = footprint_of(snapshot, name, host, effect.gpu)
        found[name] = (phase, footprint.charge(phase) if footprint else _whole(view, effect.gpu))
    for orphan in snapshot.orphans:
        if orphan.host != host:
            continue
        if orphan.state not in PHASES and orphan.cache is not None:
            found[f"orphan:{orphan.member}"] = ("cache", cache_charge(view, orphan))
        else:
            whole = _whole(view, view.place_of(orphan))
            found[f"orphan:{orphan.member}"] = ("orphan", whole)
    for lost in snapshot.stranded:
        # An engine of a host the server lost or revoked runs on as far as anyone knows: its
        # memory stays charged until the host is back and its records show it gone.
        if lost.host == host:
            whole = _whole(view, view.place_of(lost))
            found[f"unknown:{lost.member}"] = ("unknown", whole)
    return found


def gpu_memory(snapshot: Snapshot) -> GpuMemory:
    """What the ledger charges on each GPU of each observed host, by phase, beside the GPU's
    capacity, limits and what admission may still take (a unified host's one pool is its
    GPU `unified`; host RAM is left out)."""
    gpus = []
    for host, view in sorted(snapshot.hosts.items()):
        found = phased(snapshot, host)
        for domain in sorted(view.domains.values(), key=lambda d: d.name):
            if domain.name == SYSTEM:
                continue
            charged: dict[ChargePhase, int] = {}
            for phase, charge in found.values():
                if domain.name in charge:
                    charged[phase] = charged.get(phase, 0) + charge[domain.name]
            ceiling = min(domain.managed_limit, domain.capacity - domain.free_reserve)
            gpus.append(
                GpuCharges(
                    host=host,
                    gpu=domain.name,
                    capacity=domain.capacity,
                    managed_limit=domain.managed_limit,
                    reserve=domain.free_reserve,
                    parked_limit=domain.parked_limit,
                    free=max(0, ceiling - sum(charged.values())),
                    charged=charged,
                )
            )
    return GpuMemory(gpus=tuple(gpus))


def cache_charge(view: HostView, instance: InstanceRecord) -> Mapping[str, int]:
    """A stopped instance's kept LMCache server: its host RAM and its CUDA context, as the
    launch that started it was charged (its whole GPU's worth when the GPU is unknown)."""
    cache = instance.cache
    assert cache is not None
    gpu = view.place_of(instance)
    home = "unified" if view.unified else "system"
    if gpu is None:
        return {home: cache.host_bytes}
    device = view.domain_of(gpu)
    charge = {home: cache.host_bytes}
    charge[device] = charge.get(device, 0) + cache.device_bytes
    return charge


def charged(snapshot: Snapshot, host: str) -> Ledger:
    return Ledger(snapshot.hosts[host].domains, charges(snapshot, host))


def _charge(
    snapshot: Snapshot, view: HostView, name: str, instance: InstanceRecord, phase: Charged
) -> Mapping[str, int]:
    gpu = view.place_of(instance)
    footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
    return footprint.charge(phase) if footprint else _whole(view, gpu)


def _whole(view: HostView, gpu: str | None) -> Mapping[str, int]:
    """An engine that cannot be sized holds its whole GPUs (or every GPU, if they are
    unknown) until its processes are proven gone."""
    names = view.domains_of(gpu) if gpu else list(view.domains)
    return {name: view.domains[name].capacity for name in names if name in view.domains}


def after_releases(snapshot: Snapshot, view: HostView, ledger: Ledger) -> Ledger:
    """The ledger once the releases under way have landed: draining or parking instances at
    their parked charge, or none if they stop."""
    landed = ledger
    for name in ledger.charges:  # the order does not matter: each owner changes only its own
        record = snapshot.deployments.get(name)
        instance = snapshot.instances.get(name)
        if record is None or instance is None or instance.host != view.name:
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
            landed = landed.release(name)
        elif parking:
            gpu = view.place_of(instance)
            footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
            if footprint is not None:
                landed = Ledger(
                    landed.domains, {**landed.charges, name: footprint.charge("parked")}
                )
    return landed
