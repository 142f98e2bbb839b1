"""Writing instance state: every write is a compare-and-set on (state, generation), done in
one Lua function (`functions.TRANSITION`) together with its event and its notification, so
a stale writer loses cleanly and nobody sees a state without its event."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Literal, cast

import redis.asyncio as aioredis

from capycommon.domain.instances import Event, InstanceRecord, InstanceState
from capycommon.domain.notifications import Notification
from capycommon.state import functions, keys, quarantine

ABSENT = "absent"
_Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


class Conflict(Exception):
    """The record was not in an allowed state and generation; `current` is what it was."""

    def __init__(self, current: InstanceRecord | None) -> None:
        super().__init__("instance state changed under us")
        self.current = current


class InstanceStore:
    """hostd's writes and reads of its host's instance records."""

    def __init__(self, client: aioredis.Redis, host: str) -> None:
        self.client = client
        self.host = host

    async def get(self, deployment: str, index: int) -> InstanceRecord | None:
        """The record of the instance; None when there is none, or none to believe."""
        key = keys.instance(self.host, deployment, index)
        raw = await self.client.get(key)
        return None if raw is None else self._believed(key, f"{deployment}:{index}", raw)

    async def all(self) -> list[InstanceRecord]:
        """Every record on the host that can be believed (`_believed`)."""
        return self._all_believed(await self.raws())

    async def raws(self) -> list[tuple[str, bytes]]:
        """Each record on the host as written, by member (for readers that skip a malformed
        one rather than fail); a member that names no instance is passed over."""
        members = sorted(_text(m) for m in await self.client.smembers(keys.instances(self.host)))
        return await self._raws([m for m in members if _split(m) is not None])

    async def get_many(self, members: Iterable[str]) -> list[InstanceRecord]:
        """The records of these members that exist."""
        return self._all_believed(await self._raws([m for m in members if _split(m) is not None]))

    def _all_believed(self, found: list[tuple[str, bytes]]) -> list[InstanceRecord]:
        believed = (self._believed(self._key(m), m, raw) for m, raw in found)
        return [record for record in believed if record is not None]

    def _believed(self, key: str, member: str, raw: bytes | str) -> InstanceRecord | None:
        """The record `raw` read at `key`, when it is an instance record of this host and of
        that member; else None (refused: a host writes its own prefix as it likes, so who
        wrote a record, and what it is of, come from its key, never from its data)."""
        record = quarantine.parse(InstanceRecord, raw, key)
        if record is None:
            return None
        if record.host != self.host:
            quarantine.REFUSALS.refuse(
                key, raw, f"a record of host {self.host} names host {record.host!r}"
            )
            return None
        if record.member != member:
            quarantine.REFUSALS.refuse(key, raw, f"the record of {member} is of {record.member}")
            return None
        return record

    def _key(self, member: str) -> str:
        return keys.instance(self.host, *cast(tuple[str, int], _split(member)))

    async def _raws(self, members: list[str]) -> list[tuple[str, bytes]]:
        if not members:
            return []
        named = [self._key(m) for m in members]
        raws = cast(list[bytes | None], await self.client.mget(named))
        return [(m, raw) for m, raw in zip(members, raws, strict=True) if raw is not None]

    async def keep(self, record: InstanceRecord) -> None:
        """Write `record` back as it was read, with no compare-and-set, event or notification
        (the control plane's, for a host it cut off and whose keys it dropped)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(
                keys.instance(self.host, record.deployment, record.instance),
                record.model_dump_json(),
            )
            pipe.sadd(keys.instances(self.host), record.member)
            await pipe.execute()

    async def forget(self, deployment: str, index: int) -> None:
        """Remove every trace of the instance on the host: its record, its membership and its
        load (for a deployment that is deleted)."""
        member = f"{deployment}:{index}"
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.instance(self.host, deployment, index))
            pipe.srem(keys.instances(self.host), member)
            pipe.hdel(keys.engine_load(self.host), member)
            await pipe.execute()

    async def secret(self, deployment: str, index: int) -> str | None:
        """The key the instance's engine was launched with; None once it is stopped."""
        raw = await self.client.get(keys.instance_secret(self.host, deployment, index))
        return None if raw is None else _text(raw)

    async def keep_secret(self, deployment: str, index: int, secret: str) -> None:
        await self.client.set(keys.instance_secret(self.host, deployment, index), secret)

    async def drop_secret(self, deployment: str, index: int) -> None:
        await self.client.delete(keys.instance_secret(self.host, deployment, index))

    async def publish_log(self, deployment: str, index: int, lines: list[str]) -> None:
        """Replace the engine's last log lines kept in Redis with `lines`."""
        key = keys.instance_log(self.host, deployment, index)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if lines:
                pipe.rpush(key, *lines)
            await pipe.execute()

    async def transition(
        self,
        new: InstanceRecord,
        *,
        allowed: Iterable[InstanceState | Literal["absent"]],
        generation: int | None,
        reason: str,
        previous: InstanceRecord | None = None,
        engine_s: float | None = None,
    ) -> InstanceRecord:
        """Write `new` if the current record is in `allowed` at `generation`; else Conflict.
        `engine_s`: the engine's own part of the time since `previous` (`Event.engine_s`)."""
        now = time.time()
        event = Event(
            kind="transition",
            host=self.host,
            deployment=new.deployment,
            instance=new.instance,
            generation=new.generation,
            from_state=previous.state if previous else None,
            to_state=new.state,
            reason=reason,
            duration_s=round(now - previous.since, 3) if previous else None,
            engine_s=engine_s,
            at=now,
        )
        note = Notification(kind="instance", id=new.member, version=new.generation)
        result = await functions.call(
            self.client,
            functions.TRANSITION,
            [
                keys.instance(self.host, new.deployment, new.instance),
                keys.instances(self.host),
                keys.host_events(self.host),
                keys.host_notifications(self.host),
            ],
            [
                ",".join(str(s) for s in allowed),
                "" if generation is None else str(generation),
                new.model_dump_json(),
                event.model_dump_json(),
                new.member,
                note.model_dump_json(),
            ],
        )
        written, current = int(result[0]), result[1]
        if not written:
            key = keys.instance(self.host, new.deployment, new.instance)
            raise Conflict(self._believed(key, new.member, current) if current else None)
        return new

    async def move(
        self,
        record: InstanceRecord,
        state: InstanceState,
        reason: str,
        engine_s: float | None = None,
        **changes: object,
    ) -> InstanceRecord:
        """Move `record` on to `state` (with `changes`), if it is still as read; else
        Conflict. `engine_s`: the engine's own part of the step's time."""
        new = record.model_copy(update={"state": state, "since": time.time(), **changes})
        return await self.transition(
            new,
            allowed=[record.state],
            generation=record.generation,
            reason=reason,
            previous=record,
            engine_s=engine_s,
        )

    async def refused(self, deployment: str, index: int, generation: int, reason: str) -> None:
        """Record a command hostd would not carry out."""
        await self._note("refused", deployment, index, generation, reason)

    async def fenced(self, deployment: str, index: int, generation: int, reason: str) -> None:
        """Record a command refused for its scheduler's lost lease."""
        await self._note("fenced", deployment, index, generation, reason)

    async def uncounted(self, deployment: str, index: int, generation: int, reason: str) -> None:
        """Record an engine stopped because no instance record counted it (no record is
        written: the record is what Redis lost)."""
        await self._note("uncounted", deployment, index, generation, reason)

    async def _note(
        self,
        kind: Literal["refused", "fenced", "uncounted"],
        deployment: str,
        index: int,
        generation: int,
        reason: str,
    ) -> None:
        event = Event(
            kind=kind,
            host=self.host,
            deployment=deployment,
            instance=index,
            generation=generation,
            reason=reason,
            at=time.time(),
        )
        await EventStore(self.client).note(event)


