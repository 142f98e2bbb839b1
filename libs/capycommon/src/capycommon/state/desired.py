"""Desired state: the declared deployments, and the demands that ask for them.

The scheduler alone writes deployment records (through its management API and its choice
loop); routers and the CLI read them and append demands. Observed state (instances) is
hostd's and lives apart, under each host's prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal, cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.deployments import Deployment
from capycommon.state import hostcommands, keys, quarantine
from capycommon.state.hostcommands import HostCommand
from capycommon.state.notify import Notification
from capycommon.state.streams import Group

# A failed start or a crash is retried after these cooldowns: the first at once (a crash of a
# serving engine costs its waiting requests no more than a start), then backing off; one more
# failure and the deployment fails.
RETRY_COOLDOWNS_S = (0.0, 30.0, 60.0, 120.0)

DEMAND_FIELD = "demand"
# The choice stream keeps about this many of the scheduler's last choices.
EVENTS_MAXLEN = 10_000
CHOICE_FIELD = "event"
_Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]

# Why the scheduler takes a serving or parked engine out (parks or stops it), one word each:
# a switch made room for another model; an idle timeout; an operator's park, stop or delete;
# an operator's drain of its host; a new revision replaces it; cut requests hold every place
# (a restart); the host's bound on parked models.
EvictionCause = Literal["switch", "idle", "operator", "drain", "revision", "restart", "max_parked"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Inflight(_Frozen):
    """The one effect in flight for a deployment's instance, until hostd's record shows it.

    `from_state` and `from_generation` are the instance as it was when the effect began, so
    the effect is done once the record moved on (or hostd refused it)."""

    kind: Literal["launch", "wake", "park", "stop", "drain"]
    host: str
    gpu: str
    generation: int
    sent_at: float
    from_state: str | None = None
    from_generation: int | None = None
    # For a drain: what follows it once the engine reads idle.
    then: Literal["park", "stop"] | None = None
    reason: str = ""
    # For a drain, park or stop that takes a serving or parked engine out: why (counted
    # once, as an eviction, when the park or stop is done).
    cause: EvictionCause | None = None


class Attempts(_Frozen):
    """Failed starts in a row; `failed` once the retries are spent (cleared by a start)."""

    count: int = 0
    next_at: float | None = None
    last_error: str | None = None
    failed: bool = False
    # The generation whose failure was counted last, so one failure counts once.
    counted_generation: int = 0


class Operation(_Frozen):
    """The last thing done to a deployment, or why nothing could be."""

    kind: str
    reason: str
    at: float
    operation_id: str | None = None


class Refusal(_Frozen):
    """A demand that cannot be met at all, not merely not yet (the model does not fit even
    with every model that may be evicted stopped). Routers fail the requests that were
    waiting when it was written with its code; later requests ask again."""

    code: str
    message: str
    at: float


class Victim(_Frozen):
    """An instance a switch released, by its deployment and generation."""

    deployment: str
    generation: int


class Switch(_Frozen):
    """A switch under way to this deployment: when the scheduler decided to release the first
    of its victims (to start or wake it on `gpu` of `host`), and every victim released for it
    since. It ends when the deployment is ready."""

    host: str
    gpu: str
    started_at: float
    victims: tuple[Victim, ...] = ()


class Choice(_Frozen):
    """One choice of the scheduler, in the control plane's events stream.

    `evicted`: a park or stop that took a serving or parked engine out is done, with its
    `cause`. `switched`: a switch ended with its deployment ready, `duration_s` after the
    scheduler decided to release its first victim, `engine_s` of it the engines' own part
    (the victims' sleep calls and stops, the deployment's load or wake calls)."""

    kind: str
    deployment: str
    reason: str
    host: str | None = None
    generation: int | None = None
    at: float
    cause: EvictionCause | None = None
    duration_s: float | None = None
    engine_s: float | None = None


class DeploymentRecord(_Frozen):
    """One declared deployment: its document and what the operator and the scheduler want."""

    name: str
    revision: int
    digest: str
    document: Deployment
    created_at: float
    updated_at: float
    # An operator stop: on-demand activation is suspended (requests get deployment_stopped)
    # until an operator start.
    stopped: bool = False
    # For activation: explicit, the operator's last start (ready) or park (parked).
    wanted: Literal["ready", "parked"] | None = None
    # An operator park of an on-demand deployment, for the generation it names, until a
    # demand wakes it (the wake clears it) or a start draws a new generation.
    park_requested: int | None = None
    # A drain of the host the instance of this generation runs on: stop it, stay on demand.
    stop_requested: int | None = None
    deleting: bool = False
    # The last generation drawn; each activation draws the next.
    generation: int = 0
    # The host that generation was placed on, by the scheduler's own choice: no other
    # host's record of it is believed (`capycommon.state.ownership`). None for a record
    # written before placements were kept, until its next activation.
    host: str | None = None
    inflight: Inflight | None = None
    attempts: Attempts = Attempts()
    last_operation: Operation | None = None
    refusal: Refusal | None = None
    # A switch under way to this deployment, until it is ready.
    switch: Switch | None = None
    version: int = 0

    @property
    def activation(self) -> str:
        return self.document.lifecycle.activation


class DeploymentStore:
    """The scheduler's reads and writes of deployment records."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self, name: str) -> DeploymentRecord | None:
        key = keys.deployment(name)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(DeploymentRecord, raw, key)

    async def all(self) -> dict[str, DeploymentRecord]:
        names = sorted(_text(n) for n in await self.client.smembers(keys.deployments()))
        if not names:
            return {}
        raws = await self.client.mget([keys.deployment(name) for name in names])
        return _records(names, raws)

    async def put(self, record: DeploymentRecord, choice: str | None = None) -> DeploymentRecord:
        """Write the record (its version bumped) and announce it; with `choice` (the JSON
        of the scheduler's choice) append that to the choice stream too."""
        return await self._write(record, choice, None)

    async def send(
        self, record: DeploymentRecord, choice: str, host: str, command: HostCommand
    ) -> DeploymentRecord:
        """As `put`, and send `command` to `host`, all in one transaction: the record with its
        effect in flight never stands without the command, nor the command without it."""
        return await self._write(record, choice, (host, command))

    async def chose(self, choice: str) -> None:
        """Append a choice that changed no record to the choice stream."""
        await self.client.xadd(keys.events(), {CHOICE_FIELD: choice}, maxlen=EVENTS_MAXLEN)

    async def _write(
        self,
        record: DeploymentRecord,
        choice: str | None,
        command: tuple[str, HostCommand] | None,
    ) -> DeploymentRecord:
        written = record.model_copy(update={"version": record.version + 1})
        note = Notification(kind="deployment", id=record.name, version=written.version)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.deployment(record.name), written.model_dump_json())
            pipe.sadd(keys.deployments(), record.name)
            if command is not None:
                host, sent = command
                pipe.xadd(
                    keys.host_commands(host),
                    {hostcommands.FIELD: sent.model_dump_json()},
                    maxlen=hostcommands.KEEP,
                    approximate=True,
                )
            if choice is not None:
                pipe.xadd(keys.events(), {CHOICE_FIELD: choice}, maxlen=EVENTS_MAXLEN)
            pipe.publish(keys.notifications(), note.model_dump_json())
            await pipe.execute()
        return written

    async def forget(self, name: str) -> None:
        note = Notification(kind="deployment", id=name, version=0)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.deployment(name))
            pipe.srem(keys.deployments(), name)
            pipe.publish(keys.notifications(), note.model_dump_json())
            await pipe.execute()


