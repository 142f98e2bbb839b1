"""Commands from the scheduler to a host's hostd, over the host's Redis stream.

Each instance command names the deployment, the instance and the generation it is for; hostd
refuses (and records) a command for a stale generation. `Describe` asks for the facts of
model paths instead (`capycommon.state.hostfacts`); `Pull` and `Remove` act on the host's
model store. Launch, park, wake and stop carry the
scheduler's reason, which hostd writes into the events of the transitions it makes, so a
host's history says why each happened.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.commands import COMMAND, HostCommand
from capycommon.state import keys
from capycommon.state.streams import Group

FIELD = "command"
# The commands a host's stream keeps, the oldest trimmed first: hostd reads each within a
# second, and the stream counts against the host's share of Redis (its quota).
KEEP = 10_000


class HostCommandStore:
    """Each host's command stream."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def send(self, host: str, command: HostCommand) -> str:
        """Append a command to the host's stream; returns its stream id."""
        entry = await self.client.xadd(
            keys.host_commands(host),
            {FIELD: encode(command)},
            maxlen=KEEP,
            approximate=True,
        )
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    def group(self, host: str) -> Group:
        """hostd's reading of its host's command stream."""
        return Group(self.client, keys.host_commands(host), name="hostd", consumer="hostd")


# Fields a command gained after 0.1.7, left out while they hold their default: a host of an
# earlier release refuses a field it does not know, and reads every command that needs none.
LATER: dict[str, tuple[str, ...]] = {"launch": ("gpu_uuids", "tensor_parallel")}


def encode(command: HostCommand) -> str:
    """The command's JSON, without the later fields it leaves at their default."""
    fields = type(command).model_fields
    unset = {
        name
        for name in LATER.get(command.kind, ())
        if getattr(command, name) == fields[name].get_default(call_default_factory=True)
    }
    return command.model_dump_json(exclude=unset)


def parse(raw: bytes | str) -> HostCommand:
    return COMMAND.validate_json(raw)
