"""Which of the host's instances serve, and at which generation: the ingress's view of the
host's instance records, so a request is checked without a Redis round trip.

The view follows the host's notifications: each one about an instance re-reads that
instance's record, and every (re)subscription re-reads them all, since a notification may
have been missed meanwhile. One task reads them in turn, so a later read is never
overwritten by an earlier one.

A notification arrives a moment after its write, so the view may lag a transition by that
much. A request it does not pass is checked once more against the record in Redis
(`confirm`) before it is refused: a router that saw an instance become ready before this
view did is not turned away. One it passes may, in that moment, reach an engine that just
began to park or stop, as it would have without the check; the router's own admission
already refuses both.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pydantic import ValidationError

from capycommon.domain.instances import InstanceState
from capycommon.domain.notifications import Notification
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state import notify
from capycommon.state.store import InstanceStore
from capycommon.state.stores import State

log = logging.getLogger(__name__)
S = InstanceState
SERVING = frozenset({S.READY, S.DRAINING})
# After the subscription failed (Redis away), the next try.
RETRY_S = 1.0


@dataclass
class Serving:
    store: InstanceStore
    state: State
    host: str
    # Each instance's generation and state, as last read.
    _seen: dict[str, tuple[int, InstanceState]] = field(default_factory=dict)

    def serves(self, member: str, generation: int) -> bool:
        """Whether the instance `member` serves at `generation`, as last seen."""
        return _serves(self._seen.get(member), generation)

    async def confirm(self, member: str, generation: int) -> bool:
        """Whether the instance serves at `generation`, its record read now (the view is
        left to its follower)."""
        return _serves(await self._read(member), generation)

    async def follow(self, stop: asyncio.Event) -> None:
        """Keep the view current until stopped (or cancelled)."""
        channel = notify.host_channel(self.host)
        while not stop.is_set():
            try:
                async with notify.subscribed(self.state.client, [channel]) as pubsub:
                    await self._read_all()
                    async for message in pubsub.listen():
                        member = _instance(message.get("data"))
                        if member is None:
                            continue
                        seen = await self._read(member)
                        if seen is None:
                            self._seen.pop(member, None)
                        else:
                            self._seen[member] = seen
            except REDIS_ERRORS as exc:
                log.debug("the ingress's view of the instances lost Redis: %s", exc)
                await wait_event(stop, RETRY_S)

    async def _read_all(self) -> None:
        # A record this view cannot check is refused by the store, and left out.
        records = await self.store.all()
        self._seen = {record.member: (record.generation, record.state) for record in records}

    async def _read(self, member: str) -> tuple[int, InstanceState] | None:
        """The instance's generation and state in Redis; None when it has no record."""
        deployment, _, index = member.rpartition(":")
        if not deployment or not index.isdigit():
            return None
        record = await self.store.get(deployment, int(index))
        return None if record is None else (record.generation, record.state)


def _serves(seen: tuple[int, InstanceState] | None, generation: int) -> bool:
    return seen is not None and seen[0] == generation and seen[1] in SERVING


def _instance(data: object) -> str | None:
    """The member a message of the host's channel announces, if it is an instance's."""
    if not isinstance(data, bytes | str):
        return None
    try:
        note = Notification.model_validate_json(data)
    except ValidationError:
        return None
    return note.id if note.kind == "instance" else None
