"""The state layer's one shape: a store per record type, each with one async interface,
built once per service as a `State` over its Redis client.

A caller with no event loop of its own (the CLI) reads and writes through `Blocking`, which
runs one store call at a time on a loop it keeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from functools import cached_property
from typing import Any, TypeVar

import redis.asyncio as aioredis

from capycommon.state.acl import HostUserStore
from capycommon.state.desired import ChoiceStore, DemandStore, DeploymentStore
from capycommon.state.downloads import DownloadStore
from capycommon.state.enginefacts import EngineFactsStore
from capycommon.state.enginelogs import EngineLogStore
from capycommon.state.gpumemory import GpuMemoryStore
from capycommon.state.heartbeats import HeartbeatStore
from capycommon.state.hostcommands import HostCommandStore
from capycommon.state.hostfacts import HostModelsStore
from capycommon.state.hostinfo import HostInfoStore
from capycommon.state.hostkeys import HostKeyStore
from capycommon.state.hostmarks import HostMarkStore
from capycommon.state.idempotency import Answers
from capycommon.state.identities import IdentityStore
from capycommon.state.leader import LeaderStore
from capycommon.state.load import LoadStore
from capycommon.state.memory import MemoryStore
from capycommon.state.pagesessions import PageSessions
from capycommon.state.persistence import Persistence
from capycommon.state.places import PlaceStore
from capycommon.state.refusals import RefusalStore
from capycommon.state.replicas import ReplicaStore
from capycommon.state.settlement import SettlementStore
from capycommon.state.store import EventStore, InstanceStore
from capycommon.state.topology import TopologyStore

T = TypeVar("T")


class State:
    """Every store over one client; a store is built the first time it is asked for and
    kept, so a service builds each once. The client stays reachable for the layer's own
    infrastructure (scripts, streams, subscriptions)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._instances: dict[str, InstanceStore] = {}

    def instances(self, host: str) -> InstanceStore:
        """The instance records of `host` (hostd's own, or a host the scheduler reads)."""
        store = self._instances.get(host)
        if store is None:
            store = self._instances[host] = InstanceStore(self.client, host)
        return store

    @cached_property
    def answers(self) -> Answers:
        """The management API's idempotency keys."""
        return Answers(self.client)

    @cached_property
    def choices(self) -> ChoiceStore:
        """The scheduler's choices."""
        return ChoiceStore(self.client)

    @cached_property
    def commands(self) -> HostCommandStore:
        """Each host's command stream."""
        return HostCommandStore(self.client)

    @cached_property
    def replicas(self) -> ReplicaStore:
        """The primary's replicas: a write confirmed on one, and how far each lags."""
        return ReplicaStore(self.client)

    @cached_property
    def topology(self) -> TopologyStore:
        """Where the servers' Sentinels are, for the hosts."""
        return TopologyStore(self.client)

    @cached_property
    def leader(self) -> LeaderStore:
        """The scheduler lease and its fencing epoch."""
        return LeaderStore(self.client)

    @cached_property
    def demands(self) -> DemandStore:
        """The routers' demands for deployments."""
        return DemandStore(self.client)

    @cached_property
    def deployments(self) -> DeploymentStore:
        """The declared deployments."""
        return DeploymentStore(self.client)

    @cached_property
    def downloads(self) -> DownloadStore:
        """Model downloads and store operations."""
        return DownloadStore(self.client)

    @cached_property
    def engine_logs(self) -> EngineLogStore:
        """Engine log tails."""
        return EngineLogStore(self.client)

    @cached_property
    def engines(self) -> EngineFactsStore:
        """Each host's published engines."""
        return EngineFactsStore(self.client)

    @cached_property
    def events(self) -> EventStore:
        """Each host's events."""
        return EventStore(self.client)

    @cached_property
    def gpu_memory(self) -> GpuMemoryStore:
        """The charges on each GPU."""
        return GpuMemoryStore(self.client)

    @cached_property
    def heartbeats(self) -> HeartbeatStore:
        """Services' heartbeats."""
        return HeartbeatStore(self.client)

    @cached_property
    def host_info(self) -> HostInfoStore:
        """What each host says of itself; the joined hosts."""
        return HostInfoStore(self.client)

    @cached_property
    def host_keys(self) -> HostKeyStore:
        """A joined host's keys."""
        return HostKeyStore(self.client)

    @cached_property
    def host_marks(self) -> HostMarkStore:
        """Unreachable and drained hosts."""
        return HostMarkStore(self.client)

    @cached_property
    def host_models(self) -> HostModelsStore:
        """Each host's models."""
        return HostModelsStore(self.client)

    @cached_property
    def host_users(self) -> HostUserStore:
        """The hosts' Redis users."""
        return HostUserStore(self.client)

    @cached_property
    def identities(self) -> IdentityStore:
        """Invitations, identities, certificates."""
        return IdentityStore(self.client)

    @cached_property
    def loads(self) -> LoadStore:
        """Each host's engine loads."""
        return LoadStore(self.client)

    @cached_property
    def memory(self) -> MemoryStore:
        """Memory readings and startup peaks."""
        return MemoryStore(self.client)

    @cached_property
    def page_sessions(self) -> PageSessions:
        """The status page's sessions."""
        return PageSessions(self.client)

    @cached_property
    def persistence(self) -> Persistence:
        """Whether Redis can save."""
        return Persistence(self.client)

    @cached_property
    def places(self) -> PlaceStore:
        """Places and waiting requests, over all workers."""
        return PlaceStore(self.client)

    @cached_property
    def refusals(self) -> RefusalStore:
        """The control plane's counts of refused values."""
        return RefusalStore(self.client)

    @cached_property
    def settlement(self) -> SettlementStore:
        """Each host's proven request ends."""
        return SettlementStore(self.client)


class Blocking:
    """The stores for a caller without an event loop: `blocking(lambda s: s.x.y(...))` runs
    that call to its end and returns its value. Close it when done (or use it in `with`)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._runner = asyncio.Runner()
        self.state = State(client)

    def __call__(self, call: Callable[[State], Coroutine[Any, Any, T]]) -> T:
        return self._runner.run(call(self.state))

    def close(self) -> None:
        try:
            self._runner.run(self.state.client.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
