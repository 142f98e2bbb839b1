"""The record a running role leaves in `<state>/run/role.json`, so commands find it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError

from capycommon.paths import StatePaths, write_atomic
from capycommon.redistarget import RedisTarget, control_target, joined_target

if TYPE_CHECKING:
    from capycommon.state.stores import Blocking


class RoleRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    version: str
    pid: int
    supervisord_pid: int
    started_at: float
    state_dir: str
    document: str | None
    processes: list[str]
    redis_url: str
    host: str | None
    listeners: dict[str, str]


def write(paths: StatePaths, record: RoleRecord) -> None:
    write_atomic(paths.role_record, record.model_dump_json(indent=2))


def read(paths: StatePaths) -> RoleRecord | None:
    """The record, or None when it is missing or unreadable."""
    try:
        return RoleRecord.model_validate_json(paths.role_record.read_bytes())
    except (OSError, ValidationError):
        return None


@contextmanager
def state_of(record: RoleRecord, timeout: float = 5.0) -> Iterator[Blocking]:
    """The state in the role's Redis, its client closed on exit."""
    with blocking_to(target_of(record), timeout) as state:
        yield state


def blocking_to(target: RedisTarget, timeout: float) -> Blocking:
    """The state in the Redis `target` names, over a client of its own whose every connect
    and reply waits at most `timeout` seconds. Close it when done."""
    # Only the commands that read Redis pay for its client.
    import redis.asyncio as aioredis  # noqa: PLC0415

    from capycommon.state.stores import Blocking  # noqa: PLC0415

    client = aioredis.Redis.from_url(
        target.url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        **target.client_options(),
    )
    return Blocking(client)


def target_of(record: RoleRecord) -> RedisTarget:
    """As whom the CLI talks to a running role's Redis: as the role's own services do."""
    paths = StatePaths(Path(record.state_dir))
    if record.role == "server" and record.redis_url == paths.redis_url:
        return control_target(paths)
    if record.role == "host" and paths.joined.exists():
        target = joined_target(paths)
        if target.url == record.redis_url:
            return target
    return RedisTarget(record.redis_url)
