"""An engine log's last lines, asked of the hostd that runs the engine and answered over
pub/sub (`commands.TailLog`): the management API's `engine-log` route.

An engine keeps its log in a file, or, with retention: zero, in its log writer's memory only
(`capyctl_hostd.logwriter --memory`); either way the lines travel on a channel, which Redis
never writes to disk, and never through a key."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import redis.asyncio as aioredis
from pydantic import ValidationError

from capycommon.domain.commands import TailLog
from capycommon.domain.hosts import LogTail
from capycommon.state import keys
from capycommon.state.hostcommands import HostCommandStore


class EngineLogStore:
    """Engine log tails, asked of a host and answered on a channel of their own."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, host: str, reply: str, tail: LogTail) -> None:
        await self.client.publish(keys.engine_log_reply(host, reply), tail.model_dump_json())

    async def request(
        self, host: str, deployment: str, lines: int, timeout_s: float
    ) -> LogTail | None:
        """Ask the host for the tail of a deployment's engine log; None when no answer came
        in time (its hostd is not running)."""
        reply = secrets.token_hex(8)
        async with self.client.pubsub() as pubsub:
            await pubsub.subscribe(keys.engine_log_reply(host, reply))
            command = TailLog(deployment=deployment, reply=reply, lines=lines)
            await HostCommandStore(self.client).send(host, command)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        with contextlib.suppress(ValidationError):
                            return LogTail.model_validate_json(message["data"])
        return None
