"""Desired state: the declared deployments, and the demands that ask for them.

The scheduler alone writes deployment records (through its management API and its choice
loop); routers and the CLI read them and append demands. Observed state (instances) is
hostd's and lives apart, under each host's prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis

from capycommon.domain.commands import HostCommand
from capycommon.domain.desired import Choice, Demand, DeploymentRecord
from capycommon.domain.notifications import Notification
from capycommon.state import hostcommands, keys, quarantine
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
        self,
        record: DeploymentRecord,
        choice: str,
        host: str,
        command: HostCommand,
        epoch: int | None = None,
    ) -> DeploymentRecord:
        """As `put`, and send `command` to `host` with the sender's fencing epoch, all in one
        transaction: the record with its effect in flight never stands without the command,
        nor the command without it."""
        return await self._write(record, choice, (host, command, epoch))

    async def chose(self, choice: str) -> None:
        """Append a choice that changed no record to the choice stream."""
        await self.client.xadd(keys.events(), {CHOICE_FIELD: choice}, maxlen=EVENTS_MAXLEN)

    async def _write(
        self,
        record: DeploymentRecord,
        choice: str | None,
        command: tuple[str, HostCommand, int | None] | None,
    ) -> DeploymentRecord:
        written = record.model_copy(update={"version": record.version + 1})
        note = Notification(kind="deployment", id=record.name, version=written.version)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.deployment(record.name), written.model_dump_json())
            pipe.sadd(keys.deployments(), record.name)
            if command is not None:
                host, sent, epoch = command
                pipe.xadd(
                    keys.host_commands(host),
                    hostcommands.fields_of(sent, epoch),
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


class ChoiceStore:
    """The scheduler's choices, as the choice stream keeps them."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def after(
        self, cursor: str, count: int, block_ms: int | None = None
    ) -> list[tuple[str, Choice | None]]:
        """The choices after `cursor` (a stream id), as (entry id, choice); the choice is
        None where the entry is malformed."""
        streams = {keys.events(): cursor}
        read = cast(_Read, await self.client.xread(streams, count=count, block=block_ms))  # type: ignore[arg-type]
        found: list[tuple[str, Choice | None]] = []
        for _, entries in read or []:
            for entry_id, fields in entries:
                choice = quarantine.parse_entry(Choice, fields, CHOICE_FIELD, keys.events())
                found.append((_text(entry_id), choice))
        return found

    async def recent(self, count: int) -> list[Choice]:
        """The scheduler's last `count` choices, newest first (malformed entries left out)."""
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await self.client.xrevrange(keys.events(), count=count),
        )
        key = keys.events()
        found = (quarantine.parse_entry(Choice, f, CHOICE_FIELD, key) for _, f in entries)
        return [choice for choice in found if choice is not None]


class DemandStore:
    """The routers' demands for deployments, which the scheduler reads as a group."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def ask(self, deployment: str, source: str, restart: int | None = None) -> None:
        """Ask the scheduler to make `deployment` ready (one entry per wave of requests)."""
        entry = Demand(deployment=deployment, source=source, at=time.time(), restart=restart)
        await self.client.xadd(
            keys.demands(), {DEMAND_FIELD: entry.model_dump_json()}, maxlen=100_000
        )
        note = Notification(kind="demand", id=deployment, version=int(entry.at * 1000))
        await self.client.publish(keys.notifications(), note.model_dump_json())

    def group(self) -> Group:
        """The scheduler's reading of the demand stream."""
        return Group(self.client, keys.demands(), name="scheduler", consumer="scheduler")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
