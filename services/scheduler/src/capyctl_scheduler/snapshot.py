"""What the scheduler decides from: one coherent view of Redis and the clock, as values.

`observe.py` builds a Snapshot; `policy.plan` reads it and nothing else, so every plan
can be replayed in a unit test with an injected clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from capycommon.deployments import Resolved
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.hosts import HOST_CAPABILITIES, EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import Link
from capycommon.domain.places import Places
from capycommon.errors import CapyError
from capyctl_scheduler import gpusets
from capyctl_scheduler.ledger import Domain, Footprint


@dataclass(frozen=True)
class Tunables:
    """The scheduler's own settings."""

    drain_timeout_s: float = 30.0
    # How long a command may wait for hostd to take it up before it is planned again.
    command_timeout_s: float = 120.0
    # How long memwatch has to show a park's memory released (hostd then stops it).
    park_verify_s: float = 15.0
    # The most instances one host keeps parked; the least recently used beyond it stop.
    max_parked: int = 8
    # An idle ready model parks after this, a parked one stops after that (None: never),
    # unless its deployment says otherwise.
    ready_idle_s: float | None = 300.0
    parked_idle_s: float | None = 1800.0
    # How long a demand waits at most (the standalone request deadline).
    demand_deadline_s: float = 1800.0
    start_deadline_s: float = 1800.0
    wake_deadline_s: float = 900.0
    # How long a joined host may stay unreachable before its deployments that may run
    # elsewhere start elsewhere (its instances count as gone from then on).
    host_lost_after_s: float = 30.0


@dataclass(frozen=True)
class HostView:
    """One host as the scheduler sees it. `domains` is empty while its reading is stale."""

    name: str
    domains: Mapping[str, Domain]
    # gpu0 -> the GPU's UUID, from the host's latest reading.
    gpus: Mapping[str, str]
    unified: bool
    alive: bool = True
    # False where the host has deep parking off (host.deep_park: off, from its hostd).
    deep_park: bool = True
    # False where LMCache is off on the host (host.lmcache: off); True where its retention is
    # zero (the default of its deployments).
    lmcache: bool = True
    retention_zero: bool = False
    # A host that joined a server (its own machine, reached through its ingress), not the
    # standalone role's own host.
    joined: bool = False
    # Since when a joined host is unreachable (its hostd's heartbeat lapsed); None if it is not.
    unreachable_since: float | None = None
    revoked: bool = False
    # Drained by an operator: nothing new is placed there.
    drained: bool = False
    # Its hostd's release and what it can do (`HostInfo`); a host of an earlier release
    # names fewer capabilities, or none.
    version: str | None = None
    capabilities: frozenset[str] = frozenset(HOST_CAPABILITIES)
    # How pairs of its GPUs connect (by GPU name), from its reading; empty: unknown.
    links: Mapping[frozenset[str], Link] = field(default_factory=dict)

    @property
    def reachable(self) -> bool:
        """Whether commands and requests can reach it. A standalone role's own host always
        can: its engines run on this machine and outlive a hostd restart."""
        return not self.revoked and self.unreachable_since is None

    def gone(self, now: float, lost_after_s: float) -> bool:
        """Revoked, or unreachable for longer than `lost_after_s`: its instances no longer
        count as their deployments' (those start elsewhere where they may)."""
        if self.revoked:
            return True
        return self.unreachable_since is not None and now - self.unreachable_since >= lost_after_s

    def why_not_reachable(self, now: float) -> str:
        if self.revoked:
            return f"host {self.name} was revoked"
        since = now - (self.unreachable_since or now)
        return f"host {self.name} is unreachable (no heartbeat for {since:.0f}s)"

    @cached_property
    def gpu_domains(self) -> list[tuple[str, str]]:
        """Each GPU's name, sorted (gpu0, gpu1, ...), with its ledger domain."""
        return [(gpu, self.domain_of(gpu)) for gpu in sorted(self.gpus, key=gpusets.index)]

    def gpu_of(self, uuid: str | None) -> str | None:
        return self._gpu_names.get(uuid) if uuid is not None else None

    def place_of(self, instance: InstanceRecord) -> str | None:
        """The GPU set an instance runs on (`gpu1`, `gpu0+gpu1`); None while any of its GPUs
        is unknown here (no reading names it)."""
        if not instance.gpu_uuids:  # one GPU, as most run
            return self.gpu_of(instance.gpu_uuid)
        names = [self.gpu_of(uuid) for uuid in instance.gpu_uuids]
        if not names or any(name is None for name in names):
            return None
        return gpusets.key(name for name in names if name is not None)

    def domains_of(self, place: str) -> list[str]:
        """The ledger domains that hold a GPU set's memory: each GPU's, or the unified pool."""
        return list(dict.fromkeys(self.domain_of(gpu) for gpu in gpusets.members(place)))

    def uuids_of(self, place: str) -> tuple[str, ...]:
        """The UUIDs of a GPU set's GPUs, in rank order."""
        return tuple(self.gpus[gpu] for gpu in gpusets.members(place))

    @cached_property
    def _gpu_names(self) -> Mapping[str, str]:
        """UUID -> GPU name (the first, should a reading repeat a UUID)."""
        names: dict[str, str] = {}
        for name, uuid in self.gpus.items():
            names.setdefault(uuid, name)
        return names

    def domain_of(self, gpu: str) -> str:
        """The ledger domain that holds a GPU's memory: the GPU's, or the unified pool."""
        return "unified" if self.unified else gpu


