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
from redis.typing import EncodableT, FieldT

from capycommon.domain.commands import COMMAND, HostCommand
from capycommon.state import keys
from capycommon.state.streams import Group

FIELD = "command"
# The fencing epoch of the scheduler that sent an instance command (`capycommon.state.leader`),
# beside the command rather than in it: a host of an earlier release ignores a field it does
# not know in an entry, and refuses one in a command.
EPOCH_FIELD = "epoch"
# The commands a host's stream keeps, the oldest trimmed first: hostd reads each within a
# second, and the stream counts against the host's share of Redis (its quota).
KEEP = 10_000


class HostCommandStore:
    """Each host's command stream."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def send(self, host: str, command: HostCommand, epoch: int | None = None) -> str:
        """Append a command to the host's stream, with the sender's fencing epoch when it
        holds the scheduler lease; returns its stream id."""
        entry = await self.client.xadd(
            keys.host_commands(host),
            fields_of(command, epoch),
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


def fields_of(command: HostCommand, epoch: int | None = None) -> dict[FieldT, EncodableT]:
    """A command's stream entry: the command, and the sender's fencing epoch if it has one."""
    fields: dict[FieldT, EncodableT] = {FIELD: encode(command)}
    if epoch is not None:
        fields[EPOCH_FIELD] = str(epoch)
    return fields


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


def epoch_of(fields: dict[bytes, bytes]) -> int | None:
    """The fencing epoch an entry carries; None for none. ValueError for one that is not a
    whole number."""
    raw = fields.get(EPOCH_FIELD.encode())
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise ValueError(f"epoch {raw[:32]!r} is not a whole number")
    return int(raw)
