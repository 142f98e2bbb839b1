"""Reading one Snapshot out of Redis: deployments, instances, readings, engines, loads.

Each deployment is bound to each host against what that host's hostd published: its engines,
its host info, and its models (`capycommon.state.hostfacts`). Nothing here reads a host's disk. A
model path a host has not described yet is asked for (`commands.Describe`, the whole list
the host's deployments name) and its binding waits, saying so, until the facts arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from capycommon.deployments import HostFacts, ModelNotDescribed, resolve
from capycommon.deployments.resolve import named_path
from capycommon.domain.commands import Describe, HubPull
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.hosts import (
    EngineLoad,
    HostIdentity,
    HostInfo,
)
from capycommon.domain.instances import LIVE_STATES, InstanceRecord
from capycommon.domain.memory import LINK_ORDER, Link, MemoryReading
from capycommon.domain.models import HostModels
from capycommon.domain.places import Places
from capycommon.engines.registry import EngineProfile, PublishedEngines
from capycommon.errors import CapyError, ProfileNotPublished
from capycommon.state import ownership
from capycommon.state.hostmarks import HostMarks
from capycommon.state.stores import State
from capyctl_scheduler.bindings import Bindings
from capyctl_scheduler.ledger import (
    SYSTEM,
    Domain,
    Limits,
    derive_domains,
)
from capyctl_scheduler.routedload import RoutedLoads
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot, Tunables


@dataclass(frozen=True)
class _HostRead:
    """What one snapshot read of one host."""

    host: str
    view: HostView
    records: list[InstanceRecord]
    # deployment -> its instance 0's engine load.
    loads: dict[str, EngineLoad]
    engines: PublishedEngines | None
    models: HostModels | None


# A Describe the host has not answered yet is sent again after this many seconds.
DESCRIBE_RESEND_S = 10.0
# How long declaring a deployment waits for a live host to describe its model.
DESCRIBE_WAIT_S = 5.0
DESCRIBE_POLL_S = 0.05
# A path asked for while declaring stays on the host's list this long, so the list the
# loop sends meanwhile (from the declared deployments) does not drop it.
ASKED_KEEP_S = 60.0


@dataclass
class Observer:
    state: State
    # The hosts it plans for: those it starts with (a standalone role's own host), and every
    # host in the control plane's set of hosts (those that joined a server), read anew with
    # each snapshot.
    hosts: Sequence[str]
    tunables: Tunables = field(default_factory=Tunables)
    system_limits: Limits = field(default_factory=Limits)
    gpu_limits: Limits = field(default_factory=Limits)
    # (host, model path) -> when declaring a deployment asked for it (monotonic).
    _asked: dict[tuple[str, str], float] = field(default_factory=dict)
    # host -> the last list of paths sent it to describe, and when (monotonic).
    _sent: dict[str, tuple[Describe, float]] = field(default_factory=dict)
    # The hosts whose facts still lack a path they were asked to describe.
    _undescribed: set[str] = field(default_factory=set)
    # The loads of engines CapyCTL reads no metrics from, from the routers' places.
    _routed: RoutedLoads = field(default_factory=RoutedLoads)

    def __post_init__(self) -> None:
        self._own = frozenset(self.hosts)
        self._bindings = Bindings(self.state, self._resolve)

    async def known_hosts(self) -> list[str]:
        """The hosts it plans for now (kept in `hosts`)."""
        self.hosts = sorted(self._own | await self.state.host_info.hosts())
        return list(self.hosts)

    @property
    def describing(self) -> bool:
        """Whether a host has yet to describe a path it was sent (the loop sends it again
        after DESCRIBE_RESEND_S)."""
        return bool(self._undescribed)

    async def snapshot(
        self,
        demands: Mapping[str, float] | None = None,
        refused: frozenset[tuple[str, int]] = frozenset(),
        now: float | None = None,
        restarts: Mapping[str, int] | None = None,
    ) -> Snapshot:
        now = time.time() if now is None else now
        deployments, reads = await self._read(now)
        hosts = {read.host: read.view for read in reads}
        for read in reads:
            await self._ask(read.host, read.models, _paths(deployments.values()))
        lost_after = self.tunables.host_lost_after_s
        records = [record for read in reads for record in read.records]
        stranded = [r for r in records if hosts[r.host].gone(now, lost_after)]
        records = [r for r in records if not hosts[r.host].gone(now, lost_after)]
        instances, orphans = ownership.owners(records, deployments)
        loads = {name: found for read in reads for name, found in read.loads.items()}
        held, bindings = await self._places_and_bindings(deployments, instances, reads)
        loads.update(self._routed.loads(now, instances, held, bindings))
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
            stranded=tuple(r for r in stranded if r.state in LIVE_STATES),
            tunables=self.tunables,
        )

    async def _read(self, now: float) -> tuple[dict[str, DeploymentRecord], list[_HostRead]]:
        """The deployments and what is read of each host it plans for, by host name."""
        # The reads are independent: sent together, they wait on Redis once, not in turn. The
        # hosts read are those of the last snapshot; a host that joined since is read after.
        marks = asyncio.ensure_future(self.state.host_marks.get())
        previous = list(self.hosts)
        known, deployments, reads = await asyncio.gather(
            self.known_hosts(),
            self.state.deployments.all(),
            asyncio.gather(*(self._host_reads(host, now, marks) for host in previous)),
        )
        joined = [host for host in known if host not in previous]
        if joined:
            reads += await asyncio.gather(*(self._host_reads(host, now, marks) for host in joined))
        await marks  # read even with no host to view (its failure is this snapshot's)
        return deployments, sorted((r for r in reads if r.host in known), key=lambda r: r.host)

    async def _places_and_bindings(
        self,
        deployments: Mapping[str, DeploymentRecord],
        instances: Mapping[str, InstanceRecord],
        reads: Sequence[_HostRead],
    ) -> tuple[dict[str, Places], dict[str, dict[str, Binding]]]:
        """The request places of each instance, and each deployment bound to each host."""
        names = list(instances)
        found_places, bindings = await asyncio.gather(
            asyncio.gather(*(self.state.places.get(name) for name in names)),
            self._bindings.of(deployments, reads),
        )
        return dict(zip(names, found_places, strict=True)), bindings

    async def _host_reads(self, host: str, now: float, marks: Awaitable[HostMarks]) -> _HostRead:
        """What a snapshot reads of one host, read together."""
        (reading, records, loads, engines, models), (alive, info, identity) = await asyncio.gather(
            asyncio.gather(
                self.state.memory.reading(host),
                self.state.instances(host).all(),
                self.state.loads.get(host),
                self.engines(host),
                self.state.host_models.get(host),
            ),
            asyncio.gather(
                self.state.heartbeats.alive("hostd", host),
                self.state.host_info.get(host),
                self._identity(host),
            ),
        )
        view = self._view(host, reading, alive, info, now, identity, await marks)
        # Each deployment's engine load is its instance 0's (members are `<deployment>:<i>`).
        zero = {m.rpartition(":")[0]: found for m, found in loads.items() if m.endswith(":0")}
        return _HostRead(host, view, records, zero, engines, models)

    async def _identity(self, host: str) -> HostIdentity | None:
        """A joined host's identity; None for the role's own host."""
        return None if host in self._own else await self.state.identities.get(host)

    async def bindings_of(self, record: DeploymentRecord) -> dict[str, Binding]:
        """How a deployment would run on each host, resolved now. A live host that has not
        described the deployment's model is asked to, and waited for a few seconds."""
        path = record.document.model.path
        deadline = time.monotonic() + DESCRIBE_WAIT_S
        found = await self._bindings_now(record)
        while path is not None and time.monotonic() < deadline:
            waiting = [
                host
                for host, (view, binding) in found.items()
                if binding.waiting is not None and view.alive
            ]
            if not waiting:
                break
            declared = _paths((await self.state.deployments.all()).values())
            for host in waiting:
                self._asked[(host, path)] = time.monotonic()
                await self._ask(host, await self.state.host_models.get(host), declared)
            await asyncio.sleep(DESCRIBE_POLL_S)
            found = await self._bindings_now(record)
        return {host: binding for host, (_, binding) in found.items()}

    async def _bindings_now(self, record: DeploymentRecord) -> dict[str, tuple[HostView, Binding]]:
        now = time.time()
        found = {}
        marks = await self.state.host_marks.get()
        for host in await self.known_hosts():
            view = await self._host(host, await self.state.memory.reading(host), now, marks)
            models = await self.state.host_models.get(host)
            found[host] = (
                view,
                self._resolve(record, host, view, await self.engines(host), models),
            )
        return found

    async def engines(self, host: str) -> PublishedEngines | None:
        return await self.state.engines.get(host)

    async def _host(
        self, host: str, reading: MemoryReading | None, now: float, marks: HostMarks
    ) -> HostView:
        alive, info, identity = await asyncio.gather(
            self.state.heartbeats.alive("hostd", host),
            self.state.host_info.get(host),
            self._identity(host),
        )
        return self._view(host, reading, alive, info, now, identity, marks)

    def _view(
        self,
        host: str,
        reading: MemoryReading | None,
        alive: bool,
        info: HostInfo | None,
        now: float,
        identity: HostIdentity | None,
        marks: HostMarks,
    ) -> HostView:
        info = info or HostInfo()
        empty = HostView(
            host,
            {},
            {},
            unified=False,
            alive=alive,
            deep_park=info.deep_park,
            lmcache=info.lmcache,
            retention_zero=info.retention_zero,
            joined=identity is not None,
            unreachable_since=marks.unreachable.get(host) if identity is not None else None,
            revoked=identity is not None and identity.revoked_at is not None,
            drained=host in marks.drained,
            version=info.version,
            capabilities=frozenset(info.capabilities),
        )
        if reading is None:
            return empty
        gpus = {f"gpu{gpu.index}": gpu.uuid for gpu in reading.gpus}
        unified = any(gpu.unified for gpu in reading.gpus)
        domains: dict[str, Domain] = {}
        if reading.is_fresh(now):
            found = derive_domains(reading, self.system_limits, self.gpu_limits)
            domains = {domain.name: domain for domain in found}
        links = _links(reading)
        return replace(empty, domains=domains, gpus=gpus, unified=unified, links=links)

    def _resolve(
        self,
        record: DeploymentRecord,
        host: str,
        view: HostView,
        engines: PublishedEngines | None,
        models: HostModels | None,
    ) -> Binding:
        if engines is None:
            return _unpublished(host)
        if models is None:
            return Binding(host, waiting=f"host {host} has not published its models yet")
        profiles: dict[str, EngineProfile] = {p.name: p for p in engines.profiles}
        system = view.domains.get(SYSTEM)
        facts = HostFacts(
            unified=view.unified,
            parked_room=min(system.parked_limit, system.managed_limit) if system else None,
            gpus=tuple(sorted(view.gpus)),
            deep_park=view.deep_park,
            lmcache=view.lmcache,
            retention_zero=view.retention_zero,
        )
        try:
            resolved = resolve(record.document, profiles=profiles, models=models, host=facts)
        except ModelNotDescribed as exc:
            return Binding(host, waiting=f"host {host} has not described model {exc.path} yet")
        except CapyError as exc:
            return Binding(host, error=exc)
        return Binding(host, resolved)

    async def _ask(
        self,
        host: str,
        models: HostModels | None,
        declared: Mapping[str, HubPull | None],
    ) -> None:
        """Send the host the paths it must describe (those the root's listing lacks), with
        the Hub sources among them, when that differs from what it describes and was not
        just sent."""
        now = time.monotonic()
        self._asked = {key: at for key, at in self._asked.items() if now - at < ASKED_KEEP_S}
        named = {*declared, *(path for where, path in self._asked if where == host)}
        paths = tuple(sorted(p for p in named if models is None or not models.listed(p)))
        sources = {p: s for p in paths if (s := declared.get(p)) is not None}
        wanted = Describe(paths=paths, sources=sources)
        described = (
            Describe(paths=tuple(sorted(models.described)), sources=models.sources)
            if models is not None
            else None
        )
        sent = self._sent.get(host)
        just_sent = sent is not None and sent[0] == wanted and now - sent[1] < DESCRIBE_RESEND_S
        if wanted == described:
            self._undescribed.discard(host)
            return
        self._undescribed.add(host)
        if just_sent:
            return
        await self.state.commands.send(host, wanted)
        self._sent[host] = (wanted, now)


