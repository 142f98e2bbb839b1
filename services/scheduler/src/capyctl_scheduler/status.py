"""What `status deployment`, `list deployments` and `list hosts` show, built from a snapshot
as the management API's answers (`capycommon.management`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TypeVar

from pydantic import BaseModel

from capycommon.deployments import Resolved
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.domain.memory import MemoryReading
from capycommon.engines import lmcache
from capycommon.management import (
    Attempts,
    Binding,
    BindingError,
    Charge,
    DeploymentStatus,
    DeploymentSummary,
    HostDomain,
    HostGpu,
    HostRow,
    Idle,
    IdleStep,
    InFlight,
    InstanceView,
    Operation,
    Refusal,
    Requests,
    Startup,
)
from capycommon.units import format_size
from capyctl_scheduler import gpusets
from capyctl_scheduler.charges import PHASES, charges, footprint_of
from capyctl_scheduler.ledger import Footprint
from capyctl_scheduler.snapshot import Snapshot
from capyctl_scheduler.usage import idle_timeouts, next_idle_step, protected

S = InstanceState
W = TypeVar("W", bound=BaseModel)


def state_of(snapshot: Snapshot, name: str) -> str:  # noqa: PLR0911 (one word per case)
    """One word for a deployment: its instance's state, or why it has none."""
    record = snapshot.deployments[name]
    instance = snapshot.instances.get(name)
    live = instance is not None and instance.state in LIVE_STATES
    if record.deleting:
        return "deleting"
    if record.stopped:
        return "stopping" if live else "stopped"
    if record.attempts.failed:
        return "failed"
    if live:
        assert instance is not None
        return str(instance.state)
    if name in snapshot.demands or record.inflight is not None:
        return "pending"
    if instance is not None and record.park_requested == instance.generation:
        return "parked"  # a restart_only park: the engine is stopped, a request cold-starts it
    if instance is not None and instance.state == S.STOPPED and instance.cache is not None:
        return "parked"  # the same, its LMCache server kept for the next start
    return "idle"


def summary(snapshot: Snapshot, name: str) -> DeploymentSummary:
    """A row of `list deployments`: NAME, STATE, READY, REVISION, HOSTS."""
    record = snapshot.deployments[name]
    instance = snapshot.instances.get(name)
    live = instance is not None and instance.state in LIVE_STATES
    return DeploymentSummary(
        name=name,
        state=state_of(snapshot, name),
        ready=f"{1 if instance and instance.state == S.READY else 0}/1",
        revision=record.revision,
        hosts=[instance.host] if live and instance else [],
        routes=list(record.document.routes),
        gpus=_gpus(snapshot, instance) if live and instance else [],
    )


def _gpus(snapshot: Snapshot, instance: InstanceRecord) -> list[str]:
    """The GPUs an instance runs on, by name where its host's reading names them."""
    view = snapshot.hosts.get(instance.host)
    place = view.place_of(instance) if view else None
    return list(gpusets.members(place)) if place else []


def detail(snapshot: Snapshot, name: str) -> DeploymentStatus:
    """Everything `status deployment NAME` shows."""
    record = snapshot.deployments[name]
    instance = snapshot.instances.get(name)
    instances = []
    if instance is not None:
        view = snapshot.hosts.get(instance.host)
        instances.append(
            InstanceView(
                index=instance.instance,
                host=instance.host,
                gpu=view.place_of(instance) if view else None,
                state=str(instance.state),
                since=instance.since,
                generation=instance.generation,
                revision=instance.revision,
                residency=instance.residency,
                port=instance.port,
                last_error=instance.error,
            )
        )
    return DeploymentStatus(
        **dict(summary(snapshot, name)),
        activation=record.activation,
        digest=record.digest,
        stopped=record.stopped,
        instances=instances,
        charges=_charges(snapshot, name),
        startup=_startup(snapshot, name),
        bindings=_bindings(snapshot, name),
        last_operation=_wire(Operation, record.last_operation),
        in_flight=_wire(InFlight, record.inflight),
        attempts=Attempts.model_validate(record.attempts, from_attributes=True),
        requests=_requests(snapshot, name),
        idle=_idle(snapshot, name),
        refusal=_wire(Refusal, record.refusal),
        demanded_since=snapshot.demands.get(name),
        placed=record.placed,
        document=record.document.model_dump(mode="json"),
    )


def _wire(model: type[W], found: BaseModel | None) -> W | None:
    """A part of a deployment record as the wire shows it."""
    return None if found is None else model.model_validate(found, from_attributes=True)


def _bindings(snapshot: Snapshot, name: str) -> list[Binding]:
    """Each host's resolution of the deployment, or its reason it cannot run it; only the
    fields that apply are set."""
    bindings = []
    for host, binding in sorted(snapshot.bindings.get(name, {}).items()):
        entry = Binding(host=host)
        if binding.error is not None:
            entry.error = BindingError(code=binding.error.code, message=binding.error.message)
        if (resolved := binding.resolved) is not None:
            entry.engine = resolved.profile.name
            entry.model_path = str(resolved.model_path)
            entry.weights_bytes = resolved.weights_bytes
            entry.residency = str(resolved.residency)
            entry.residency_reason = resolved.residency_reason
            entry.lmcache = resolved.cache_note + _cache_charge(resolved, binding.footprints)
        if host in snapshot.hosts:
            entry.deep_park = snapshot.hosts[host].deep_park
        bindings.append(entry)
    return bindings


