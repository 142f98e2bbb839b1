"""The ledger view of a snapshot: what each instance is charged on its host's domains.

An instance is charged by its state (`PHASES`), a launch or wake not yet taken up as if it
had been, and an engine nobody can size as its whole GPU, so the ledger is rebuilt from the
instance records on every plan and a restarted scheduler charges exactly what runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from capycommon.state.instances import InstanceRecord, InstanceState
from capyctl_scheduler.ledger import Footprint, Ledger, Phase
from capyctl_scheduler.snapshot import HostView, Snapshot

S = InstanceState

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


def footprint_of(snapshot: Snapshot, name: str, host: str, gpu: str) -> Footprint | None:
    binding = snapshot.bindings.get(name, {}).get(host)
    return None if binding is None else binding.footprints.get(gpu)


def charges(snapshot: Snapshot, host: str) -> dict[str, Mapping[str, int]]:
    """Who is charged what on a host: every instance by its state, every launch or wake not
    yet taken up as if it were, and an engine nobody can size as its whole GPU."""
    view = snapshot.hosts[host]
    found: dict[str, Mapping[str, int]] = {}
    for name, instance in snapshot.on_host.get(host, {}).items():
        if instance.state == S.STOPPED and instance.cache is not None:
            found[name] = cache_charge(view, instance)
        if instance.state not in PHASES:
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
        if orphan.host != host:
            continue
        if orphan.state not in PHASES and orphan.cache is not None:
            found[f"orphan:{orphan.member}"] = cache_charge(view, orphan)
        else:
            found[f"orphan:{orphan.member}"] = _whole(view, view.gpu_of(orphan.gpu_uuid))
    return found


def cache_charge(view: HostView, instance: InstanceRecord) -> Mapping[str, int]:
    """A stopped instance's kept LMCache server: its host RAM and its CUDA context, as the
    launch that started it was charged (its whole GPU's worth when the GPU is unknown)."""
    cache = instance.cache
    assert cache is not None
    gpu = view.gpu_of(instance.gpu_uuid)
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
            gpu = view.gpu_of(instance.gpu_uuid)
            footprint = footprint_of(snapshot, name, view.name, gpu) if gpu else None
            if footprint is not None:
                landed = Ledger(
                    landed.domains, {**landed.charges, name: footprint.charge("parked")}
                )
    return landed