def _split(member: str) -> tuple[str, int] | None:
    """(deployment, index) of a member `deployment:index`; None for anything else."""
    deployment, _, index = member.rpartition(":")
    return (deployment, int(index)) if deployment and index.isdigit() else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class EventStore:
    """Each host's event stream: what its instances went through, and why."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def note(self, event: Event) -> None:
        """Append `event` to its host's events."""
        await self.client.xadd(
            keys.host_events(event.host), {"event": event.model_dump_json()}, maxlen=10000
        )

    async def read(self, host: str, count: int = 1000) -> list[Event]:
        """The host's first `count` events, oldest first (malformed entries left out)."""
        key = keys.host_events(host)
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], await self.client.xrange(key, count=count)
        )
        return [event for _, fields in entries if (event := _event(fields, key)) is not None]

    async def recent(self, host: str, count: int) -> list[Event]:
        """The host's last `count` events, newest first (malformed entries left out)."""
        key = keys.host_events(host)
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], await self.client.xrevrange(key, count=count)
        )
        return [event for _, fields in entries if (event := _event(fields, key)) is not None]

    async def after(
        self, cursors: Mapping[str, str], count: int, block_ms: int | None = None
    ) -> list[tuple[str, str, Event | None]]:
        """The events after each host's cursor (a stream id), as (host, entry id, event); the
        event is None where the entry is malformed."""
        streams = {keys.host_events(host): cursor for host, cursor in cursors.items()}
        hosts = {stream: host for host, stream in zip(cursors, streams, strict=True)}
        read = cast(_Read, await self.client.xread(streams, count=count, block=block_ms))  # type: ignore[arg-type]
        found: list[tuple[str, str, Event | None]] = []
        for stream, entries in read or []:
            for entry_id, fields in entries:
                key = stream.decode()
                found.append((hosts[key], entry_id.decode(), _event(fields, key)))
        return found

    async def last_duration(
        self, host: str, deployment: str, from_state: str, count: int = 256
    ) -> float | None:
        """How long the deployment's last `from_state` -> ready took on the host (a start or
        a wake, `Event.duration_s`), from the newest `count` of the host's events; None when
        none of them is one."""
        for event in await self.recent(host, count):
            if (
                event.kind == "transition"
                and event.deployment == deployment
                and event.from_state == from_state
                and event.to_state == InstanceState.READY
                and event.duration_s is not None
            ):
                return event.duration_s
        return None


def _event(fields: dict[bytes, bytes], key: str) -> Event | None:
    return quarantine.parse_entry(Event, fields, "event", key)