def _cache_charge(resolved: Resolved, footprints: Mapping[str, Footprint]) -> str:
    """What its LMCache server is charged, and where each figure came from."""
    footprint = next(iter(footprints.values()), None)
    if resolved.cache is None or footprint is None or footprint.cache_provenance is None:
        return ""
    server = "measured" if footprint.cache_provenance == "measured" else "estimated"
    return (
        f"; charged the pool and the server's own memory in host RAM (the server's "
        f"{server}), and {format_size(lmcache.SERVER_DEVICE_ESTIMATE)} on its GPU (estimated)"
    )


def _idle(snapshot: Snapshot, name: str) -> Idle:
    """The idle timeouts in force, and the next idle step with its time, if one is due."""
    record = snapshot.deployments[name]
    instance = snapshot.instances.get(name)
    ready_after, parked_after = idle_timeouts(snapshot, record)
    step = next_idle_step(snapshot, record, instance) if instance is not None else None
    return Idle(
        ready_idle_timeout=ready_after,
        parked_idle_timeout=parked_after,
        protected=protected(record),
        next=None if step is None else IdleStep(action=step.kind, at=step.at),
    )


def _requests(snapshot: Snapshot, name: str) -> Requests:
    """The routers' places on the current generation, and how its cut requests settle."""
    held = snapshot.places.get(name)
    load = snapshot.loads.get(name)
    return Requests(
        running=held.running if held else 0,
        settle_when_idle=held.settle_when_idle if held else 0,
        settle_at_stop=held.settle_at_stop if held else 0,
        engine_running=load.running if load else 0,
        engine_waiting=load.waiting if load else 0,
    )


def _charges(snapshot: Snapshot, name: str) -> list[Charge]:
    """Each domain's charge, its phase, and where the figure came from."""
    instance = snapshot.instances.get(name)
    record = snapshot.deployments[name]
    rows = []
    for host in sorted(snapshot.hosts):
        charged = charges(snapshot, host).get(name)
        if not charged:
            continue
        view = snapshot.hosts[host]
        phase = PHASES.get(instance.state) if instance and instance.host == host else None
        effect = record.inflight
        gpu = view.place_of(instance) if instance and instance.host == host else None
        if phase is None and effect is not None:
            phase = "starting" if effect.kind == "launch" else "waking"
            gpu = effect.gpu
        footprint = footprint_of(snapshot, name, host, gpu) if gpu else None
        document = record.document
        declared = (
            document.resources is not None or document.engine_config.memory.request is not None
        )
        for domain, size in sorted(charged.items()):
            provenance = "unsized"  # an engine nobody can size holds its whole GPU
            if footprint is not None:
                if domain in ("system", "unified") and domain not in view.domains_of(gpu or ""):
                    provenance = footprint.host_provenance
                elif phase == "starting":
                    provenance = footprint.device_provenance
                elif phase == "parked":
                    provenance = "derived"  # what the engine's park leaves; nobody declares it
                else:
                    provenance = "declared" if declared else "derived"
            rows.append(
                Charge(host=host, domain=domain, phase=phase, bytes=size, provenance=provenance)
            )
    return rows


def _startup(snapshot: Snapshot, name: str) -> Startup | None:
    """The startup peak where the instance runs (else on the first GPU that could take it)."""
    instance = snapshot.instances.get(name)
    for host in sorted(snapshot.hosts):
        view = snapshot.hosts[host]
        bound = snapshot.bindings.get(name, {}).get(host)
        gpus = sorted(bound.footprints) if bound is not None else []
        if instance is not None and instance.host == host:
            gpu = view.place_of(instance)
            gpus = [gpu] if gpu else gpus
        for gpu in gpus:
            footprint = footprint_of(snapshot, name, host, gpu)
            if footprint is None:
                continue
            starting = footprint.charge("starting")
            return Startup(
                host=host,
                gpu=gpu,
                device_bytes=starting.get(view.domains_of(gpu)[0]),
                device_provenance=footprint.device_provenance,
                host_bytes=starting.get("system", starting.get("unified")),
                host_provenance=footprint.host_provenance,
            )
    return None


def gpus_of(reading: MemoryReading | None) -> list[HostGpu]:
    """A host's GPUs as its latest memory reading has them (none without one)."""
    return [
        HostGpu(
            name=f"gpu{g.index}",
            uuid=g.uuid,
            total=g.total_bytes,
            used=g.used_bytes,
            free=g.free_bytes,
            unified=g.unified,
        )
        for g in (reading.gpus if reading else [])
    ]


def host_rows(snapshot: Snapshot, readings: dict[str, MemoryReading | None]) -> list[HostRow]:
    """A row per host: whether it is observed, its domains with limits and charges."""
    rows = []
    for host, view in sorted(snapshot.hosts.items()):
        charged = charges(snapshot, host)
        domains = []
        for domain in view.domains.values():
            used = sum(c.get(domain.name, 0) for c in charged.values())
            domains.append(HostDomain(**asdict(domain), charged=used))
        reading = readings.get(host)
        state = "ready" if view.alive and view.domains else ("unobserved" if view.alive else "down")
        if view.revoked:
            state = "revoked"
        elif view.unreachable_since is not None:
            state = "unreachable"
        rows.append(
            HostRow(
                name=host,
                state=state,
                gpus=gpus_of(reading),
                domains=domains,
                joined=view.joined,
                drained=view.drained,
                unreachable_since=view.unreachable_since,
                capabilities=sorted(view.capabilities),
            )
        )
    return rows
