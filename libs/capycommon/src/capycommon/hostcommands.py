"""Commands from the scheduler to a host's hostd, over the host's Redis stream.

Each command names the deployment, the instance and the generation it is for; hostd refuses
(and records) a command for a stale generation.
"""

from __future__ import annotations

from typing import Annotated, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from capycommon import keys

FIELD = "command"


class _Command(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: str
    instance: int = 0
    generation: int


class Launch(_Command):
    kind: Literal["launch"] = "launch"
    revision: int
    profile: str
    model_path: str
    served_name: str
    residency: Literal["host_backed", "deep", "restart_only"]
    gpu_uuid: str
    memory_fraction: float | None = None
    kv_cache_bytes: int | None = None
    context_length: int | None = None
    max_concurrent_requests: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    start_deadline_s: float = 1800.0


class Park(_Command):
    kind: Literal["park"] = "park"


class Wake(_Command):
    kind: Literal["wake"] = "wake"
    wake_deadline_s: float = 900.0


class Stop(_Command):
    kind: Literal["stop"] = "stop"
    reason: str = "requested"


class Abort(_Command):
    kind: Literal["abort"] = "abort"
    request_id: str


Command = Annotated[Launch | Park | Wake | Stop | Abort, Field(discriminator="kind")]
COMMAND = TypeAdapter(Command)


async def send(
    client: aioredis.Redis, host: str, command: Launch | Park | Wake | Stop | Abort
) -> str:
    """Append a command to the host's stream; returns its stream id."""
    entry = await client.xadd(keys.host_commands(host), {FIELD: command.model_dump_json()})
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def parse(raw: bytes | str) -> Launch | Park | Wake | Stop | Abort:
    return COMMAND.validate_json(raw)