def read_all(client: redis.Redis) -> dict[str, DeploymentRecord]:
    """Every deployment record (for readers outside the scheduler)."""
    names = sorted(_text(n) for n in cast(set[bytes], client.smembers(keys.deployments())))
    if not names:
        return {}
    raws = cast(list[bytes | None], client.mget([keys.deployment(name) for name in names]))
    return _records(names, raws)


def _records(names: list[str], raws: Sequence[bytes | str | None]) -> dict[str, DeploymentRecord]:
    """The deployment records read for `names`, by name; one that is absent, malformed or
    stored under another name is left out (refused)."""
    found = quarantine.parse_many(
        DeploymentRecord, dict(zip((keys.deployment(n) for n in names), raws, strict=True))
    )
    records = {}
    for key, record in found.items():
        if key != keys.deployment(record.name):
            quarantine.REFUSALS.refuse(key, record.name, f"names deployment {record.name!r}")
            continue
        records[record.name] = record
    return records


async def read_choices(
    client: aioredis.Redis, cursor: str, count: int, block_ms: int | None = None
) -> list[tuple[str, Choice | None]]:
    """The choices after `cursor` (a stream id), as (entry id, choice); the choice is
    None where the entry is malformed."""
    streams = {keys.events(): cursor}
    read = cast(_Read, await client.xread(streams, count=count, block=block_ms))  # type: ignore[arg-type]
    found: list[tuple[str, Choice | None]] = []
    for _, entries in read or []:
        for entry_id, fields in entries:
            choice = quarantine.parse_entry(Choice, fields, CHOICE_FIELD, keys.events())
            found.append((_text(entry_id), choice))
    return found


async def recent_choices(client: aioredis.Redis, count: int) -> list[Choice]:
    """The scheduler's last `count` choices, newest first (malformed entries left out)."""
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await client.xrevrange(keys.events(), count=count),
    )
    found = (quarantine.parse_entry(Choice, f, CHOICE_FIELD, keys.events()) for _, f in entries)
    return [choice for choice in found if choice is not None]


class Demand(_Frozen):
    """A model is wanted: a request waits for it, or an operator started it. With `restart`,
    its instance of that generation must be stopped first: cut requests hold every place."""

    deployment: str
    source: str
    at: float
    restart: int | None = None


async def demand(
    client: aioredis.Redis, deployment: str, source: str, restart: int | None = None
) -> None:
    """Ask the scheduler to make `deployment` ready (one entry per wave of requests)."""
    entry = Demand(deployment=deployment, source=source, at=time.time(), restart=restart)
    await client.xadd(keys.demands(), {DEMAND_FIELD: entry.model_dump_json()}, maxlen=100_000)
    note = Notification(kind="demand", id=deployment, version=int(entry.at * 1000))
    await client.publish(keys.notifications(), note.model_dump_json())


def demand_group(client: aioredis.Redis) -> Group:
    """The scheduler's reading of the demand stream."""
    return Group(client, keys.demands(), name="scheduler", consumer="scheduler")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
