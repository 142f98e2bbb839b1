"""The routing table: routes, deployments and their instances, held in memory.

Requests never read Redis to find their engine. The table is filled at start, changed by the
notifications of the control plane and of each host (each names what to re-read), and read
in full again every few seconds and on every reconnect, since pub/sub loses messages while
disconnected. A full read takes many round trips, and notifications are applied meanwhile:
what a notification applied after the full read began is newer than what that read found,
so the read keeps it (a deployment created during a read is never dropped until the next).
Waiters for a deployment are woken whenever anything about it changes. A route the table does
not know is looked for again in Redis before a request for it is refused (`find`): a
deployment declared a moment before its request, whose notification has not come yet, is
served.

The notifications are read as they come, with no timeout to wake an idle worker: the full
read finds a host that joined, and the subscription is then made again with its channel.

An engine on the router's own host (a standalone role's) is reached on loopback, with its
key. One on a joined host is reached through that host's ingress (`capyctl_router.remote`):
the table keeps each joined host's ingress address, from its host info, and its id, from the
server's record of it, read in full and again when the host announces itself. An instance
on a joined host whose ingress is not known, or that the scheduler marked unreachable
(`capycommon.state.hostmarks`: its heartbeat lapsed, or it was revoked), is no target, as
one not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis.asyncio.client import PubSub

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.notifications import Notification
from capycommon.flight import Flight
from capycommon.service import REDIS_ERRORS, REDIS_OUTAGE, wait_event
from capycommon.state import notify, ownership
from capycommon.state.stores import State
from capycommon.tasks import beside, cancel_and_wait
from capyctl_router.remote import Ingress, ingress_of

RESYNC_S = 5.0


@dataclass(frozen=True)
class Target:
    """A ready engine to send a request to."""

    deployment: str
    host: str
    generation: int
    # The deployment's revision the instance runs (a request's cache_salt is digested with it).
    revision: int
    port: int
    # The engine's key; None behind an ingress, which adds it itself.
    secret: str | None
    family: str
    served_name: str
    # The engine's version, where its instance said it (an earlier hostd's instances do not).
    version: str | None = None
    # The host's ingress; None for an engine on the router's own host, dialed on loopback.
    ingress: Ingress | None = None
    # The engine runs with an LMCache server beside it.
    lmcache: bool = False
    # The request holds one of its worker's spare places (`capycommon.state.places`).
    spare: bool = False


@dataclass
class Table:
    state: State
    # Hosts whose instances are read; the control plane's `hosts` set adds to them. Those
    # given here are the router's own (`own`), whose engines it reaches on loopback.
    hosts: set[str]
    records: dict[str, DeploymentRecord] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)
    instances: dict[str, InstanceRecord] = field(default_factory=dict)
    secrets: dict[tuple[str, int], str] = field(default_factory=dict)
    # Each joined host's ingress, where it is known.
    ingresses: dict[str, Ingress] = field(default_factory=dict)
    # Joined hosts the scheduler marked unreachable (or revoked): nothing is sent there.
    unreachable: frozenset[str] = frozenset()
    _events: dict[str, asyncio.Event] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    # Told the name of every deployment that changed, as its waiters are woken.
    on_change: Callable[[str], None] | None = None
    # Set when a full read finds a host whose channel the subscription lacks.
    _joined: asyncio.Event = field(default_factory=asyncio.Event)
    # One per full read under way: the deployments and hosts notifications re-read since it
    # began (see `_Fresh`).
    _reads: list[_Fresh] = field(default_factory=list)
    # The deployments read again for requests whose route was not known (`find`): one read
    # for every request that missed meanwhile.
    _records_read: Flight[None] = field(init=False)
    own: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self._records_read = Flight(self._new_records)
        self.own = frozenset(self.hosts)

    # Reading --------------------------------------------------------------------------------

    def deployment_of(self, route: str) -> DeploymentRecord | None:
        name = self.routes.get(route)
        return None if name is None else self.records.get(name)

    async def find(self, route: str, since: float) -> DeploymentRecord | None:
        """The deployment serving a route the table did not know, looked for again in Redis
        by a read begun after `since` (when the request came, monotonic): one declared just
        before the request, whose notification has not come yet, is found, not refused."""
        await self._records_read.join(since)
        return self.deployment_of(route)

    def target(self, name: str) -> Target | None:
        """The deployment's instance when it is ready, with what it takes to reach it."""
        instance = self.instances.get(name)
        record = self.records.get(name)
        if instance is None or record is None or instance.state != InstanceState.READY:
            return None
        if instance.port is None:
            return None
        ingress = None
        if instance.host in self.own:
            secret = self.secrets.get((name, instance.generation))
            if secret is None:
                return None
        else:
            secret = None
            ingress = self.ingresses.get(instance.host)
            if ingress is None or instance.host in self.unreachable:
                return None
        return Target(
            deployment=name,
            host=instance.host,
            generation=instance.generation,
            revision=instance.revision,
            port=instance.port,
            secret=secret,
            family=instance.family or "vllm",
            version=instance.version,
            served_name=instance.served_name or record.document.routes[0],
            ingress=ingress,
            lmcache=instance.cache is not None,
        )

    def ready_at(self, name: str, generation: int) -> bool:
        """Whether the deployment's instance is ready at `generation`, as the table knows."""
        instance = self.instances.get(name)
        return (
            instance is not None
            and instance.state == InstanceState.READY
            and instance.generation == generation
        )

    def changed(self, name: str) -> asyncio.Event:
        """An event set at the next change of the deployment (or of its places)."""
        return self._events.setdefault(name, asyncio.Event())

    def wake(self, name: str) -> None:
        event = self._events.pop(name, None)
        if event is not None:
            event.set()
        if self.on_change is not None:
            self.on_change(name)

    # Keeping it current ---------------------------------------------------------------------

    async def sync(self) -> None:
        """Read everything again, keeping what notifications applied since the read began."""
        fresh = _Fresh()
        self._reads.append(fresh)
        try:
            await self._sync(fresh)
        finally:
            self._reads.remove(fresh)

    async def _sync(self, fresh: _Fresh) -> None:
        hosts = self.hosts | await self.state.host_info.hosts()
        records = await self.state.deployments.all()
        read: list[InstanceRecord] = []
        for host in sorted(hosts):
            read += await self.state.instances(host).all()
        instances, _ = ownership.owners(read, records)
        secrets = {}
        for name, instance in instances.items():
            if instance.state == InstanceState.READY and instance.host in self.own:
                secret = await self.state.instances(instance.host).secret(name, 0)
                if secret is not None:
                    secrets[(name, instance.generation)] = secret
        marks = await self.state.host_marks.get()
        ingresses = {}
        for host in sorted(hosts - self.own):
            found = await self._read_ingress(host)
            if found is not None:
                ingresses[host] = found
        unreachable = set(marks.unreachable)
        fresh.keep(self, records, instances, secrets, ingresses, unreachable)
        if hosts - self.hosts:
            self._joined.set()
        self.hosts = hosts
        self.records = records
        self.routes = _routes(records)
        before, reached = self.instances, self.ingresses
        self.instances = instances
        self.secrets = secrets
        self.ingresses = ingresses
        cut, self.unreachable = self.unreachable, frozenset(unreachable)
        moved = {h for h in set(reached) | set(ingresses) if reached.get(h) != ingresses.get(h)}
        moved |= cut ^ self.unreachable
        for name in set(before) | set(instances) | set(self._events):
            now = instances.get(name)
            if before.get(name) != now or name not in records or (now and now.host in moved):
                self.wake(name)
        self.synced.set()

    async def _new_records(self) -> None:
        """Add the deployments Redis holds that the table lacks, as their notifications
        would (one that came while this read was under way wins)."""
        reads = list(self._reads)  # those begun before it, which it is newer than
        fresh = _Fresh()
        self._reads.append(fresh)
        try:
            found = await self.state.deployments.all()
        finally:
            self._reads.remove(fresh)
        new = [name for name in found if name not in self.records and name not in fresh.records]
        for name in new:
            for other in reads:
                other.records.add(name)
            self.records[name] = found[name]
        if new:
            self.routes = _routes(self.records)

    async def _read_ingress(self, host: str) -> Ingress | None:
        info, identity = await asyncio.gather(
            self.state.host_info.get(host), self.state.identities.get(host)
        )
        return ingress_of(host, info, identity)

    async def _host(self, host: str) -> None:
        """A joined host announced itself (its hostd started), or the scheduler marked it
        (un)reachable: read its ingress and the marks again."""
        if host in self.own:
            return
        reads = list(self._reads)
        found, marks = await asyncio.gather(self._read_ingress(host), self.state.host_marks.get())
        for fresh in reads:
            fresh.hosts.add(host)
        cut = host in marks.unreachable
        if found == self.ingresses.get(host) and cut == (host in self.unreachable):
            return
        self.unreachable = frozenset(marks.unreachable)
        if found is None:
            self.ingresses.pop(host, None)
        else:
            self.ingresses[host] = found
        for name, instance in list(self.instances.items()):
            if instance.host == host:
                self.wake(name)

    async def _instance(self, host: str, member: str) -> None:
        deployment, _, index = member.rpartition(":")
        if index != "0":
            return
        store = self.state.instances(host)
        reads = list(self._reads)
        # Read together: a request waiting for a wake goes on once both are known. A joined
        # host's engine key stays with its ingress.
        if host in self.own:
            record, secret = await asyncio.gather(
                store.get(deployment, 0), store.secret(deployment, 0)
            )
        else:
            record, secret = await store.get(deployment, 0), None
        known = self.instances.get(deployment)
        if record is None or (known is not None and record.generation < known.generation):
            return
        if not await self._believed(record):
            return
        for fresh in reads:
            fresh.instances.add(deployment)
        if record.state == InstanceState.READY and secret is not None:
            self.secrets[(deployment, record.generation)] = secret
        self.instances[deployment] = record
        self.wake(deployment)

    async def _believed(self, record: InstanceRecord) -> bool:
        """Whether a record a host announced may be its deployment's instance, by the
        scheduler's choices (`capycommon.state.ownership`). A record ahead of the table's
        deployment is weighed against the deployment read again: the scheduler writes its
        choice before hostd can act on it, but its notification may still be on its way."""
        deployment = self.records.get(record.deployment)
        if deployment is not None and record.generation > deployment.generation:
            deployment = await self.state.deployments.get(record.deployment)
        if deployment is None:
            return False
        why = ownership.refusal(record, deployment)
        if why is not None:
            ownership.refuse(record, why)
        return why is None and ownership.candidate(record, deployment)

    async def _deployment(self, name: str) -> None:
        reads = list(self._reads)
        record = await self.state.deployments.get(name)
        for fresh in reads:
            fresh.records.add(name)
            if record is None:
                fresh.instances.add(name)
        if record is None:
            self.records.pop(name, None)
            self.instances.pop(name, None)
        else:
            self.records[name] = record
            instance = self.instances.get(name)
            if instance is not None and not ownership.candidate(instance, record):
                self.instances.pop(name)  # placed elsewhere now
        self.routes = _routes(self.records)
        self.wake(name)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the notifications; read everything again on (re)connect and every 5 s."""
        async with beside(self._resync(stop), "the routing table's full read"):
            while not stop.is_set():
                try:
                    await self._follow(stop)
                except REDIS_ERRORS as exc:
                    REDIS_OUTAGE.failed(exc)
                    await wait_event(stop, 1.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        """Subscribe, read everything, then follow the notifications until the stop, or until
        a host joined (the caller subscribes again, with its channel)."""
        channels = notify.channels(self.hosts)
        async with notify.subscribed(self.state.client, channels) as pubsub:
            self._joined.clear()
            await self.sync()
            REDIS_OUTAGE.ok()
            reading = asyncio.ensure_future(self._read(pubsub, channels))
            stopped = asyncio.ensure_future(stop.wait())
            joined = asyncio.ensure_future(self._joined.wait())
            try:
                await asyncio.wait([reading, stopped, joined], return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(reading, stopped, joined)
            if reading.done() and not reading.cancelled():
                reading.result()  # raises what ended the read (Redis: the caller retries)

    async def _read(self, pubsub: PubSub, channels: dict[str, str]) -> None:
        """Apply each notification as it comes."""
        async for message in pubsub.listen():
            if message.get("type") != "message":
                continue
            host = channels.get(_text(message["channel"]), "")
            try:
                note = Notification.model_validate_json(message["data"])
            except ValidationError:
                continue
            if note.kind == "instance" and host:
                await self._instance(host, note.id)
            elif note.kind == "host":
                # On a host's channel, the host itself; on the control plane's, a mark.
                await self._host(host or note.id)
            elif note.kind == "deployment":
                await self._deployment(note.id)

    async def _resync(self, stop: asyncio.Event) -> None:
        while not await wait_event(stop, RESYNC_S):
            with contextlib.suppress(*REDIS_ERRORS):
                await self.sync()
                await self.state.refusals.send()


@dataclass
class _Fresh:
    """What notifications re-read while one full read was under way: their reads began after
    it did, so what they applied is at least as new as what it found."""

    # Deployments whose record, and whose instance, a notification re-read.
    records: set[str] = field(default_factory=set)
    instances: set[str] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)

    def keep(
        self,
        table: Table,
        records: dict[str, DeploymentRecord],
        instances: dict[str, InstanceRecord],
        secrets: dict[tuple[str, int], str],
        ingresses: dict[str, Ingress],
        unreachable: set[str],
    ) -> None:
        """Put the table's newer facts into the full read's, in place."""
        for name in self.records:
            _take(records, table.records, name)
        for name in self.instances:
            _take(instances, table.instances, name)
        secrets.update(
            (key, value) for key, value in table.secrets.items() if key[0] in self.instances
        )
        for host in self.hosts:
            _take(ingresses, table.ingresses, host)
            if host in table.unreachable:
                unreachable.add(host)
            else:
                unreachable.discard(host)


def _take(into: dict[Any, Any], source: dict[Any, Any], key: object) -> None:
    if key in source:
        into[key] = source[key]
    else:
        into.pop(key, None)


def _routes(records: dict[str, DeploymentRecord]) -> dict[str, str]:
    """Each route and the deployment it names."""
    return {route: name for name, record in records.items() for route in record.document.routes}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
