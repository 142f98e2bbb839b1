"""Writing instance state: every write is a compare-and-set on (state, generation), done in
one Lua script together with its event and its notification, so a stale writer loses
cleanly and nobody sees a state without its event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Literal, cast

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.state import keys
from capycommon.state.instances import InstanceRecord, InstanceState
from capycommon.state.notify import Notification

ABSENT = "absent"

# KEYS: instance, instances set, events stream, notify channel.
# ARGV: allowed states (comma list, may include "absent"), expected generation ("" = any),
#       new record, event, member, notification.
_TRANSITION = """
local current = redis.call('GET', KEYS[1])
local state = 'absent'
if current then
  local record = cjson.decode(current)
  state = record['state']
  if ARGV[2] ~= '' and tostring(record['generation']) ~= ARGV[2] then
    return {0, current}
  end
end
local allowed = false
for name in string.gmatch(ARGV[1], '[^,]+') do
  if name == state then allowed = true end
end
if not allowed then return {0, current or ''} end
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[5])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'event', ARGV[4])
redis.call('PUBLISH', KEYS[4], ARGV[6])
return {1, ARGV[3]}
"""


class Event(BaseModel):
    """One thing that happened to an instance, with why and how long it took."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["transition", "refused"]
    host: str
    deployment: str
    instance: int
    generation: int
    from_state: str | None = None
    to_state: str | None = None
    reason: str
    duration_s: float | None = None
    at: float


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
        self._script = client.register_script(_TRANSITION)

    async def get(self, deployment: str, index: int) -> InstanceRecord | None:
        raw = await self.client.get(keys.instance(self.host, deployment, index))
        return None if raw is None else InstanceRecord.model_validate_json(raw)

    async def all(self) -> list[InstanceRecord]:
        members = sorted(_text(m) for m in await self.client.smembers(keys.instances(self.host)))
        records = []
        for member in members:
            deployment, _, index = member.rpartition(":")
            record = await self.get(deployment, int(index))
            if record is not None:
                records.append(record)
        return records

    async def transition(
        self,
        new: InstanceRecord,
        *,
        allowed: Iterable[InstanceState | Literal["absent"]],
        generation: int | None,
        reason: str,
        previous: InstanceRecord | None = None,
    ) -> InstanceRecord:
        """Write `new` if the current record is in `allowed` at `generation`; else Conflict."""
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
            at=now,
        )
        note = Notification(kind="instance", id=new.member, version=new.generation)
        result = await self._script(
            keys=[
                keys.instance(self.host, new.deployment, new.instance),
                keys.instances(self.host),
                keys.host_events(self.host),
                keys.host_notifications(self.host),
            ],
            args=[
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
            raw = current.decode() if isinstance(current, bytes) else current
            raise Conflict(InstanceRecord.model_validate_json(raw) if raw else None)
        return new

    async def refused(self, deployment: str, index: int, generation: int, reason: str) -> None:
        """Record a command hostd would not carry out."""
        event = Event(
            kind="refused",
            host=self.host,
            deployment=deployment,
            instance=index,
            generation=generation,
            reason=reason,
            at=time.time(),
        )
        await self.client.xadd(
            keys.host_events(self.host), {"event": event.model_dump_json()}, maxlen=10000
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def read_events(client: aioredis.Redis, host: str, count: int = 1000) -> list[Event]:
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await client.xrange(keys.host_events(host), count=count),
    )
    return [Event.model_validate(json.loads(fields[b"event"])) for _, fields in entries]