@dataclass(frozen=True)
class Binding:
    """A deployment as it would run on one host, or why it cannot run there."""

    host: str
    resolved: Resolved | None = None
    # By GPU set (gpu0, or gpu0+gpu1 for a model across two; `gpusets`): what the deployment
    # is charged there, per phase.
    footprints: Mapping[str, Footprint] = field(default_factory=dict)
    error: CapyError | None = None
    # Why it is not known yet (the host has not described the model): it waits, refusing
    # nothing.
    waiting: str | None = None


@dataclass(frozen=True)
class Snapshot:
    now: float
    deployments: Mapping[str, DeploymentRecord]
    # Each deployment's instance 0: its record of the highest generation on any host.
    instances: Mapping[str, InstanceRecord]
    hosts: Mapping[str, HostView]
    # deployment -> host -> binding.
    bindings: Mapping[str, Mapping[str, Binding]]
    # deployment -> its engine's load (instance 0), from hostd.
    loads: Mapping[str, EngineLoad] = field(default_factory=dict)
    # deployment -> when its oldest open demand came.
    demands: Mapping[str, float] = field(default_factory=dict)
    # deployment -> the generation to restart: cut requests hold all its places.
    restarts: Mapping[str, int] = field(default_factory=dict)
    # deployment -> the request places of its instance's generation (routers').
    places: Mapping[str, Places] = field(default_factory=dict)
    # (deployment, generation) of the effects in flight whose command hostd refused.
    refused: frozenset[tuple[str, int]] = frozenset()
    # Live instances nobody owns: their deployment is gone, or a newer generation runs.
    orphans: tuple[InstanceRecord, ...] = ()
    # Instances on hosts that are gone (revoked, or unreachable past the grace): unknown, so
    # never counted as stopped, and counted for no deployment.
    stranded: tuple[InstanceRecord, ...] = ()
    tunables: Tunables = Tunables()

    # Views a plan asks for many times, each derived once from the values above (a plan of
    # many deployments on many hosts would otherwise walk every instance for each of them).

    @cached_property
    def on_host(self) -> Mapping[str, Mapping[str, InstanceRecord]]:
        """host -> its instances, by deployment (in the order of `instances`)."""
        found: dict[str, dict[str, InstanceRecord]] = {}
        for name, instance in self.instances.items():
            found.setdefault(instance.host, {})[name] = instance
        return found

    @cached_property
    def parked(self) -> Mapping[str, Mapping[str, InstanceRecord]]:
        """host -> its parked instances, by deployment (in the order of `instances`)."""
        return {
            host: {n: i for n, i in found.items() if i.state == InstanceState.PARKED}
            for host, found in self.on_host.items()
        }

    @cached_property
    def starting(self) -> dict[tuple[str, str], str]:
        """(host, ledger domain) -> the deployment starting there: the first instance in
        `starting`, else the first launch in flight (starts are one at a time per GPU). A plan
        adds each start it decides, to its own copy of the snapshot."""
        found: dict[tuple[str, str], str] = {}
        for name, instance in self.instances.items():
            view = self.hosts.get(instance.host)
            if view is None or instance.state != InstanceState.STARTING:
                continue
            place = view.place_of(instance)
            for domain in view.domains_of(place) if place is not None else ():
                found.setdefault((instance.host, domain), name)
        for name, record in self.deployments.items():
            effect = record.inflight
            if effect is None or effect.kind != "launch" or effect.host not in self.hosts:
                continue
            for domain in self.hosts[effect.host].domains_of(effect.gpu):
                found.setdefault((effect.host, domain), name)
        return found
