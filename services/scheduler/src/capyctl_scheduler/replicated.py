"""A scheduler's part in replicated servers (`replication.*`).

- `UserMirror`: replication carries a Redis's data but not its users. Each server's scheduler
  makes its own Redis's host users match the record the primary keeps
  (`HostUserStore.mirror`) while that Redis is a replica, so whichever Redis becomes the
  primary already lets every joined host in, with its own password.
- `ConfirmedWrites`: a declaration the management API acknowledges is on a replica first. A
  mutation that succeeded waits for one replica to hold it (`ReplicaStore.confirm`); if none
  does within `replication.ack_timeout`, the answer is `503 not_replicated` instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capycommon.errors import NotReplicated
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.replicas import ReplicaStore
from capycommon.state.stores import State
from capyctl_scheduler.errorbody import error_response

log = logging.getLogger(__name__)

# How often a replica's users are compared with the record.
MIRROR_S = 1.0
# The methods that change what is declared.
MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class UserMirror:
    """This server's own Redis (its unix socket), kept with the primary's host users."""

    def __init__(self, local: aioredis.Redis) -> None:
        found = State(local)
        self.users = found.host_users
        self.replicas = found.replicas

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.once()
            except REDIS_ERRORS as exc:
                log.debug("host users: this server's Redis is away: %s", exc)
            await wait_event(stop, MIRROR_S)

    async def once(self) -> bool:
        """Mirror the record once, if this server's Redis is a replica; whether it is."""
        if (await self.replicas.info()).role == "master":
            return False  # the primary's users are the ones written; nothing to follow
        made, removed = await self.users.mirror(await self.users.recorded())
        if made or removed:
            log.info("host users follow the primary", extra={"made": made, "removed": removed})
        return True


class ConfirmedWrites:
    """ASGI middleware: a mutation's success is sent once a replica holds it."""

    def __init__(self, app: ASGIApp, replicas: ReplicaStore, timeout_s: float) -> None:
        self.app = app
        self.replicas = replicas
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in MUTATIONS:
            await self.app(scope, receive, send)
            return
        refused: list[bool] = []

        async def confirming(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                if await self._confirmed():
                    await send(message)
                    return
                refused.append(True)
                await self._refuse(scope, receive, send)
                return
            if not refused:
                await send(message)

        await self.app(scope, receive, confirming)

    async def _confirmed(self) -> bool:
        try:
            held = await self.replicas.confirm(1, self.timeout_s)
        except REDIS_ERRORS as exc:
            log.warning("could not confirm a declaration on a replica: %s", exc)
            return False
        return held >= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed = NotReplicated(
            f"the change was written on the primary, but no replica confirmed it within "
            f"{self.timeout_s:g} s; it stands unless the primary is lost first. Check "
            "`capyctl status` (replication), then retry with the same Idempotency-Key"
        )
        answer: Any = error_response(failed.http_status, failed.code, failed.message)
        await answer(scope, receive, send)