def _paths(records: Iterable[DeploymentRecord]) -> dict[str, HubPull | None]:
    """The model paths the deployments name (a folder, or a pinned Hugging Face source's
    store under the models root), each with its Hub source if it has one."""
    named: dict[str, HubPull | None] = {}
    for record in records:
        model = record.document.model
        path = named_path(model)
        if path is not None:
            named[path] = named.get(path) or HubPull.of(model)
    return named


def _links(reading: MemoryReading) -> dict[frozenset[str], Link]:
    """How pairs of the reading's GPUs connect, by GPU name; a link the two ends name
    differently (a reading not to be trusted) counts as the looser."""
    names = {gpu.uuid: f"gpu{gpu.index}" for gpu in reading.gpus}
    found: dict[frozenset[str], Link] = {}
    for gpu in reading.gpus:
        for uuid, link in gpu.links.items():
            other = names.get(uuid)
            if other is None or other == names[gpu.uuid]:
                continue
            pair = frozenset((names[gpu.uuid], other))
            known = found.get(pair)
            if known is None or LINK_ORDER.index(link) > LINK_ORDER.index(known):
                found[pair] = link
    return found


def _unpublished(host: str) -> Binding:
    return Binding(
        host,
        error=ProfileNotPublished(
            f"host {host} has published no engines; register one there with capyctl engine add"
        ),
    )
