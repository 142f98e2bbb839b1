"""Reading one Snapshot out of Redis: deployments, instances, readings, engines, loads.

Binding a deployment to a host (its engine, its model folder, its park tier) looks at the
filesystem, so bindings are kept for a few seconds per document revision and host.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from capycommon import hostinfo, keys, load, places
from capycommon.deployments import HostFacts, resolve
from capycommon.desired import DeploymentRecord, DeploymentStore
from capycommon.engines.launch import Residency
from capycommon.engines.publish import PublishedEngines
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError, ProfileNotPublished
from capycommon.instances import LIVE_STATES, InstanceRecord
from capycommon.memory import MemoryReading, aread_reading, aread_startup_peak
from capycommon.store import InstanceStore
from capyctl_scheduler.ledger import (
    SYSTEM,
    Domain,
    Footprint,
    Limits,
    Provenance,
    derive_discrete,
    derive_domains,
    derive_unified,
)
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot, Tunables

BINDING_TTL_S = 10.0


@dataclass
class Observer:
    client: aioredis.Redis
    # host name -> its models root (the scheduler of a standalone role knows its one host).
    models_roots: Mapping[str, Path]
    tunables: Tunables = field(default_factory=Tunables)
    system_limits: Limits = field(default_factory=Limits)
    gpu_limits: Limits = field(default_factory=Limits)
    _resolved: dict[tuple[str, str, str, int, bool], tuple[float, Binding]] = field(
        default_factory=dict
    )

    async def snapshot(
        self,
        demands: Mapping[str, float] | None = None,
        refused: frozenset[tuple[str, int]] = frozenset(),
        now: float | None = None,
        restarts: Mapping[str, int] | None = None,
    ) -> Snapshot:
        now = time.time() if now is None else now
        deployments = await DeploymentStore(self.client).all()
        hosts: dict[str, HostView] = {}
        records: list[InstanceRecord] = []
        loads: dict[str, load.EngineLoad] = {}
        engines: dict[str, PublishedEngines | None] = {}
        for host in sorted(self.models_roots):
            hosts[host] = await self._host(host, await aread_reading(self.client, host), now)
            records += await InstanceStore(self.client, host).all()
            for member, found in (await load.aread_loads(self.client, host)).items():
                deployment, _, index = member.rpartition(":")
                if index == "0":
                    loads[deployment] = found
            engines[host] = await self.engines(host)
        instances, orphans = _owners(records, deployments)
        held = {name: await places.aread(self.client, name) for name in instances}
        bindings = {
            name: {
                host: await self._binding(record, host, hosts[host], engines[host])
                for host in hosts
            }
            for name, record in deployments.items()
        }
        return Snapshot(
            now=now,
            deployments=deployments,
            instances=instances,
            hosts=hosts,
            bindings=bindings,
            loads={name: found for name, found in loads.items() if name in instances},
            demands=dict(demands or {}),
            restarts=dict(restarts or {}),
            places={n: p for n, p in held.items() if p.generation == instances[n].generation},
            refused=refused,
            orphans=tuple(orphans),
            tunables=self.tunables,
        )

    async def bindings_of(self, record: DeploymentRecord) -> dict[str, Binding]:
        """How a deployment would run on each host, resolved now (nothing cached)."""
        now = time.time()
        found = {}
        for host in sorted(self.models_roots):
            reading = await aread_reading(self.client, host)
            view = await self._host(host, reading, now)
            engines = await self.engines(host)
            found[host] = (
                self._resolve(record, host, view, engines)
                if engines is not None
                else _unpublished(host)
            )
        return found

    async def engines(self, host: str) -> PublishedEngines | None:
        raw = await self.client.get(keys.engines(host))
        return None if raw is None else PublishedEngines.model_validate_json(raw)

    async def _host(self, host: str, reading: MemoryReading | None, now: float) -> HostView:
        alive = await self.client.exists(keys.heartbeat("hostd", host)) > 0
        info = await hostinfo.aread(self.client, host)
        deep_park = info.deep_park if info is not None else True
        if reading is None:
            return HostView(host, {}, {}, unified=False, alive=alive, deep_park=deep_park)
        gpus = {f"gpu{gpu.index}": gpu.uuid for gpu in reading.gpus}
        unified = any(gpu.unified for gpu in reading.gpus)
        domains: dict[str, Domain] = {}
        if reading.is_fresh(now):
            found = derive_domains(reading, self.system_limits, self.gpu_limits)
            domains = {domain.name: domain for domain in found}
        return HostView(host, domains, gpus, unified=unified, alive=alive, deep_park=deep_park)

    async def _binding(
        self,
        record: DeploymentRecord,
        host: str,
        view: HostView,
        engines: PublishedEngines | None,
    ) -> Binding:
        if engines is None:
            return _unpublished(host)
        cache_key = (record.name, record.digest, host, engines.revision, view.deep_park)
        cached = self._resolved.get(cache_key)
        now = time.monotonic()
        if cached is None or now - cached[0] > BINDING_TTL_S:
            cached = (now, self._resolve(record, host, view, engines))
            self._resolved[cache_key] = cached
        binding = cached[1]
        if binding.resolved is None or not view.domains:
            return binding
        return Binding(host, binding.resolved, await self._footprints(record, host, view, binding))

    def _resolve(
        self,
        record: DeploymentRecord,
        host: str,
        view: HostView,
        engines: PublishedEngines,
    ) -> Binding:
        profiles: dict[str, EngineProfile] = {p.name: p for p in engines.profiles}
        system = view.domains.get(SYSTEM)
        facts = HostFacts(
            unified=view.unified,
            parked_room=min(system.parked_limit, system.managed_limit) if system else None,
            gpus=tuple(sorted(view.gpus)),
            deep_park=view.deep_park,
        )
        try:
            resolved = resolve(
                record.document, profiles=profiles, models_root=self.models_roots[host],
                host=facts,
            )  # fmt: skip
        except CapyError as exc:
            return Binding(host, error=exc)
        return Binding(host, resolved)

    async def _footprints(
        self, record: DeploymentRecord, host: str, view: HostView, binding: Binding
    ) -> dict[str, Footprint]:
        resolved = binding.resolved
        assert resolved is not None
        memory = record.document.engine_config.memory
        peak = await aread_startup_peak(
            self.client, host, record.name, record.revision, resolved.profile.fingerprint
        )
        startup: tuple[int, Provenance] | None = None
        startup_host: tuple[int, Provenance] | None = None
        if memory.startup is not None:
            startup = (memory.startup, "declared")
        elif peak is not None:
            startup = (peak.device_bytes, "measured")
        if peak is not None:
            startup_host = (peak.host_bytes, "measured")
        weights = resolved.weights_bytes or 0
        if view.unified:
            pool = view.domains["unified"]
            footprint = derive_unified(
                weights=weights, domain=pool, request=memory.request,
                kv_cache=memory.kv_cache, startup=startup,
            )  # fmt: skip
            return dict.fromkeys(view.gpus, footprint)
        return {
            gpu: derive_discrete(
                gpu=gpu, weights=weights, device=view.domains[gpu],
                host_backed=resolved.residency == Residency.HOST_BACKED,
                request=memory.request, kv_cache=memory.kv_cache, startup=startup,
                startup_host=startup_host,
            )
            for gpu in view.gpus
            if gpu in view.domains
        }  # fmt: skip


def _unpublished(host: str) -> Binding:
    return Binding(
        host,
        error=ProfileNotPublished(
            f"host {host} has published no engines; register one there with capyctl engine add"
        ),
    )


def _owners(
    records: list[InstanceRecord], deployments: Mapping[str, DeploymentRecord]
) -> tuple[dict[str, InstanceRecord], list[InstanceRecord]]:
    """Each deployment's instance 0 (the highest generation on any host), and the live
    instances nobody owns: a deleted deployment's, or an older generation still running."""
    instances: dict[str, InstanceRecord] = {}
    orphans: list[InstanceRecord] = []
    for record in sorted(records, key=lambda r: -r.generation):
        owned = record.deployment in deployments and record.instance == 0
        if owned and record.deployment not in instances:
            instances[record.deployment] = record
        elif record.state in LIVE_STATES:
            orphans.append(record)
    return instances, orphans
